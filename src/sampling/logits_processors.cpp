#include "sampling/logits_processors.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "core/error.h"

namespace kestrel {
namespace {

// (id, count) for each distinct id in `tokens`, by sorting a copy: O(m log m) in the history
// length m and independent of the vocabulary size.
std::vector<std::pair<int32_t, int32_t>> count_tokens(std::span<const int32_t> tokens) {
  std::vector<int32_t> sorted(tokens.begin(), tokens.end());
  std::sort(sorted.begin(), sorted.end());
  std::vector<std::pair<int32_t, int32_t>> counts;
  for (size_t i = 0; i < sorted.size();) {
    size_t j = i;
    while (j < sorted.size() && sorted[j] == sorted[i]) ++j;
    counts.emplace_back(sorted[i], static_cast<int32_t>(j - i));
    i = j;
  }
  return counts;
}

}  // namespace

void LogitBias::apply(CandidateList& candidates, std::span<const int32_t>) const {
  for (const auto& [id, bias] : bias_) {
    if (TokenCandidate* c = candidates.find_for_edit(id)) c->logit = checked_logit(c->logit + bias);
  }
}

void RepetitionPenalty::apply(CandidateList& candidates,
                              std::span<const int32_t> previous_tokens) const {
  if (last_n_ >= 0 && static_cast<size_t>(last_n_) < previous_tokens.size()) {
    previous_tokens = previous_tokens.last(static_cast<size_t>(last_n_));
  }
  for (const auto& [id, count] : count_tokens(previous_tokens)) {
    if (TokenCandidate* c = candidates.find_for_edit(id)) {
      c->logit = checked_logit(c->logit > 0.0f ? c->logit / penalty_ : c->logit * penalty_);
    }
  }
}

void PresencePenalty::apply(CandidateList& candidates,
                            std::span<const int32_t> previous_tokens) const {
  for (const auto& [id, count] : count_tokens(previous_tokens)) {
    if (TokenCandidate* c = candidates.find_for_edit(id)) c->logit = checked_logit(c->logit - penalty_);
  }
}

void FrequencyPenalty::apply(CandidateList& candidates,
                             std::span<const int32_t> previous_tokens) const {
  for (const auto& [id, count] : count_tokens(previous_tokens)) {
    if (TokenCandidate* c = candidates.find_for_edit(id)) {
      c->logit = checked_logit(c->logit - penalty_ * static_cast<float>(count));
    }
  }
}

void TopK::apply(CandidateList& candidates, std::span<const int32_t>) const {
  if (k_ <= 0 || static_cast<size_t>(k_) >= candidates.size()) return;
  candidates.keep_top(static_cast<size_t>(k_));
}

void TopP::apply(CandidateList& candidates, std::span<const int32_t>) const {
  if (p_ >= 1.0f || candidates.size() <= 1) return;
  if (!candidates.has_probs()) candidates.softmax();
  // Sort a first chunk, then four times more each round: the nucleus of a peaked distribution
  // is short, so usually only one small partial sort of the vocabulary is needed.
  double cumulative = 0.0;
  size_t i = 0;
  size_t k = std::max<size_t>(candidates.n_sorted(), 64);
  for (;;) {
    candidates.sort_prefix(k);
    const size_t end = candidates.n_sorted();
    for (; i < end; ++i) {
      cumulative += candidates[i].prob;
      if (cumulative >= p_) {
        candidates.truncate(i + 1);
        return;
      }
    }
    if (end == candidates.size()) return;  // rounding left the total just short of p: keep all
    k = end * 4;
  }
}

void MinP::apply(CandidateList& candidates, std::span<const int32_t>) const {
  if (min_p_ <= 0.0f || candidates.empty()) return;
  // p_i >= min_p * p_max  <=>  logit_i - max_logit >= ln(min_p); the max itself always passes.
  const double threshold = static_cast<double>(candidates.max_logit()) + std::log(double{min_p_});
  candidates.remove_below(static_cast<float>(threshold));
}

void Temperature::apply(CandidateList& candidates, std::span<const int32_t>) const {
  if (candidates.empty()) return;
  const double max = candidates.max_logit();
  const double inv_t = 1.0 / temperature_;
  for (TokenCandidate& c : candidates.edit_logits()) {
    c.logit = static_cast<float>((c.logit - max) * inv_t);
  }
}

std::vector<std::unique_ptr<LogitsProcessor>> make_processor_chain(const SamplingParams& params) {
  std::vector<std::unique_ptr<LogitsProcessor>> chain;
  if (!params.logit_bias.empty()) chain.push_back(std::make_unique<LogitBias>(params.logit_bias));
  if (params.repetition_penalty != 1.0f && params.repeat_last_n != 0) {
    chain.push_back(
        std::make_unique<RepetitionPenalty>(params.repetition_penalty, params.repeat_last_n));
  }
  if (params.presence_penalty != 0.0f) {
    chain.push_back(std::make_unique<PresencePenalty>(params.presence_penalty));
  }
  if (params.frequency_penalty != 0.0f) {
    chain.push_back(std::make_unique<FrequencyPenalty>(params.frequency_penalty));
  }
  if (params.temperature == 0.0f) return chain;  // greedy: the rest cannot move the argmax
  if (params.top_k > 0) chain.push_back(std::make_unique<TopK>(params.top_k));
  if (params.top_p < 1.0f) chain.push_back(std::make_unique<TopP>(params.top_p));
  if (params.min_p > 0.0f) chain.push_back(std::make_unique<MinP>(params.min_p));
  if (params.temperature != 1.0f) chain.push_back(std::make_unique<Temperature>(params.temperature));
  return chain;
}

}  // namespace kestrel
