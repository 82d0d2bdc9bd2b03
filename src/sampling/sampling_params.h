// Per-request sampling settings, as a client sends them (OpenAI / llama.cpp field meanings).
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>

#include "core/error.h"

namespace kestrel {

// A sampling field outside its range. field: the OpenAI / vLLM name ("temperature", "logit_bias");
// token: the logit_bias entry's id (-1 for other fields); rule: what the value must be ("must be in
// [0, 2] (0 = greedy)"). what(): "sampling parameter <field> = <value> is invalid: <rule>".
class SamplingParamError : public Error {
 public:
  SamplingParamError(std::string field, int32_t token, std::string rule, const std::string& what)
      : Error(what), field_(std::move(field)), token_(token), rule_(std::move(rule)) {}
  const std::string& field() const { return field_; }
  int32_t token() const { return token_; }
  const std::string& rule() const { return rule_; }

 private:
  std::string field_;
  int32_t token_;
  std::string rule_;
};

// The ranges validate() enforces, OpenAI's where it has one. Within them no finite logit of
// magnitude below FLT_MAX / 100 (about 3.4e36; a model's are O(10)) becomes inf or NaN: a bias of
// at most 100 is added, a repetition penalty of at least 0.01 divides (or of at most 100
// multiplies) a logit by at most 100, presence and frequency penalties subtract at most 2 per
// occurrence, and temperature rescales logits only after the maximum is subtracted (<= 0).
inline constexpr float kMaxTemperature = 2.0f;         // OpenAI's range [0, 2]
inline constexpr float kMinRepetitionPenalty = 0.01f;  // vLLM and HF take any value > 0
inline constexpr float kMaxRepetitionPenalty = 100.0f;
inline constexpr float kMaxPenalty = 2.0f;             // OpenAI presence/frequency: [-2, 2]
inline constexpr float kMaxLogitBias = 100.0f;         // OpenAI logit_bias: [-100, 100]

struct SamplingParams {
  // Divides the logits before the final softmax. 0 means greedy (argmax, ties to the lowest id).
  float temperature = 1.0f;
  // Keep only the top_k highest logits; 0 turns it off.
  int32_t top_k = 0;
  // Nucleus sampling (Holtzman et al. 2019, "The Curious Case of Neural Text Degeneration"):
  // keep the smallest set of most likely tokens whose probability mass is >= top_p. 1 = off.
  float top_p = 1.0f;
  // Keep tokens whose probability is >= min_p times the most likely token's. 0 = off.
  float min_p = 0.0f;
  // CTRL (Keskar et al. 2019) / llama.cpp semantics: for each distinct token among the last
  // repeat_last_n previous tokens, a positive logit is divided by the penalty and a negative one
  // multiplied by it. 1 = off.
  float repetition_penalty = 1.0f;
  // How many trailing previous tokens the repetition penalty looks at; 0 = none, -1 = all of them.
  int32_t repeat_last_n = 64;
  // OpenAI semantics: logit -= presence_penalty * (count > 0) + frequency_penalty * count, where
  // count is how often the token occurs in all the previous tokens the caller passes. 0 = off.
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  // Added to the logit of the given token id (OpenAI logit_bias). Ids are checked against the
  // vocabulary by Sampler's constructor, which knows its size.
  std::unordered_map<int32_t, float> logit_bias;
  // Seeds the sampler's RNG: the same seed, params and logits give the same tokens on every
  // platform. Callers that want fresh randomness per request pick a seed themselves.
  uint64_t seed = 0;

  // The one place for the ranges (CLI flags and request fields alike). Throws SamplingParamError
  // naming the first out-of-range field and its value: a non-finite float, temperature outside
  // [0, 2], top_k < 0, top_p outside (0, 1], min_p outside [0, 1], repetition_penalty outside
  // [0.01, 100], repeat_last_n < -1, presence_penalty or frequency_penalty outside [-2, 2], a
  // logit_bias entry with a negative id or a bias outside [-100, 100].
  void validate() const;
};

}  // namespace kestrel
