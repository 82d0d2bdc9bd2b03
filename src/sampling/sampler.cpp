#include "sampling/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <string_view>

#include "core/error.h"
#include "sampling/logits_processors.h"

namespace kestrel {
namespace {

const SamplingParams& validated(const SamplingParams& params, int32_t n_vocab) {
  params.validate();
  if (n_vocab <= 0) throw Error("sampler: n_vocab = " + std::to_string(n_vocab) + " must be > 0");
  for (const auto& [id, bias] : params.logit_bias) {
    if (id >= n_vocab) {
      throw Error("sampling parameter logit_bias token id = " + std::to_string(id) +
                  " is invalid: must be < n_vocab (" + std::to_string(n_vocab) + ")");
    }
  }
  return params;
}

}  // namespace

Sampler::Sampler(const SamplingParams& params, int32_t n_vocab)
    : params_(validated(params, n_vocab)),
      n_vocab_(n_vocab),
      chain_(make_processor_chain(params_)),
      rng_(params_.seed) {}

int32_t Sampler::sample(std::span<const float> logits, std::span<const int32_t> previous_tokens, size_t n_prompt) {
  KESTREL_ASSERT(n_prompt <= previous_tokens.size(), "n_prompt exceeds the previous tokens");
  KESTREL_ASSERT(logits.size() == static_cast<size_t>(n_vocab_), "logits size != n_vocab");
  for (int32_t id : previous_tokens) {
    KESTREL_ASSERT(id >= 0 && id < n_vocab_, "previous token id out of range");
  }
  if (chain_.empty() && params_.temperature == 0.0f) {
    // Plain greedy: an argmax over the logits, without copying them into the candidate list
    // (about 50 us on a 49152-wide vocabulary, small next to a forward pass).
    float max = -std::numeric_limits<float>::infinity();
    bool any_bad = false;
    for (float l : logits) {
      max = l > max ? l : max;
      any_bad |= is_bad_logit(l);
    }
    if (any_bad || !std::isfinite(max)) throw NonFiniteLogitsError(NonFiniteLogitsError::Source::Model);
    const auto it = std::find(logits.begin(), logits.end(), max);  // first: the lowest id wins
    return static_cast<int32_t>(it - logits.begin());
  }
  candidates_.assign(logits);
  const auto generated = previous_tokens.subspan(n_prompt);
  for (const auto& processor : chain_)
    processor->apply(candidates_, processor->reads_prompt() ? previous_tokens : generated);
  if (params_.temperature == 0.0f) {
    const TokenCandidate& best = candidates_[candidates_.best_index()];
    if (!std::isfinite(best.logit)) throw NonFiniteLogitsError(NonFiniteLogitsError::Source::Processing);
    return best.id;
  }
  return draw(rng_.next_double());
}

std::span<const TokenCandidate> Sampler::distribution(std::span<const float> logits,
                                                      std::span<const int32_t> previous_tokens, size_t n_prompt) {
  KESTREL_ASSERT(n_prompt <= previous_tokens.size(), "n_prompt exceeds the previous tokens");
  KESTREL_ASSERT(logits.size() == static_cast<size_t>(n_vocab_), "logits size != n_vocab");
  candidates_.assign(logits);
  const auto generated = previous_tokens.subspan(n_prompt);
  for (const auto& processor : chain_)
    processor->apply(candidates_, processor->reads_prompt() ? previous_tokens : generated);
  if (params_.temperature == 0.0f) {
    candidates_.keep_top(1);
    if (candidates_.empty() || !std::isfinite(candidates_[0].logit))
      throw NonFiniteLogitsError(NonFiniteLogitsError::Source::Processing);
  }
  candidates_.softmax();
  return candidates_.items();
}

int32_t Sampler::sample_with_uniform(std::span<const float> logits, double uniform) {
  KESTREL_ASSERT(device_compatible(), "sample_with_uniform needs a chain without bias or penalties");
  KESTREL_ASSERT(logits.size() == static_cast<size_t>(n_vocab_), "logits size != n_vocab");
  candidates_.assign(logits);  // throws for a non-finite logit
  for (const auto& processor : chain_) processor->apply(candidates_, {});
  if (params_.temperature == 0.0f) return candidates_[candidates_.best_index()].id;
  return draw(uniform);
}

SampledToken Sampler::sample_with_logprobs(std::span<const float> logits,
                                           std::span<const int32_t> previous_tokens,
                                           int32_t n_top, size_t n_prompt) {
  const int32_t token = sample(logits, previous_tokens, n_prompt);
  return SampledToken{token, compute_logprobs(logits, token, n_top)};
}

bool Sampler::device_compatible() const {
  for (const auto& processor : chain_) {
    const std::string_view name = processor->name();
    if (name != "top_k" && name != "top_p" && name != "min_p" && name != "temperature") return false;
  }
  return true;
}

double Sampler::take_uniform() {
  if (params_.temperature == 0.0f) return 0.0;  // sample() takes the argmax: no draw
  return rng_.next_double();                    // draw()'s one next_double()
}

void Sampler::peek_uniforms(std::span<double> out) const {
  Rng copy = rng_;
  for (double& u : out) u = params_.temperature == 0.0f ? 0.0 : copy.next_double();
}

int32_t Sampler::draw(double uniform) {
  candidates_.softmax();
  // Inverse CDF over the list in its current order, which every processor leaves deterministic.
  // Scaling u by the float probs' own total makes rounding in their sum harmless.
  double total = 0.0;
  for (const TokenCandidate& c : candidates_.items()) total += c.prob;
  const double target = uniform * total;
  double cumulative = 0.0;
  for (const TokenCandidate& c : candidates_.items()) {
    cumulative += c.prob;
    if (target < cumulative) return c.id;
  }
  // Only reachable when target rounds to the total; the last token with mass is then correct.
  for (size_t i = candidates_.size(); i-- > 0;) {
    if (candidates_[i].prob > 0.0f) return candidates_[i].id;
  }
  return candidates_[0].id;
}

}  // namespace kestrel
