// Prompt lookup decoding (A. Saxena 2023, "Prompt Lookup Decoding"; vLLM's "ngram" method):
// when the last n tokens of a sequence occurred before in its prompt or output, the tokens that
// followed them then are proposed as the continuation. Deterministic (q one-hot), no model, cheap:
// it pays on input-grounded work (summaries, edits, quotes, code changes) where the output copies
// spans of the input.
#pragma once

#include "spec/drafter.h"

namespace kestrel {

class NgramDrafter final : public Drafter {
 public:
  // Errors: kestrel::Error when min_n < 1 or max_n < min_n.
  NgramDrafter(int32_t min_n, int32_t max_n);
  std::string_view name() const override { return "ngram"; }
  void propose(std::span<const DraftRequest> requests, std::vector<Draft>& out) override;

  // The proposal for one sequence: for n from max_n down to min_n (longest first), the most
  // recent earlier occurrence of tokens' last n ids (ending before the last position); the ids
  // after it, up to max_drafts. A continuation that runs into the end of `tokens` goes on with the
  // ids it has proposed (a repeating span keeps repeating). Empty when no n-gram recurs.
  // O(tokens.size() * max_n).
  std::vector<int32_t> lookup(std::span<const int32_t> tokens, int32_t max_drafts) const;

 private:
  int32_t min_n_, max_n_;
};

}  // namespace kestrel
