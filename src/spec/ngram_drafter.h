// Prompt lookup decoding (A. Saxena 2023, "Prompt Lookup Decoding"; vLLM's "ngram" method):
// when the last n tokens of a sequence occurred before in its prompt or output, the tokens that
// followed them then are proposed as the continuation. Deterministic (q one-hot), no model, cheap:
// it pays on input-grounded work (summaries, edits, quotes, code changes) where the output copies
// spans of the input.
#pragma once

#include <unordered_map>

#include "spec/drafter.h"

namespace kestrel {

// Draft length: adaptive (adaptive_k > 0, num_speculative_tokens; the engine's default), each
// sequence's drafts are capped by its own limit, which starts at adaptive_k, doubles (up to
// adaptive_k) after a draft the verifier accepted whole and drops to one past the accepted prefix
// after one it cut. A cut draft costs a
// verify step of 1 + k tokens for the tokens accepted, so where the output stops copying the input
// the next steps verify 1 or 2 drafts instead of k, and where it copies again the limit is back
// at k in a few steps. The drafts stay the continuation of the match, so the output distribution
// is untouched; only how many are verified changes. Fixed (adaptive_k 0): every proposal is as long
// as the request allows (vLLM's ngram proposer).
class NgramDrafter final : public Drafter {
 public:
  // Errors: kestrel::Error when min_n < 1 or max_n < min_n.
  NgramDrafter(int32_t min_n, int32_t max_n, int32_t adaptive_k = 0);
  std::string_view name() const override { return "ngram"; }
  void propose(std::span<const DraftRequest> requests, std::vector<Draft>& out) override;
  void on_verified(SeqId id, int64_t n_accepted, int64_t n_tokens) override;
  void release(SeqId id) override { seqs_.erase(id); }
  // The sequence's draft limit (adaptive only; 0 before its first proposal): for tests.
  int32_t limit(SeqId id) const;

  // The proposal for one sequence: for n from max_n down to min_n (longest first), the most
  // recent earlier occurrence of tokens' last n ids (ending before the last position); the ids
  // after it, up to max_drafts. A continuation that runs into the end of `tokens` goes on with the
  // ids it has proposed (a repeating span keeps repeating). Empty when no n-gram recurs.
  // O(tokens.size() * max_n).
  std::vector<int32_t> lookup(std::span<const int32_t> tokens, int32_t max_drafts) const;

 private:
  struct SeqState {
    int32_t limit = 0;     // drafts at most in the next proposal
    int32_t proposed = 0;  // drafts in the proposal awaiting verification
  };
  int32_t min_n_, max_n_, adaptive_k_;
  std::unordered_map<SeqId, SeqState> seqs_;
};

}  // namespace kestrel
