#include "sampling/candidate_list.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace kestrel {

void CandidateList::assign(std::span<const float> logits) {
  items_.resize(logits.size());
  bool any_bad = false;
  for (size_t i = 0; i < logits.size(); ++i) {
    items_[i] = TokenCandidate{static_cast<int32_t>(i), logits[i], 0.0f};
    any_bad |= is_bad_logit(logits[i]);
  }
  // A NaN would break the total order that sorting relies on (undefined behaviour in std::sort);
  // +inf turns into NaN in the softmax (inf - inf) and in the logprobs.
  if (any_bad) throw NonFiniteLogitsError(NonFiniteLogitsError::Source::Model);
  n_sorted_ = 0;
  id_indexed_ = true;
  has_probs_ = false;
}

std::span<TokenCandidate> CandidateList::edit_logits() {
  n_sorted_ = 0;
  has_probs_ = false;
  return items_;
}

TokenCandidate* CandidateList::find_for_edit(int32_t id) {
  TokenCandidate* found = nullptr;
  if (id_indexed_) {
    if (id >= 0 && static_cast<size_t>(id) < items_.size()) found = &items_[id];
  } else {
    auto it = std::find_if(items_.begin(), items_.end(),
                           [id](const TokenCandidate& c) { return c.id == id; });
    if (it != items_.end()) found = &*it;
  }
  if (found) {
    n_sorted_ = 0;
    has_probs_ = false;
  }
  return found;
}

void CandidateList::sort_prefix(size_t k) {
  k = std::min(k, items_.size());
  if (k <= n_sorted_) return;
  // items_[0, n_sorted_) already are the best, in order; select the next ones from the rest.
  auto first = items_.begin() + static_cast<ptrdiff_t>(n_sorted_);
  auto mid = items_.begin() + static_cast<ptrdiff_t>(k);
  if (mid != items_.end()) std::nth_element(first, mid, items_.end(), ranks_before);
  std::sort(first, mid, ranks_before);
  n_sorted_ = k;
  // Reordering breaks id indexing unless nothing moved, which we do not bother to detect.
  id_indexed_ = false;
}

void CandidateList::keep_top(size_t k) {
  if (k >= items_.size()) return;
  if (n_sorted_ > 0 || k == 0 || k * 16 > items_.size()) {
    sort_prefix(k);
    truncate(k);
    return;
  }
  // One pass with a k-entry heap whose root is the worst of the best so far. On real logits
  // almost every token loses its single comparison with the root once the first few thousand
  // are seen, so this is a cheap linear scan, where nth_element would move most of the
  // vocabulary around.
  scratch_.assign(items_.begin(), items_.begin() + static_cast<ptrdiff_t>(k));
  std::make_heap(scratch_.begin(), scratch_.end(), ranks_before);
  for (size_t i = k; i < items_.size(); ++i) {
    if (ranks_before(items_[i], scratch_.front())) {
      std::pop_heap(scratch_.begin(), scratch_.end(), ranks_before);
      scratch_.back() = items_[i];
      std::push_heap(scratch_.begin(), scratch_.end(), ranks_before);
    }
  }
  std::sort_heap(scratch_.begin(), scratch_.end(), ranks_before);
  items_.swap(scratch_);  // keeps both buffers' capacity for the next step
  n_sorted_ = k;
  id_indexed_ = false;
  has_probs_ = false;
}

void CandidateList::truncate(size_t n) {
  KESTREL_ASSERT(n <= n_sorted_, "truncate needs the kept prefix to be sorted");
  if (n == items_.size()) return;
  items_.resize(n);
  n_sorted_ = n;
  id_indexed_ = false;
  has_probs_ = false;
}

void CandidateList::remove_below(float threshold) {
  size_t kept = 0;
  size_t kept_sorted = 0;
  for (size_t i = 0; i < items_.size(); ++i) {
    if (items_[i].logit >= threshold) {
      // The sorted prefix holds the largest logits, so its survivors are still the best of what
      // remains and still lead the list in rank order.
      if (i < n_sorted_) ++kept_sorted;
      items_[kept++] = items_[i];
    }
  }
  if (kept == items_.size()) return;
  items_.resize(kept);
  n_sorted_ = kept_sorted;
  id_indexed_ = false;
  has_probs_ = false;
}

float CandidateList::max_logit() const { return items_[best_index()].logit; }

size_t CandidateList::best_index() const {
  KESTREL_ASSERT(!items_.empty(), "no candidates left");
  if (n_sorted_ > 0) return 0;
  size_t best = 0;
  for (size_t i = 1; i < items_.size(); ++i) {
    if (ranks_before(items_[i], items_[best])) best = i;
  }
  return best;
}

void CandidateList::softmax() {
  const double max = max_logit();
  // Every edit is checked (checked_logit): only a row of banned tokens (-inf) gets here.
  if (!std::isfinite(max)) throw NonFiniteLogitsError(NonFiniteLogitsError::Source::Processing);
  double sum = 0.0;
  for (TokenCandidate& c : items_) {
    const double e = std::exp(static_cast<double>(c.logit) - max);
    c.prob = static_cast<float>(e);
    sum += e;
  }
  const double inv = 1.0 / sum;
  for (TokenCandidate& c : items_) c.prob = static_cast<float>(c.prob * inv);
  has_probs_ = true;
}

}  // namespace kestrel
