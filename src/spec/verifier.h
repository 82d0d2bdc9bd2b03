// Verification of draft tokens by rejection sampling (Leviathan et al. 2023, "Fast Inference from
// Transformers via Speculative Decoding", Algorithm 1 and Appendix A.1; Chen et al. 2023,
// "Accelerating Large Language Model Decoding with Speculative Sampling", Algorithm 2): the
// emitted tokens have exactly the distribution the target's own sampling would give them, one at a
// time, whatever the drafter proposed.
//
// p at each position is the target's distribution after the request's whole sampling chain
// (Sampler::distribution: bias, penalties counted over the tokens before that position, top-k,
// top-p, min-p, temperature), as vLLM defines it.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "sampling/logprobs.h"
#include "sampling/sampler.h"

namespace kestrel {

struct Verification {
  // [n_accepted + 1] the accepted drafts, then the token sampled after them (the correction at the
  // first rejection, or the bonus token from the last row when every draft is accepted).
  std::vector<int32_t> tokens;
  // [tokens.size()] when logprobs were asked for: each emitted token's logprob under the target's
  // raw logits at its position (logprobs.h), with the top n alternatives.
  std::vector<LogprobSummary> logprobs;
  int64_t n_accepted = 0;
};

// Verifies the last n_draft ids of `sequence` (the drafts, after the sequence's settled tokens).
// rows: [n_draft + 1, n_vocab] f32 raw target logits; row i is the position of draft i (i <
// n_draft: it judges draft i), row n_draft the one after the last draft. n_prompt: how many of
// `sequence` are the prompt (for the OpenAI penalties, as Sampler::sample). q: the drafter's
// [n_draft, n_vocab] probabilities (Draft::q), or empty for a deterministic drafter (one-hot).
// n_logprobs: -1 for none, else the alternatives per emitted token.
//
// Per position i: accept draft x_i with probability min(1, p(x_i) / q(x_i)); at the first
// rejection, draw from norm(max(0, p - q)) and stop; with every draft accepted, draw the bonus
// token from the last row. With q one-hot, "accept with probability p(x), else draw from
// norm(p without x)" is the same law as "draw y from p; accept x when y == x, else emit y", which
// is what is done then: every emitted token takes exactly the one RNG draw the sampler would have
// taken without speculation, so a seeded request's output does not depend on the drafts. Greedy
// requests accept exactly the argmax.
// Errors: NonFiniteLogitsError as Sampler::sample (the caller ends the request); asserts sizes.
Verification verify_drafts(Sampler& sampler, std::span<const float> rows, std::span<const int32_t> sequence,
                           int64_t n_draft, size_t n_prompt, std::span<const float> q, int32_t n_logprobs);

// verify_drafts for a one-hot q (a deterministic drafter, or a draft model's greedy drafts) from
// tokens sampled elsewhere (the CUDA sampler, ModelRunner::forward_sample): sampled[i] is what
// sampler.sample() returns for row i when its draw is the i-th of sampler.peek_uniforms(), for a
// device_compatible() chain (which reads no previous tokens, so a row's token does not depend on
// the drafts accepted before it). Walks the rows as verify_drafts does (accept draft i while
// sampled[i] equals it; the first mismatch, or the last row, is the emitted token after them) and
// takes one take_uniform() per emitted token, so the sampler's stream ends where verify_drafts
// leaves it: the same tokens for the same logits and seed. sampled: [drafts.size() + 1]; no
// logprobs (they need the logits on the host). Errors: NonFiniteLogitsError for a -1 (a row
// without a distribution) at a row the walk reaches; asserts the sizes.
Verification accept_sampled_drafts(Sampler& sampler, std::span<const int32_t> sampled,
                                   std::span<const int32_t> drafts);

}  // namespace kestrel
