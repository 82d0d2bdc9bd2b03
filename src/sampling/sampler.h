// Turns one sequence's logits into its next token: the processor chain of logits_processors.h,
// then softmax and a seeded draw (or argmax when temperature is 0).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "sampling/candidate_list.h"
#include "sampling/logits_processor.h"
#include "sampling/logprobs.h"
#include "sampling/rng.h"
#include "sampling/sampling_params.h"

namespace kestrel {

struct SampledToken {
  int32_t token;
  // The model's own log-probabilities (log_softmax of the raw logits, see logprobs.h) of the
  // chosen token and of the n_top most likely tokens; `top` is empty when n_top is 0.
  LogprobSummary logprobs;
};

// One per sequence: it owns the RNG stream, so a sequence's draws do not depend on which other
// sequences share its batch. Not thread-safe; cheap to construct.
class Sampler {
 public:
  // Errors: kestrel::Error when params.validate() fails, n_vocab <= 0, or a logit_bias id is not
  // in [0, n_vocab) (the message names the field and the value).
  Sampler(const SamplingParams& params, int32_t n_vocab);

  // `logits`: [n_vocab] raw logits of the next position. `previous_tokens`: the sequence's earlier
  // token ids, oldest first, each in [0, n_vocab); the penalties read them (pass only generated
  // tokens for OpenAI's presence/frequency semantics). Returns a token id in [0, n_vocab).
  // Greedy (temperature 0) takes the argmax after bias and penalties, lowest id on ties, and does
  // not advance the RNG; otherwise exactly one RNG draw is used per call.
  // Errors: asserts the sizes and ids above; NonFiniteLogitsError (candidate_list.h) for a NaN or
  // +inf logit, or none finite, in `logits` (Source::Model) or after bias and penalties
  // (Source::Processing): the caller ends this sequence only.
  // n_prompt: how many of previous_tokens are the prompt. The OpenAI presence and frequency
  // penalties count only the tokens after it (generated ones); the repetition penalty counts all.
  // The CLI passes 0 (llama.cpp counts every earlier token); the serving engine the prompt length.
  int32_t sample(std::span<const float> logits, std::span<const int32_t> previous_tokens, size_t n_prompt = 0);

  // sample() plus the logprobs of the chosen token and of the n_top most likely ones.
  SampledToken sample_with_logprobs(std::span<const float> logits,
                                    std::span<const int32_t> previous_tokens, int32_t n_top, size_t n_prompt = 0);

  // True when the chain holds only what the CUDA sampler (cuda_ops.h: sample_tokens) implements:
  // top_k, top_p, min_p and temperature, without logit_bias and without repetition, presence or
  // frequency penalties. Such a sampler's token can then be drawn on the device from
  // {temperature, top_k, top_p, min_p, take_uniform()}.
  bool device_compatible() const;

  // The uniform the next sample() would draw from, in [0, 1), advancing the RNG exactly as that
  // sample() would: one next_double() when temperature > 0; greedy uses none and returns 0. Call it
  // instead of sample() (not as well) when the token is drawn on the device, so the sequence's
  // random stream stays the one the CPU path would have used.
  double take_uniform();
  // The uniforms the next out.size() take_uniform() calls would return, in order, without
  // advancing the RNG (greedy: zeros). Speculative verification on the device draws one row per
  // draft position with them and then takes as many as the emitted tokens used.
  void peek_uniforms(std::span<double> out) const;
  // What sample() returns for these logits when its draw is `uniform` (in [0, 1)), for a
  // device_compatible() chain, without touching the RNG: the host reference of the device sampler
  // (cuda::sample_tokens). Errors: asserts device_compatible() and the size; NonFiniteLogitsError
  // as sample().
  int32_t sample_with_uniform(std::span<const float> logits, double uniform);

  // The distribution sample() draws from for these arguments: the candidates left after the whole
  // chain (bias, penalties, truncation, temperature) with their softmax probs, in the chain's
  // order; greedy gives the argmax alone with prob 1. Speculative decoding's verifier reads p(x)
  // from it (vLLM's definition of the target distribution). Does not touch the RNG. Valid until
  // the next call. Errors: as sample().
  std::span<const TokenCandidate> distribution(std::span<const float> logits,
                                               std::span<const int32_t> previous_tokens, size_t n_prompt = 0);

  const SamplingParams& params() const { return params_; }
  // The chain in the order it runs (for logs and tests).
  const std::vector<std::unique_ptr<LogitsProcessor>>& chain() const { return chain_; }

 private:
  int32_t draw(double uniform);

  SamplingParams params_;
  int32_t n_vocab_;
  std::vector<std::unique_ptr<LogitsProcessor>> chain_;
  Rng rng_;
  CandidateList candidates_;  // reused across calls to avoid a vocabulary-sized allocation each
};

}  // namespace kestrel
