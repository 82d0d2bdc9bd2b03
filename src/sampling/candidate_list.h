// The working set of a sampling step: (token id, logit, prob) triples that the logits processors
// edit and truncate in place, so that only the first copy touches the whole vocabulary.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "core/error.h"

namespace kestrel {

// A logits row with a NaN or +inf, or without any finite logit (-inf is a banned token, fine as long
// as some token is not banned): from the model (corrupt weights, a backend fault) or, for logits
// near the float range's end, from a request's bias and penalties. Bad input for this sequence,
// not a broken invariant, so callers end just that request.
class NonFiniteLogitsError : public Error {
 public:
  enum class Source { Model, Processing };
  explicit NonFiniteLogitsError(Source source)
      : Error(source == Source::Model
                  ? "the model produced non-finite logits (NaN, +inf or no finite value): its weights are "
                    "probably corrupt"
                  : "the logits became non-finite (NaN, +inf or no finite value) under this request's "
                    "logit_bias and penalties"),
        source_(source) {}
  Source source() const { return source_; }

 private:
  Source source_;
};

// True for NaN and +inf (-inf is a banned token).
inline bool is_bad_logit(float x) { return !(x < std::numeric_limits<float>::infinity()); }

// Throws NonFiniteLogitsError(Processing) for NaN or +inf: for processors that change a logit.
inline float checked_logit(float x) {
  if (is_bad_logit(x)) throw NonFiniteLogitsError(NonFiniteLogitsError::Source::Processing);
  return x;
}

struct TokenCandidate {
  int32_t id;
  float logit;
  float prob;  // valid only after CandidateList::softmax() and until the next edit
};

// "Rank order" below means descending logit, ties broken by the lower id. It is a strict total
// order, so every sort and selection gives one answer whatever the standard library: that keeps
// sampling reproducible across platforms.
class CandidateList {
 public:
  // Fills the list with every token of `logits` ([n_vocab] floats), in id order.
  // Errors: NonFiniteLogitsError(Model) when a logit is NaN or +inf.
  void assign(std::span<const float> logits);

  size_t size() const { return items_.size(); }
  bool empty() const { return items_.empty(); }
  std::span<const TokenCandidate> items() const { return items_; }
  const TokenCandidate& operator[](size_t i) const { return items_[i]; }

  // Mutable access for processors that change logits. It forgets the rank order and the probs,
  // since any logit may have changed.
  std::span<TokenCandidate> edit_logits();
  // The candidate with this id, or nullptr if it was truncated away. O(1) while the list still
  // holds the whole vocabulary in id order, O(size) after. Forgets order and probs like
  // edit_logits(), since the caller means to change the logit.
  TokenCandidate* find_for_edit(int32_t id);

  // Number of leading items known to be the best of the list, in rank order.
  size_t n_sorted() const { return n_sorted_; }
  bool sorted() const { return n_sorted_ == items_.size(); }
  // Puts the best min(k, size) items first, in rank order; the rest follow in unspecified order.
  // O(size + k log k) via nth_element, and only on the part not already sorted.
  void sort_prefix(size_t k);
  // Keeps only the best min(k, size) items, in rank order (k = 0 keeps none). About O(size) on
  // model logits (a k-entry heap), O(size log k) at worst.
  void keep_top(size_t k);
  // Keeps the first n items. Requires n <= n_sorted(), so the kept ones are the best n.
  void truncate(size_t n);
  // Drops every item whose logit is below `threshold`; keeps the order of the rest.
  void remove_below(float threshold);

  // The largest logit (the first item's when sorted). Requires a non-empty list.
  float max_logit() const;
  // Index of the best item in rank order (the argmax, lowest id on ties). Requires non-empty.
  size_t best_index() const;

  // Fills prob with softmax(logit) over the current items, summed in double precision.
  // Errors: asserts that some logit is finite (all -inf would leave no distribution).
  void softmax();
  bool has_probs() const { return has_probs_; }

 private:
  std::vector<TokenCandidate> items_;
  size_t n_sorted_ = 0;
  bool id_indexed_ = false;  // items_[i].id == i for every i
  bool has_probs_ = false;
  std::vector<TokenCandidate> scratch_;  // keep_top's heap, reused across steps
};

// Rank order: true when a comes before b.
inline bool ranks_before(const TokenCandidate& a, const TokenCandidate& b) {
  return a.logit > b.logit || (a.logit == b.logit && a.id < b.id);
}

}  // namespace kestrel
