#include "sampling/sampling_params.h"

#include <cmath>
#include <sstream>
#include <string>

#include "core/error.h"

namespace kestrel {
namespace {

template <typename T>
[[noreturn]] void reject(const char* field, T value, const char* rule) {
  std::ostringstream msg;
  msg << "sampling parameter " << field << " = " << value << " is invalid: " << rule;
  throw Error(msg.str());
}

void require_finite(const char* field, float value) {
  if (!std::isfinite(value)) reject(field, value, "must be a finite number");
}

}  // namespace

void SamplingParams::validate() const {
  require_finite("temperature", temperature);
  require_finite("top_p", top_p);
  require_finite("min_p", min_p);
  require_finite("repetition_penalty", repetition_penalty);
  require_finite("presence_penalty", presence_penalty);
  require_finite("frequency_penalty", frequency_penalty);
  if (temperature < 0.0f) reject("temperature", temperature, "must be >= 0 (0 means greedy)");
  if (top_k < 0) reject("top_k", top_k, "must be >= 0 (0 turns it off)");
  if (!(top_p > 0.0f && top_p <= 1.0f)) reject("top_p", top_p, "must be in (0, 1]");
  if (!(min_p >= 0.0f && min_p <= 1.0f)) reject("min_p", min_p, "must be in [0, 1]");
  if (repetition_penalty <= 0.0f) {
    reject("repetition_penalty", repetition_penalty, "must be > 0 (1 turns it off)");
  }
  if (repeat_last_n < -1) reject("repeat_last_n", repeat_last_n, "must be >= -1 (-1 means all)");
  for (const auto& [id, bias] : logit_bias) {
    if (id < 0) reject("logit_bias token id", id, "must be >= 0");
    if (!std::isfinite(bias)) {
      reject(("logit_bias[" + std::to_string(id) + "]").c_str(), bias, "must be a finite number");
    }
  }
}

}  // namespace kestrel
