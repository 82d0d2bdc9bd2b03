// Continuous batching per iteration (Orca, Yu et al. 2022) with chunked prefill and preemption by
// recompute or by swapping to host memory, over a KvManager (vLLM's scheduler is the reference for
// the policy).
//
// Each schedule() gives every sequence it picks a number of new tokens (a prompt chunk, one decode
// token, or one token plus k drafts to verify) under a token budget (max_num_batched_tokens) and a
// sequence cap (max_num_seqs), in this order:
//   1. running decodes (1 + n_draft tokens each), oldest first. When one cannot get a block, the
//      newest running sequence is preempted until the decode fits (while the newest ones are in
//      flight, those not in flight after it; when none is left but it, the decode waits, and the
//      step takes no further blocks, until the passes in flight are back): by recompute (its blocks freed, computed full blocks kept
//      in the prefix cache, itself put at the front of the waiting queue to be recomputed) or by
//      swap (its blocks copied to the host pool, KvManager::swap_out, and freed; it keeps its
//      computed count and goes to the front of the waiting queue to be swapped back in);
//   2. running sequences still in prefill get their next chunk from what budget is left;
//   3. waiting sequences are admitted first come, first served while budget, sequence slots and
//      blocks last (none after a preemption in the same step, so the pool can drain); a swapped
//      one is swapped in (fresh blocks, host blocks freed) and runs on from its computed tokens.
//
// Which preemption (PreemptionMode): recompute always; swap whenever the host pool has a block for
// each of the victim's held blocks and it has computed tokens; auto swaps when that holds and
// swapping is estimated cheaper: held_blocks x swap_seconds_per_block (a block's bytes out and
// back over the host link) < n_computed x recompute_seconds_per_token (a prefill token's time,
// measured by the engine; 0 until measured, and then auto recomputes). Either way a full host
// pool means recompute. The copies of a step go: swap-outs first (the freed blocks may be taken
// by the same step's appends and copy-on-write copies), then copy-on-write copies, then swap-ins,
// then the forward pass. The host tier's copies go after the swap-outs: offloads of evicted cached
// blocks and loads of host-tier hits in one call (ModelRunner::swap_out_in), a load into a block
// just evicted waiting for that block's offload (the loads' destinations are fresh blocks, which
// no copy-on-write copy or swap-in of the step touches).
// A long prompt therefore never stalls the decodes: it advances one chunk per step beside them.
//
// With a window (every layer of the model attends to at most `window` positions back), each
// sequence gives back after every step the blocks wholly before the first key its next token can
// read (KvManager::release_before), and admission does not take prefix-cache hits before it: a
// sequence then holds about (window + its chunk) / block_size + 1 blocks whatever its length.
#pragma once

#include <algorithm>
#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "memory/kv_manager.h"
#include "scheduler/sequence.h"

namespace kestrel {

enum class PreemptionMode { Recompute, Swap, Auto };

// "recompute", "swap", "auto" (vLLM's --preemption-mode names, auto added). Errors: kestrel::Error
// naming the value for any other.
PreemptionMode parse_preemption_mode(const std::string& name);
const char* preemption_mode_name(PreemptionMode mode);

struct SchedulerConfig {
  int32_t max_num_seqs = 64;
  int64_t max_num_batched_tokens = 512;
  // > 0: a token at position p reads no key before p + 1 - window in any layer
  // (ModelHparams::kv_lookback()); blocks before that are released. 0: every key is kept.
  int64_t window = 0;
  // Swapping needs a host pool (KvManagerConfig::n_swap_blocks > 0); without one every mode
  // recomputes.
  PreemptionMode preemption_mode = PreemptionMode::Recompute;
};

// The cost model of PreemptionMode::Auto, in seconds (see the header comment).
struct PreemptionCosts {
  double swap_seconds_per_block = 0;       // 2 x block bytes / host link bytes per second
  double recompute_seconds_per_token = 0;  // a prefill token; 0 = not measured yet
};

// One sequence's share of a step: tokens [n_computed, n_computed + n_new) of seq->tokens.
struct ScheduledSeq {
  Sequence* seq = nullptr;
  int64_t n_computed = 0;  // seq->n_computed when scheduled
  int64_t n_new = 0;
  // The chunk ends at the sequence's last token, so its logits give the next token.
  bool samples() const { return n_computed + n_new == static_cast<int64_t>(seq->tokens.size()); }
  // Logits rows the step needs: the last 1 + n_draft positions when it samples, else none.
  int64_t n_logits() const { return samples() ? std::min<int64_t>(n_new, 1 + seq->n_draft) : 0; }
};

struct SchedulerOutput {
  std::vector<ScheduledSeq> scheduled;  // decodes first, then prefill chunks
  std::vector<BlockSwap> swap_out;      // device -> host copies, first of all (also when scheduled is empty)
  std::vector<BlockCopy> copies;        // copy-on-write K/V copies to do before the forward pass
  std::vector<BlockSwap> swap_in;       // host -> device copies, after `copies`, before the pass
  // Sequences admitted with imported K/V (Sequence::n_imported): their table's blocks
  // [first_block, first_block + n_blocks) must receive the imported bytes of those blocks before the
  // forward pass (the blocks before first_block were prefix-cache hits).
  struct Import {
    Sequence* seq;
    int64_t first_block;
    int64_t n_blocks;
  };
  std::vector<Import> imported;
  // Host tier of the prefix cache (KvManager::take_offloads / take_loads): device -> host copies
  // of evicted cached blocks and host -> device copies of host-tier hits, issued together after
  // swap_out (ModelRunner::swap_out_in).
  std::vector<BlockSwap> offload;
  std::vector<BlockSwap> load;
  std::vector<Sequence*> preempted;     // sequences preempted in this step (now waiting), swapped ones too
  int64_t n_swapped = 0;                // of those, preempted by swap
  int64_t n_tokens = 0;
  int64_t n_decodes = 0;                // the first n_decodes entries of scheduled are decodes
  int64_t n_prefill_tokens = 0;         // tokens of the other entries (prompt chunks, recomputation)
  bool empty() const { return scheduled.empty(); }
};

class Scheduler {
 public:
  // Errors: kestrel::Error when max_num_seqs or max_num_batched_tokens is not positive.
  Scheduler(const SchedulerConfig& config, KvManager& kv);

  // Queues a new sequence (status Waiting, no blocks) at the back of the waiting queue.
  // A swapped-out sequence is Waiting too (in the waiting queue, its K/V in the host pool).
  void add(Sequence* seq);
  // Builds the next step and commits its blocks. Afterwards the caller runs the forward pass and
  // then calls on_step_done(). Sequences in flight (Sequence::in_flight) are left out: neither
  // scheduled nor preempted. decode_share > 1 (the passes a pipelining runner keeps in flight):
  // the step takes at most ceil(running decodes / decode_share) decodes, in flight ones counted,
  // so that the decodes spread over that many passes of about equal size.
  SchedulerOutput schedule(int32_t decode_share = 1);
  // Records that the scheduled tokens were computed (n_computed advances) and, with a window,
  // releases each one's blocks that no later token reads (kept: those from position
  // n_computed - n_draft + 1 - window on, so rejected drafts can still be rolled back). The caller
  // appends sampled tokens to seq->tokens itself and calls finish() for sequences that ended.
  void on_step_done(const SchedulerOutput& out);
  // Removes a waiting (swapped out or not) or running sequence and frees its blocks, host ones
  // too (computed full blocks stay in the prefix cache). Status becomes Finished. Safe for any sequence this scheduler holds.
  void finish(Sequence* seq);
  // Rolls `seq` (running) back to its first n_tokens tokens: rejected drafts, or any tail. Its K/V
  // slots beyond go back to the pool (KvManager::truncate), n_computed and n_draft shrink to fit.
  // Errors: KESTREL_ASSERT when n_tokens is outside [1, tokens.size()], or, with a window, when
  // the rolled-back sequence would need keys whose blocks were released (more than n_draft back).
  void truncate(Sequence* seq, int64_t n_tokens);
  // Starts `child` as a running copy of `parent` (running, its prompt computed): the same tokens
  // and computed count, sharing every KV block copy-on-write (KvManager::fork). For n > 1 choices
  // of one prompt, which is then prefilled once. Returns false, changing nothing, when max_num_seqs
  // sequences already run.
  bool fork(Sequence* parent, Sequence* child);

  void set_preemption_costs(const PreemptionCosts& costs) { costs_ = costs; }

  size_t n_waiting() const { return waiting_.size(); }
  size_t n_running() const { return running_.size(); }
  const SchedulerConfig& config() const { return config_; }

 private:
  void preempt(Sequence* seq, SchedulerOutput& out);
  bool swap_preferred(const Sequence& seq) const;
  // Swaps waiting_.front() (swapped out) in and schedules its next tokens; false when the blocks
  // or the budget are short.
  bool admit_swapped(Sequence* seq, int64_t& budget, SchedulerOutput& out);

  SchedulerConfig config_;
  PreemptionCosts costs_;
  KvManager& kv_;
  std::deque<Sequence*> waiting_;
  std::vector<Sequence*> running_;  // in admission order
};

}  // namespace kestrel
