// Log-probabilities of tokens under the model's own distribution: log_softmax of the raw logits,
// before any penalty, bias, truncation or temperature (what OpenAI-style `logprobs` report, and
// vLLM's default "raw" logprobs mode).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace kestrel {

struct TokenLogprob {
  int32_t token;
  float logprob;  // natural log, <= 0
};

struct LogprobSummary {
  TokenLogprob chosen;             // the given token
  std::vector<TokenLogprob> top;   // the n_top most likely tokens, most likely first (ties: lower id)
  // The given token's rank in the vocabulary: 1 + the tokens with a higher logit (vLLM's Logprob.rank;
  // tied tokens share a rank). top[i]'s rank is i + 1.
  int32_t chosen_rank = 0;
};

// `logits`: [n_vocab] raw model logits. `token` must be in [0, n_vocab); n_top is clamped to
// [0, n_vocab]. log_softmax is computed in double (max-shifted log-sum-exp). O(n_vocab + n log n_top).
// Errors: asserts that the logits have a finite maximum.
LogprobSummary compute_logprobs(std::span<const float> logits, int32_t token, int32_t n_top);

}  // namespace kestrel
