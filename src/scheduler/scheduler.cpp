#include "scheduler/scheduler.h"

#include <algorithm>
#include <string>

#include "core/error.h"

namespace kestrel {

Scheduler::Scheduler(const SchedulerConfig& config, KvManager& kv) : config_(config), kv_(kv) {
  if (config.max_num_seqs <= 0)
    throw Error("max_num_seqs must be positive, got " + std::to_string(config.max_num_seqs));
  if (config.max_num_batched_tokens <= 0)
    throw Error("max_num_batched_tokens must be positive, got " + std::to_string(config.max_num_batched_tokens));
}

PreemptionMode parse_preemption_mode(const std::string& name) {
  if (name == "recompute") return PreemptionMode::Recompute;
  if (name == "swap") return PreemptionMode::Swap;
  if (name == "auto") return PreemptionMode::Auto;
  throw Error("preemption mode must be recompute, swap or auto, got '" + name + "'");
}

const char* preemption_mode_name(PreemptionMode mode) {
  switch (mode) {
    case PreemptionMode::Recompute: return "recompute";
    case PreemptionMode::Swap: return "swap";
    case PreemptionMode::Auto: return "auto";
  }
  return "?";
}

void Scheduler::add(Sequence* seq) {
  KESTREL_ASSERT(seq != nullptr && !seq->tokens.empty(), "Scheduler: empty sequence");
  KESTREL_ASSERT(!kv_.has(seq->id) && !kv_.is_swapped(seq->id), "Scheduler: sequence already holds blocks");
  seq->status = SeqStatus::Waiting;
  seq->n_computed = 0;
  waiting_.push_back(seq);
}

bool Scheduler::swap_preferred(const Sequence& seq) const {
  if (config_.preemption_mode == PreemptionMode::Recompute || seq.n_computed <= 0 || !kv_.can_swap_out(seq.id))
    return false;
  if (config_.preemption_mode == PreemptionMode::Swap) return true;
  const double swap_s = static_cast<double>(kv_.n_held_blocks(seq.id)) * costs_.swap_seconds_per_block;
  const double recompute_s = static_cast<double>(seq.n_computed) * costs_.recompute_seconds_per_token;
  return swap_s < recompute_s;
}

void Scheduler::preempt(Sequence* seq, SchedulerOutput& out) {
  // Drafts are proposals for this step only: they go (their slots were never computed).
  if (seq->n_draft > 0) {
    seq->tokens.resize(seq->tokens.size() - static_cast<size_t>(seq->n_draft));
    seq->n_draft = 0;
    seq->n_computed = std::min<int64_t>(seq->n_computed, static_cast<int64_t>(seq->tokens.size()));
  }
  if (swap_preferred(*seq)) {
    // Swap: the K/V wait in the host pool and come back unchanged, so the sequence runs on from
    // n_computed as if never preempted.
    const std::vector<BlockSwap> swaps = kv_.swap_out(seq->id, seq->tokens, seq->n_computed);
    out.swap_out.insert(out.swap_out.end(), swaps.begin(), swaps.end());
    ++out.n_swapped;
  } else {
    // Recompute: the K/V go, but full computed blocks stay in the prefix cache, so unless they
    // are evicted meanwhile the re-admission finds most of them again.
    kv_.free(seq->id, seq->tokens, seq->n_computed);
    seq->n_computed = 0;
  }
  seq->status = SeqStatus::Waiting;
  ++seq->n_preemptions;
  waiting_.push_front(seq);
  out.preempted.push_back(seq);
}

SchedulerOutput Scheduler::schedule(int32_t decode_share) {
  SchedulerOutput out;
  int64_t budget = config_.max_num_batched_tokens;
  int64_t max_decodes = static_cast<int64_t>(running_.size());
  if (decode_share > 1) {
    const int64_t n = std::count_if(running_.begin(), running_.end(), [](const Sequence* s) { return s->is_decode(); });
    max_decodes = (n + decode_share - 1) / decode_share;
  }

  // 1. Decodes, oldest first; the newest running sequence not in flight makes room when blocks run out.
  std::vector<Sequence*> prefilling;
  bool out_of_blocks = false;  // a decode waits for blocks that passes in flight hold
  for (size_t i = 0; i < running_.size() && budget > 0;) {
    Sequence* s = running_[i];
    if (s->in_flight) {
      ++i;
      continue;
    }
    if (!s->is_decode()) {
      prefilling.push_back(s);
      ++i;
      continue;
    }
    if (static_cast<int64_t>(out.scheduled.size()) >= max_decodes) {
      ++i;  // this pass's share is full; the prompts after it may still get chunks
      continue;
    }
    const int64_t n_new = s->n_uncomputed();  // 1 + n_draft
    if (n_new > budget) break;  // decodes are not split; the rest wait for the next step
    const int64_t n_end = s->n_computed + n_new;
    bool self_preempted = false;
    while (!kv_.can_append(s->id, s->n_computed, n_end)) {
      // The newest sequence not in flight: s itself, or one after it (not scheduled yet).
      size_t j = running_.size() - 1;
      while (j > i && running_[j]->in_flight) --j;
      if (j == i && j + 1 < running_.size()) {
        // Newer sequences are in flight: s waits for their passes rather than give way to them
        // (the newest is preempted once it is back), and this step takes no more blocks.
        out_of_blocks = true;
        break;
      }
      Sequence* victim = running_[j];
      running_.erase(running_.begin() + static_cast<std::ptrdiff_t>(j));
      if (victim == s) {
        self_preempted = true;
        break;
      }
      // A victim later in running_ has not been scheduled yet; drop it from the prefill list.
      prefilling.erase(std::remove(prefilling.begin(), prefilling.end(), victim), prefilling.end());
      preempt(victim, out);
    }
    if (out_of_blocks) break;
    if (self_preempted) {
      preempt(s, out);
      break;  // s was the newest: nothing after it is left but sequences in flight
    }
    kv_.append(s->id, s->tokens, s->n_computed, n_end, out.copies);
    out.scheduled.push_back({s, s->n_computed, n_new});
    budget -= n_new;
    ++i;
  }

  out.n_decodes = static_cast<int64_t>(out.scheduled.size());

  // 2. Chunks of prompts already admitted (not in flight), as far as budget and free blocks allow.
  for (Sequence* s : prefilling) {
    if (budget <= 0 || out_of_blocks) break;
    int64_t n_new = std::min(s->n_uncomputed(), budget);
    if (s->max_chunk > 0) n_new = std::min(n_new, s->max_chunk);
    const int64_t capacity = static_cast<int64_t>(kv_.block_table(s->id).size()) * kv_.block_size();
    const int64_t room = capacity + static_cast<int64_t>(kv_.n_free_blocks()) * kv_.block_size() - s->n_computed;
    n_new = std::min(n_new, room);
    if (n_new <= 0 || !kv_.can_append(s->id, s->n_computed, s->n_computed + n_new)) continue;
    kv_.append(s->id, s->tokens, s->n_computed, s->n_computed + n_new, out.copies);
    out.scheduled.push_back({s, s->n_computed, n_new});
    budget -= n_new;
  }

  // 3. Admissions, first come first served; none after a preemption so the pool can drain.
  while (out.preempted.empty() && !out_of_blocks && !waiting_.empty() && budget > 0 &&
         static_cast<int32_t>(running_.size()) < config_.max_num_seqs) {
    Sequence* s = waiting_.front();
    if (kv_.is_swapped(s->id)) {
      if (!admit_swapped(s, budget, out)) break;
      continue;
    }
    const bool reuse = s->reuse_prefix_cache;
    const int64_t n_cached = reuse ? kv_.cached_prefix_len(s->tokens) : 0;
    // Imported K/V count as computed; cached blocks before them are not overwritten.
    const int64_t n_start = std::max(n_cached, s->n_imported);
    int64_t n_new = std::min(static_cast<int64_t>(s->tokens.size()) - n_start, budget);
    if (s->max_chunk > 0) n_new = std::min(n_new, s->max_chunk);
    if (!kv_.can_allocate(s->tokens, n_start + n_new, reuse, config_.window)) break;
    const int64_t n_hit = kv_.allocate(s->id, s->tokens, n_start + n_new, reuse, config_.window);
    KESTREL_ASSERT(n_hit == n_cached, "Scheduler: prefix cache changed between query and commit");
    waiting_.pop_front();
    if (s->n_imported > n_hit) {
      const int64_t bs = kv_.block_size();
      out.imported.push_back({s, n_hit / bs, (s->n_imported + bs - 1) / bs - n_hit / bs});
    }
    s->n_imported = 0;
    s->n_computed = n_start;
    s->status = SeqStatus::Running;
    if (s->n_cached_prompt < 0) s->n_cached_prompt = std::min(n_hit, s->n_prompt);
    running_.push_back(s);
    out.scheduled.push_back({s, n_start, n_new});
    budget -= n_new;
  }

  out.offload = kv_.take_offloads();
  out.load = kv_.take_loads();
  for (size_t i = 0; i < out.scheduled.size(); ++i) {
    out.n_tokens += out.scheduled[i].n_new;
    if (static_cast<int64_t>(i) >= out.n_decodes) out.n_prefill_tokens += out.scheduled[i].n_new;
  }
  return out;
}

bool Scheduler::admit_swapped(Sequence* s, int64_t& budget, SchedulerOutput& out) {
  int64_t n_new = std::min(s->n_uncomputed(), budget);
  if (s->max_chunk > 0) n_new = std::min(n_new, s->max_chunk);
  const int64_t n_end = s->n_computed + n_new;
  if (n_new <= 0 || !kv_.can_swap_in(s->id, n_end)) return false;
  const std::vector<BlockSwap> swaps = kv_.swap_in(s->id);
  out.swap_in.insert(out.swap_in.end(), swaps.begin(), swaps.end());
  kv_.append(s->id, s->tokens, s->n_computed, n_end, out.copies);
  waiting_.pop_front();
  s->status = SeqStatus::Running;
  running_.push_back(s);
  out.scheduled.push_back({s, s->n_computed, n_new});
  budget -= n_new;
  return true;
}

void Scheduler::on_step_done(const SchedulerOutput& out) {
  for (const ScheduledSeq& sc : out.scheduled) {
    Sequence& s = *sc.seq;
    KESTREL_ASSERT(s.n_computed == sc.n_computed, "Scheduler: sequence changed during its step");
    s.n_computed += sc.n_new;
    if (config_.window > 0) {
      // The next token sits at n_computed, or back at n_computed - n_draft if every draft is
      // rejected; it reads keys from there + 1 - window. Blocks before go (computed full ones stay
      // in the prefix cache, published under the settled tokens only).
      const int64_t settled = s.n_computed - s.n_draft;
      kv_.release_before(s.id, settled + 1 - config_.window, s.tokens, settled);
    }
  }
}

void Scheduler::truncate(Sequence* seq, int64_t n_tokens) {
  KESTREL_ASSERT(seq->status == SeqStatus::Running && kv_.has(seq->id), "Scheduler: truncate of a sequence not running");
  KESTREL_ASSERT(n_tokens >= 1 && n_tokens <= static_cast<int64_t>(seq->tokens.size()),
                 "Scheduler: truncate to " + std::to_string(n_tokens) + " of " + std::to_string(seq->tokens.size()) +
                     " tokens");
  KESTREL_ASSERT(config_.window <= 0 ||
                     kv_.first_held(seq->id) <= std::max<int64_t>(0, std::min(seq->n_computed, n_tokens) + 1 - config_.window),
                 "Scheduler: truncate to " + std::to_string(n_tokens) + " tokens needs keys released before the window");
  const int64_t n_dropped = static_cast<int64_t>(seq->tokens.size()) - n_tokens;
  seq->n_draft = std::max<int64_t>(0, seq->n_draft - n_dropped);
  seq->tokens.resize(static_cast<size_t>(n_tokens));
  seq->n_computed = std::min(seq->n_computed, n_tokens);
  kv_.truncate(seq->id, n_tokens);
}

bool Scheduler::fork(Sequence* parent, Sequence* child) {
  KESTREL_ASSERT(parent->status == SeqStatus::Running && parent->n_draft == 0, "Scheduler: fork of a sequence not running");
  KESTREL_ASSERT(!kv_.has(child->id), "Scheduler: fork into a sequence that holds blocks");
  if (static_cast<int32_t>(running_.size()) >= config_.max_num_seqs) return false;
  kv_.fork(parent->id, child->id);
  child->tokens = parent->tokens;
  child->n_prompt = parent->n_prompt;
  child->n_computed = parent->n_computed;
  child->n_cached_prompt = parent->n_cached_prompt;
  child->status = SeqStatus::Running;
  running_.push_back(child);
  return true;
}

void Scheduler::finish(Sequence* seq) {
  if (seq->status == SeqStatus::Finished) return;
  if (seq->status == SeqStatus::Waiting) {
    waiting_.erase(std::remove(waiting_.begin(), waiting_.end(), seq), waiting_.end());
  } else {
    running_.erase(std::remove(running_.begin(), running_.end(), seq), running_.end());
  }
  if (kv_.has(seq->id)) kv_.free(seq->id, seq->tokens, seq->n_computed);
  if (kv_.is_swapped(seq->id)) kv_.free_swapped(seq->id);
  seq->status = SeqStatus::Finished;
}

}  // namespace kestrel
