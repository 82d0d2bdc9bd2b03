// Per-request sampling settings, as a client sends them (OpenAI / llama.cpp field meanings).
#pragma once

#include <cstdint>
#include <unordered_map>

namespace kestrel {

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

  // Throws kestrel::Error naming the first out-of-range field and its value: non-finite floats,
  // temperature < 0, top_k < 0, top_p outside (0, 1], min_p outside [0, 1],
  // repetition_penalty <= 0, repeat_last_n < -1, a logit_bias entry with a negative id.
  void validate() const;
};

}  // namespace kestrel
