// Scheduler policy without a model: a simulated engine feeds each sampling sequence a token that
// depends only on its history, so any mistake in chunking, preemption or block handling shows up
// as a wrong token sequence, a budget overrun, or a leaked block.
#include <gtest/gtest.h>

#include <algorithm>
#include <deque>
#include <map>
#include <memory>
#include <random>

#include "core/error.h"
#include "scheduler/scheduler.h"

namespace kestrel {
namespace {

// The "model": the next token is a hash of the whole history.
int32_t next_token(const std::vector<int32_t>& tokens) {
  uint32_t h = 2166136261u;
  for (int32_t t : tokens) h = (h ^ static_cast<uint32_t>(t)) * 16777619u;
  return static_cast<int32_t>(h % 1000);
}

struct Sim {
  Sim(int32_t n_blocks, int32_t block_size, int32_t max_seqs, int64_t budget, bool caching = true, int64_t window = 0)
      : kv({n_blocks, block_size, caching}), sched({max_seqs, budget, window}, kv) {}

  SeqId submit(std::vector<int32_t> prompt, int64_t n_gen) {
    auto s = std::make_unique<Sequence>();
    s->id = next_id++;
    s->tokens = std::move(prompt);
    s->n_prompt = static_cast<int64_t>(s->tokens.size());
    targets[s->id] = n_gen;
    sched.add(s.get());
    const SeqId id = s->id;
    seqs[id] = std::move(s);
    return id;
  }
  void abort(SeqId id) {
    sched.finish(seqs.at(id).get());
    finished[id] = std::move(seqs.at(id));
    seqs.erase(id);
  }
  // One step; returns its output for inspection. Checks the step's invariants.
  SchedulerOutput step() {
    SchedulerOutput out = sched.schedule();
    n_preempted += static_cast<int64_t>(out.preempted.size());
    EXPECT_LE(out.n_tokens, sched.config().max_num_batched_tokens);
    EXPECT_LE(static_cast<int32_t>(sched.n_running()), sched.config().max_num_seqs);
    for (size_t i = 0; i < out.scheduled.size(); ++i) {
      const ScheduledSeq& sc = out.scheduled[i];
      EXPECT_GT(sc.n_new, 0);
      if (static_cast<int64_t>(i) < out.n_decodes) {
        EXPECT_EQ(sc.n_new, 1);
        EXPECT_TRUE(sc.samples());
      }
      // Every token scheduled has a slot.
      EXPECT_GE(static_cast<int64_t>(kv.block_table(sc.seq->id).size()) * kv.block_size(), sc.n_computed + sc.n_new);
    }
    sched.on_step_done(out);
    std::vector<Sequence*> done;
    for (const ScheduledSeq& sc : out.scheduled) {
      if (!sc.samples()) continue;
      Sequence* s = sc.seq;
      s->tokens.push_back(next_token(s->tokens));
      if (s->n_generated() >= targets.at(s->id)) done.push_back(s);
    }
    for (Sequence* s : done) {
      sched.finish(s);
      finished[s->id] = std::move(seqs.at(s->id));
      seqs.erase(s->id);
    }
    kv.check_invariants();
    return out;
  }
  void run_to_end(int max_steps = 100000) {
    for (int i = 0; i < max_steps && (sched.n_waiting() + sched.n_running()) > 0; ++i) step();
    ASSERT_EQ(sched.n_waiting() + sched.n_running(), 0u) << "did not finish";
  }
  // What the sequence would be if run alone: the prompt plus n_gen chained tokens.
  static std::vector<int32_t> expected(std::vector<int32_t> prompt, int64_t n_gen) {
    for (int64_t i = 0; i < n_gen; ++i) prompt.push_back(next_token(prompt));
    return prompt;
  }

  KvManager kv;
  Scheduler sched;
  std::map<SeqId, std::unique_ptr<Sequence>> seqs, finished;
  std::map<SeqId, int64_t> targets;
  SeqId next_id = 1;
  int64_t n_preempted = 0;
};

std::vector<int32_t> prompt_of(int32_t n, int32_t salt) {
  std::vector<int32_t> p;
  for (int32_t i = 0; i < n; ++i) p.push_back((i * 7 + salt * 13) % 500);
  return p;
}

TEST(Scheduler, BadConfigIsAnError) {
  KvManager kv({8, 4, true});
  EXPECT_THROW(Scheduler({0, 16}, kv), Error);
  EXPECT_THROW(Scheduler({4, 0}, kv), Error);
}

TEST(Scheduler, LongPromptIsChunkedBesideRunningDecodes) {
  Sim sim(64, 4, 8, 16);
  const SeqId a = sim.submit(prompt_of(5, 1), 30);
  sim.step();  // a's prompt
  sim.step();  // a decodes
  const SeqId b = sim.submit(prompt_of(100, 2), 3);
  for (int i = 0; i < 6; ++i) {
    const SchedulerOutput out = sim.step();
    ASSERT_GE(out.scheduled.size(), 2u);
    EXPECT_EQ(out.scheduled[0].seq->id, a);  // the decode first
    EXPECT_EQ(out.n_decodes, 1);
    EXPECT_EQ(out.scheduled[1].seq->id, b);
    EXPECT_EQ(out.scheduled[1].n_new, 15);  // the rest of the 16-token budget
  }
  sim.run_to_end();
  EXPECT_EQ(sim.finished.at(a)->tokens, Sim::expected(prompt_of(5, 1), 30));
  EXPECT_EQ(sim.finished.at(b)->tokens, Sim::expected(prompt_of(100, 2), 3));
  EXPECT_EQ(sim.kv.n_used_blocks(), 0);
}

TEST(Scheduler, RespectsMaxNumSeqs) {
  Sim sim(256, 4, 3, 1000);
  for (int i = 0; i < 10; ++i) sim.submit(prompt_of(6, i), 4);
  const SchedulerOutput out = sim.step();
  EXPECT_EQ(out.scheduled.size(), 3u);
  EXPECT_EQ(sim.sched.n_running(), 3u);
  EXPECT_EQ(sim.sched.n_waiting(), 7u);
  sim.run_to_end();
  for (int i = 0; i < 10; ++i)
    EXPECT_EQ(sim.finished.at(static_cast<SeqId>(i + 1))->tokens, Sim::expected(prompt_of(6, i), 4));
}

TEST(Scheduler, PreemptsByRecomputeWhenBlocksRunOutAndOutputsStayTheSame) {
  // 12 blocks of 4 tokens = 48 slots; 6 sequences that each grow to 24 tokens cannot all fit.
  for (bool caching : {false, true}) {
    Sim sim(12, 4, 6, 64, caching);
    for (int i = 0; i < 6; ++i) sim.submit(prompt_of(8, i), 16);
    sim.run_to_end();
    EXPECT_GT(sim.n_preempted, 0) << "caching " << caching;
    for (int i = 0; i < 6; ++i)
      EXPECT_EQ(sim.finished.at(static_cast<SeqId>(i + 1))->tokens, Sim::expected(prompt_of(8, i), 16));
    EXPECT_EQ(sim.kv.n_used_blocks(), 0);
    EXPECT_EQ(sim.kv.n_free_blocks(), 12);
  }
}

// Pipelined passes (pipeline parallelism): two passes in flight, each step completing the oldest
// and scheduling the next with decode_share 2. A sequence in flight is never scheduled again nor
// preempted before its pass completes, each pass takes at most half the running decodes (rounded
// up), and the outputs are those of one sequence alone, with and without preemption.
TEST(Scheduler, PassesInFlightLeaveTheirSequencesOutAndShareTheDecodes) {
  for (int32_t n_blocks : {256, 14}) {
    Sim sim(n_blocks, 4, 8, 64);
    for (int i = 0; i < 8; ++i) sim.submit(prompt_of(6 + i, i), 14);
    std::deque<SchedulerOutput> in_flight;
    auto complete_oldest = [&] {
      SchedulerOutput out = std::move(in_flight.front());
      in_flight.pop_front();
      for (const ScheduledSeq& sc : out.scheduled) sc.seq->in_flight = false;
      sim.sched.on_step_done(out);
      std::vector<Sequence*> done;
      for (const ScheduledSeq& sc : out.scheduled) {
        if (!sc.samples()) continue;
        sc.seq->tokens.push_back(next_token(sc.seq->tokens));
        if (sc.seq->n_generated() >= sim.targets.at(sc.seq->id)) done.push_back(sc.seq);
      }
      for (Sequence* s : done) {
        sim.sched.finish(s);
        sim.finished[s->id] = std::move(sim.seqs.at(s->id));
        sim.seqs.erase(s->id);
      }
    };
    int64_t n_overlapped = 0;
    for (int i = 0; i < 10000 && (sim.sched.n_waiting() + sim.sched.n_running() > 0 || !in_flight.empty()); ++i) {
      if (in_flight.size() == 2) complete_oldest();
      int64_t n_decodes = 0;
      for (const auto& [id, seq] : sim.seqs) n_decodes += seq->status == SeqStatus::Running && seq->is_decode();
      SchedulerOutput out = sim.sched.schedule(2);
      sim.n_preempted += static_cast<int64_t>(out.preempted.size());
      EXPECT_LE(out.n_decodes, (n_decodes + 1) / 2);
      for (const Sequence* p : out.preempted) EXPECT_FALSE(p->in_flight);
      for (const ScheduledSeq& sc : out.scheduled) {
        EXPECT_FALSE(sc.seq->in_flight) << "sequence " << sc.seq->id << " scheduled while in flight";
        sc.seq->in_flight = true;
      }
      sim.kv.check_invariants();
      if (out.empty()) {
        if (!in_flight.empty()) complete_oldest();
        continue;
      }
      n_overlapped += !in_flight.empty();
      in_flight.push_back(std::move(out));
    }
    ASSERT_TRUE(sim.seqs.empty() && in_flight.empty()) << "did not finish";
    EXPECT_GT(n_overlapped, 20) << n_blocks << " blocks";
    if (n_blocks == 14) EXPECT_GT(sim.n_preempted, 0);
    for (int i = 0; i < 8; ++i)
      EXPECT_EQ(sim.finished.at(static_cast<SeqId>(i + 1))->tokens, Sim::expected(prompt_of(6 + i, i), 14))
          << n_blocks << " blocks, sequence " << i;
    EXPECT_EQ(sim.kv.n_used_blocks(), 0);
  }
}

TEST(Scheduler, SharedPrefixIsComputedOnce) {
  Sim sim(64, 4, 4, 64);
  std::vector<int32_t> p = prompt_of(40, 3);
  sim.submit(p, 2);
  sim.step();
  sim.step();  // decode step: the prompt's blocks are now published
  auto q = p;
  q.push_back(999);
  const SeqId b = sim.submit(q, 2);
  const SchedulerOutput out = sim.step();
  const ScheduledSeq* sb = nullptr;
  for (const auto& sc : out.scheduled)
    if (sc.seq->id == b) sb = &sc;
  ASSERT_NE(sb, nullptr);
  EXPECT_EQ(sb->n_computed, 40);  // 10 full blocks from the cache
  EXPECT_EQ(sb->n_new, 1);
  EXPECT_EQ(sim.seqs.count(b) ? sim.seqs.at(b)->n_cached_prompt : sim.finished.at(b)->n_cached_prompt, 40);
  sim.run_to_end();
  EXPECT_EQ(sim.finished.at(b)->tokens, Sim::expected(q, 2));
}

TEST(Scheduler, ThousandRandomSubmitAbortFinishOperationsLeakNothing) {
  std::mt19937 rng(1234);
  Sim sim(40, 4, 6, 24);
  std::vector<std::vector<int32_t>> prefixes;
  for (int i = 0; i < 4; ++i) prefixes.push_back(prompt_of(12, 100 + i));
  int n_submit = 0, n_abort = 0, n_steps = 0;
  for (int op = 0; op < 1000; ++op) {
    const int kind = static_cast<int>(rng() % 10);
    if (kind < 3) {
      // Often a shared prefix, so the prefix cache and its eviction are exercised too.
      std::vector<int32_t> p;
      if (rng() % 2) p = prefixes[rng() % prefixes.size()];
      const int32_t extra = 1 + static_cast<int32_t>(rng() % 30);
      for (int32_t i = 0; i < extra; ++i) p.push_back(static_cast<int32_t>(rng() % 500));
      sim.submit(std::move(p), 1 + static_cast<int64_t>(rng() % 20));
      ++n_submit;
    } else if (kind < 4 && !sim.seqs.empty()) {
      auto it = sim.seqs.begin();
      std::advance(it, static_cast<long>(rng() % sim.seqs.size()));
      sim.abort(it->first);
      sim.kv.check_invariants();
      ++n_abort;
    } else {
      sim.step();
      ++n_steps;
    }
  }
  EXPECT_GT(n_submit, 200);
  EXPECT_GT(n_abort, 50);
  EXPECT_GT(sim.n_preempted, 0);
  EXPECT_GT(sim.kv.prefix_hit_tokens(), 0);
  // Finished sequences got exactly their tokens.
  for (const auto& [id, s] : sim.finished)
    if (s->n_generated() == sim.targets.at(id))
      EXPECT_EQ(s->tokens, Sim::expected({s->tokens.begin(), s->tokens.begin() + s->n_prompt}, s->n_generated()));
  // Abort whatever is left: every block must be back (free or evictable in the prefix cache).
  while (!sim.seqs.empty()) sim.abort(sim.seqs.begin()->first);
  sim.kv.check_invariants();
  EXPECT_EQ(sim.kv.n_seqs(), 0u);
  EXPECT_EQ(sim.kv.n_used_blocks(), 0);
  EXPECT_EQ(sim.kv.n_free_blocks(), sim.kv.n_blocks());
}

}  // namespace
}  // namespace kestrel

namespace kestrel {
namespace {

// Window 8, blocks of 4, 8 tokens a step: a sequence needs at most ceil((8 + 8) / 4) + 1 = 5
// blocks at once, so a 40-token prompt and 30 tokens (18 blocks) run in a pool of 6 without
// preemption, and after every step the sequence holds no block wholly before the first key its
// next token reads (position n_computed + 1 - 8).
TEST(Scheduler, WindowReleasesBlocksSoALongSequenceRunsInASmallPool) {
  Sim sim(6, 4, 4, 8, true, /*window=*/8);
  const SeqId a = sim.submit(prompt_of(40, 3), 30);
  int32_t most_used = 0;
  while (sim.sched.n_running() + sim.sched.n_waiting() > 0) {
    sim.step();
    most_used = std::max(most_used, sim.kv.n_used_blocks());
    if (!sim.seqs.count(a)) break;
    const int64_t first_key = std::max<int64_t>(0, sim.seqs.at(a)->n_computed + 1 - 8);
    EXPECT_EQ(sim.kv.first_held(a), first_key / 4 * 4) << "n_computed " << sim.seqs.at(a)->n_computed;
  }
  EXPECT_EQ(sim.finished.at(a)->tokens, Sim::expected(prompt_of(40, 3), 30));
  EXPECT_EQ(sim.n_preempted, 0);
  EXPECT_LE(most_used, 5);
  EXPECT_EQ(sim.kv.n_used_blocks(), 0);
}

// Without a window the same sequence cannot fit (the engine refuses such a pool): its prompt
// stalls once the 6 blocks (24 positions) are full.
TEST(Scheduler, WithoutAWindowTheSameSequenceDoesNotFit) {
  Sim sim(6, 4, 4, 8, true, /*window=*/0);
  const SeqId a = sim.submit(prompt_of(40, 3), 30);
  for (int i = 0; i < 50; ++i) sim.step();
  EXPECT_EQ(sim.sched.n_waiting() + sim.sched.n_running(), 1u);
  EXPECT_EQ(sim.seqs.at(a)->n_computed, 24);
}

// A prompt whose prefix is cached takes only the hit blocks its window reads: the released blocks
// of the first run were published, and the second run skips hits before position 36 + 1 - 8.
TEST(Scheduler, WindowAdmissionTakesOnlyTheHitsItsWindowReads) {
  Sim sim(64, 4, 4, 64, true, /*window=*/8);
  const SeqId a = sim.submit(prompt_of(40, 5), 4);
  sim.run_to_end();
  const SeqId b = sim.submit(prompt_of(40, 5), 4);
  const SchedulerOutput out = sim.step();
  ASSERT_EQ(out.scheduled.size(), 1u);
  EXPECT_EQ(out.scheduled[0].n_computed, 36);  // 9 whole blocks hit, the last token computed
  // After the step (n_computed 40) the first key read is 33: blocks 0..7 are not held.
  EXPECT_EQ(sim.kv.first_held(b), 32);
  sim.run_to_end();
  EXPECT_EQ(sim.finished.at(b)->tokens, sim.finished.at(a)->tokens);
}

}  // namespace
}  // namespace kestrel
