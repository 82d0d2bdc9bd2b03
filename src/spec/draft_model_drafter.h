// A draft model as the drafter (Leviathan et al. 2023; Chen et al. 2023; vLLM's "draft_model"
// method): a smaller model with the target's tokenizer proposes the next k tokens of every running
// decode, run by the same engine machinery as the target (a ModelRunner over flat ForwardBatches
// built by StepBatch) with its own paged KV pool (KvManager + the runner's cache).
//
// Each sequence's draft KV is kept in step with the target's tokens: a propose first feeds the
// tokens the draft has not computed (after prefill the whole prompt, after a verification the
// token the target sampled, and the last draft when all were accepted) in chunks of at most
// max_num_batched_tokens, sampling draft 0 from the last one's logits; then k - 1
// single-token decode passes, batched over all requesting sequences, sample the rest.
// on_verified rolls the KV back to the accepted tokens, release frees it. Whatever was dropped
// without a call (drafts of a step the scheduler did not run) is found by comparing the draft's
// tokens with the sequence's at the next propose, so the draft never attends to a stale token.
//
// Drafts are drawn under the request's own sampling chain (Sampler::distribution: bias,
// penalties, top-k/p, min-p, temperature, as vLLM draws them): greedy takes the argmax (q one-hot,
// so greedy output is token-identical to decoding without drafts); a sampled request draws from
// the processed distribution q, returned as q rows for rejection sampling, with a counter-based
// uniform per (seed, position) (draft_uniform), so a seeded request is reproducible whatever its
// batch, its preemptions or its steps.
#pragma once

#include <optional>
#include <unordered_map>

#include "sampling/sampler.h"
#include "scheduler/scheduler.h"
#include "scheduler/sequence.h"
#include "scheduler/step_batch.h"
#include "spec/drafter.h"

namespace kestrel {

// Blocks the draft's KV pool holds: max_num_seqs sequences of min(max_model_len, the draft's
// context) tokens, capped (as the engine caps its own CPU pool) at 2 GiB of K/V but never below
// one sequence. A pool too small for every running sequence stops drafting for the ones that find
// no blocks (their output is unchanged, only slower).
int32_t draft_kv_blocks(const ModelHparams& draft, const DrafterContext& context);

// Checks that `draft` can draft for `target`: the same n_vocab (logits rows and q rows index one
// vocabulary), and when both tokenizers are given the same token strings (XXH3 over every token's
// text and type) and the same BOS, EOS and UNK ids. Errors: kestrel::Error naming both values.
void check_draft_vocabulary(const LlamaModel& target, const Tokenizer* target_tokenizer, const LlamaModel& draft,
                            const Tokenizer* draft_tokenizer);

// The uniform in [0, 1) a sampled request with this seed uses for its draft at `position`:
// SplitMix64 (Steele et al. 2014) of the seed and the position, the top 53 bits. The draw at a
// position is reused only by drafts that never influenced the tokens before it (drafts after a
// rejection, or drafts the scheduler dropped), so each draft is still independent of its context.
double draft_uniform(uint64_t seed, int64_t position);

class DraftModelDrafter final : public Drafter {
 public:
  // Errors: kestrel::Error for a null model, a vocabulary mismatch (check_draft_vocabulary), a
  // runner whose block size differs from the context's, or a CPU runner that cannot start.
  DraftModelDrafter(const DrafterContext& context, DraftModel draft);
  ~DraftModelDrafter() override;
  std::string_view name() const override { return "draft_model"; }
  void propose(std::span<const DraftRequest> requests, std::vector<Draft>& out) override;
  void on_verified(SeqId id, int64_t n_accepted, int64_t n_tokens) override;
  void release(SeqId id) override;

  const ModelRunner& runner() const { return *draft_.runner; }
  const LlamaModel& model() const { return *draft_.model; }
  // Sequences with draft state, and KV blocks they hold (for tests: both 0 once every request ended).
  size_t n_seqs() const { return seqs_.size(); }
  int32_t n_used_blocks() const { return kv_->n_used_blocks(); }

 private:
  struct SeqState {
    Sequence seq;  // tokens the draft knows (settled, then its drafts), n_computed: those with K/V
    std::optional<Sampler> sampler;
    bool greedy = true;
    uint64_t seed = 0;
  };
  // Makes the draft's KV hold positions [0, n_tokens) of st.seq (its first n_computed computed),
  // taking copy-on-write copies into copies_. False when the pool has no room even after freeing
  // the sequences not in `keep`.
  bool reserve(SeqState& st, int64_t n_tokens, std::span<const DraftRequest> keep);
  // One draft forward pass over `so`; samples the next draft of every scheduled sequence that
  // reaches its last token, appending it to its state and to out[index].
  void run_pass(const SchedulerOutput& so, const std::vector<size_t>& index, std::span<const DraftRequest> requests,
                std::vector<Draft>& out);

  DrafterContext ctx_;
  DraftModel draft_;
  std::optional<KvManager> kv_;
  int64_t max_len_ = 0;  // positions the draft computes at most: min(max_model_len, its context)
  size_t n_vocab_ = 0;
  std::unordered_map<SeqId, SeqState> seqs_;
  std::vector<BlockCopy> copies_;
  StepBatch batch_;
  std::vector<RowSampling> row_sampling_;
};

}  // namespace kestrel
