// A sequence as the scheduler sees it: its token ids, how many have K/V in the cache, and which
// queue it is in. The engine owns each Sequence (inside its request state); the scheduler holds
// pointers and the KvManager holds its blocks under the same id.
#pragma once

#include <cstdint>
#include <vector>

#include "memory/kv_manager.h"

namespace kestrel {

enum class SeqStatus { Waiting, Running, Finished };

struct Sequence {
  SeqId id = 0;
  std::vector<int32_t> tokens;  // [n_prompt + n_generated] prompt then generated ids
  int64_t n_prompt = 0;
  // Leading tokens whose K/V are in the cache. The last token never is until the next step feeds
  // it, so a running sequence has tokens.size() - n_computed >= 1 tokens left to run.
  int64_t n_computed = 0;
  SeqStatus status = SeqStatus::Waiting;
  int32_t n_preemptions = 0;
  int64_t n_cached_prompt = -1;  // prefix-cache hit on first admission; -1 until admitted
  bool reuse_prefix_cache = true;  // false: compute the whole prompt (its logits are wanted)
  int64_t max_chunk = 0;           // > 0: prefill at most this many tokens of it per step
  // Trailing ids of `tokens` that are draft proposals (speculative decoding): computed in the
  // same step as the sampled token before them, each with its own logits row, and rolled back with
  // Scheduler::truncate when rejected. 0 without speculation.
  int64_t n_draft = 0;
  // Disaggregated prefill: leading prompt tokens whose K/V arrive from another engine (at most
  // n_prompt - 1, so the last prompt token is computed here and gives the first token's logits).
  // Admission starts the sequence computed up to here and reports its blocks in
  // SchedulerOutput::imported; then it is 0 (a preemption by recompute computes everything).
  int64_t n_imported = 0;
  // In a pass the engine has submitted and not yet collected (pipelined passes,
  // ModelRunner::submit): the scheduler neither schedules nor preempts it until the engine has
  // its tokens.
  bool in_flight = false;

  int64_t n_generated() const { return static_cast<int64_t>(tokens.size()) - n_prompt; }
  int64_t n_uncomputed() const { return static_cast<int64_t>(tokens.size()) - n_computed; }
  // Decoding: the prompt (or the recomputed history) is done and what is left is the last sampled
  // token plus its drafts, 1 + n_draft tokens, which one step runs together.
  bool is_decode() const { return n_computed > 0 && n_uncomputed() == 1 + n_draft; }
};

}  // namespace kestrel
