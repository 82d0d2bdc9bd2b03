#include "sampling/sampling_params.h"

#include <cmath>
#include <sstream>
#include <string>

namespace kestrel {
namespace {

template <typename T>
[[noreturn]] void reject(const std::string& field, T value, const std::string& rule, int32_t token = -1) {
  std::ostringstream msg;
  msg << "sampling parameter " << (token >= 0 ? field + "[" + std::to_string(token) + "]" : field) << " = " << value
      << " is invalid: " << rule;
  throw SamplingParamError(field, token, rule, msg.str());
}

// lo <= value <= hi; NaN fails.
void require_in(const char* field, float value, float lo, float hi, const std::string& rule) {
  if (!(value >= lo && value <= hi)) reject(field, value, rule);
}

std::string range(float lo, float hi) {
  std::ostringstream s;
  s << "must be in [" << lo << ", " << hi << "]";
  return s.str();
}

}  // namespace

void SamplingParams::validate() const {
  require_in("temperature", temperature, 0.0f, kMaxTemperature, range(0.0f, kMaxTemperature) + " (0 = greedy)");
  if (top_k < 0) reject("top_k", top_k, "must be >= 0 (0 turns it off)");
  if (!(top_p > 0.0f && top_p <= 1.0f)) reject("top_p", top_p, "must be in (0, 1]");
  require_in("min_p", min_p, 0.0f, 1.0f, range(0.0f, 1.0f));
  require_in("repetition_penalty", repetition_penalty, kMinRepetitionPenalty, kMaxRepetitionPenalty,
             range(kMinRepetitionPenalty, kMaxRepetitionPenalty) + " (1 turns it off)");
  if (repeat_last_n < -1) reject("repeat_last_n", repeat_last_n, "must be >= -1 (-1 means all)");
  require_in("presence_penalty", presence_penalty, -kMaxPenalty, kMaxPenalty, range(-kMaxPenalty, kMaxPenalty));
  require_in("frequency_penalty", frequency_penalty, -kMaxPenalty, kMaxPenalty, range(-kMaxPenalty, kMaxPenalty));
  for (const auto& [id, bias] : logit_bias) {
    if (id < 0) reject("logit_bias", id, "the token id must be >= 0");
    if (!(bias >= -kMaxLogitBias && bias <= kMaxLogitBias))
      reject("logit_bias", bias, range(-kMaxLogitBias, kMaxLogitBias), id);
  }
}

}  // namespace kestrel
