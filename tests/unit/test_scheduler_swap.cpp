// Preemption by swap, without a model: a simulated engine keeps one value per KV slot in a device
// pool and a host swap pool, writes it as a forward pass would (a chain over the slot before it,
// read back through the block table, and the position's token), applies a step's copies in the
// engine's order (swap-outs, copy-on-write copies, swap-ins) and samples from the last slot. Any
// K/V a swap or a copy loses or misplaces then changes a later token, and the reference is the
// same chain computed directly over the token ids (no cache at all). The CPU backend's own swap
// copies are checked through its forward pass (swap_roundtrip.h).
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <memory>
#include <random>

#include "backend/model_runner.h"
#include "core/error.h"
#include "model/llama_weights.h"
#include "scheduler/scheduler.h"
#include "swap_roundtrip.h"
#include "test_util.h"

namespace kestrel {
namespace {

uint64_t mix(uint64_t prev, int32_t token) {
  uint64_t h = (prev ^ (static_cast<uint64_t>(static_cast<uint32_t>(token)) + 0x9e3779b97f4a7c15ull)) * 0xff51afd7ed558ccdull;
  return h ^ (h >> 29);
}
int32_t token_of(uint64_t kv) { return static_cast<int32_t>(kv % 1000); }

// The reference: the prompt and n_gen tokens, each sampled from the chain over all before it.
std::vector<int32_t> expected(std::vector<int32_t> tokens, int64_t n_gen) {
  uint64_t kv = 0;
  for (size_t i = 0; i + 1 < tokens.size(); ++i) kv = mix(kv, tokens[i]);
  for (int64_t i = 0; i < n_gen; ++i) {
    kv = mix(kv, tokens.back());
    tokens.push_back(token_of(kv));
  }
  return tokens;
}

std::vector<int32_t> prompt_of(int32_t n, int32_t salt) {
  std::vector<int32_t> p;
  for (int32_t i = 0; i < n; ++i) p.push_back((i * 7 + salt * 13) % 500);
  return p;
}

struct SwapSim {
  SwapSim(int32_t n_blocks, int32_t n_swap, int32_t block_size, int32_t max_seqs, int64_t budget, PreemptionMode mode,
          bool caching = true, int64_t window = 0)
      : kv({n_blocks, block_size, caching, n_swap}),
        sched({max_seqs, budget, window, mode}, kv),
        device(static_cast<size_t>(n_blocks) * block_size, 0),
        host(static_cast<size_t>(n_swap) * block_size, 0) {}

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
    if (kv.is_swapped(id)) ++n_aborted_swapped;
    sched.finish(seqs.at(id).get());
    seqs.erase(id);
  }
  uint64_t& slot(SeqId id, int64_t pos) {
    const int32_t b = kv.block_table(id)[static_cast<size_t>(pos / kv.block_size())];
    return device[static_cast<size_t>(b) * kv.block_size() + static_cast<size_t>(pos % kv.block_size())];
  }
  void copy_block(std::vector<uint64_t>& from, int32_t src, std::vector<uint64_t>& to, int32_t dst) {
    const size_t bs = static_cast<size_t>(kv.block_size());
    std::copy_n(from.begin() + static_cast<long>(src * bs), bs, to.begin() + static_cast<long>(dst * bs));
  }
  void step() {
    const SchedulerOutput out = sched.schedule();
    n_preempted += static_cast<int64_t>(out.preempted.size());
    n_swapped += out.n_swapped;
    for (const BlockSwap& s : out.swap_out) copy_block(device, s.device, host, s.host);
    for (const BlockCopy& c : out.copies) copy_block(device, c.src, device, c.dst);
    for (const BlockSwap& s : out.swap_in) copy_block(host, s.host, device, s.device);
    // The pass: each scheduled token's K/V from the slot before it (read through the table) and
    // its token.
    for (const ScheduledSeq& sc : out.scheduled)
      for (int64_t p = sc.n_computed; p < sc.n_computed + sc.n_new; ++p)
        slot(sc.seq->id, p) = mix(p == 0 ? 0 : slot(sc.seq->id, p - 1), sc.seq->tokens[static_cast<size_t>(p)]);
    sched.on_step_done(out);
    std::vector<Sequence*> done;
    for (const ScheduledSeq& sc : out.scheduled) {
      if (!sc.samples()) continue;
      Sequence* s = sc.seq;
      s->tokens.push_back(token_of(slot(s->id, s->n_computed - 1)));
      if (s->n_generated() >= targets.at(s->id)) done.push_back(s);
    }
    for (Sequence* s : done) {
      sched.finish(s);
      results[s->id] = s->tokens;
      seqs.erase(s->id);
    }
    kv.check_invariants();
  }
  void run_to_end() {
    for (int i = 0; i < 100000 && (sched.n_waiting() + sched.n_running()) > 0; ++i) step();
    ASSERT_EQ(sched.n_waiting() + sched.n_running(), 0u) << "did not finish";
  }

  KvManager kv;
  Scheduler sched;
  std::vector<uint64_t> device, host;
  std::map<SeqId, std::unique_ptr<Sequence>> seqs;
  std::map<SeqId, std::vector<int32_t>> results;
  std::map<SeqId, int64_t> targets;
  SeqId next_id = 1;
  int64_t n_preempted = 0, n_swapped = 0, n_aborted_swapped = 0;
};

TEST(KvManagerSwap, SwapOutFreesTheDeviceBlocksAndSwapInBringsThemBack) {
  KvManager kv({8, 4, true, 4});
  std::vector<BlockCopy> copies;
  const std::vector<int32_t> t = prompt_of(10, 1);
  kv.allocate(1, t, 10);  // 3 blocks
  EXPECT_EQ(kv.n_free_blocks(), 5);
  ASSERT_TRUE(kv.can_swap_out(1));
  const std::vector<BlockSwap> out = kv.swap_out(1, t, 10);
  ASSERT_EQ(out.size(), 3u);
  EXPECT_FALSE(kv.has(1));
  EXPECT_TRUE(kv.is_swapped(1));
  EXPECT_EQ(kv.n_used_blocks(), 0);
  EXPECT_EQ(kv.n_free_swap_blocks(), 1);
  EXPECT_EQ(kv.n_cached_blocks(), 2);  // the two computed full blocks stay in the prefix cache
  kv.check_invariants();
  EXPECT_EQ(kv.n_free_blocks(), 8);
  EXPECT_FALSE(kv.can_swap_in(1, 36));  // 3 held + 6 growth > 8 free
  ASSERT_TRUE(kv.can_swap_in(1, 11));
  const std::vector<BlockSwap> in = kv.swap_in(1);
  ASSERT_EQ(in.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(in[i].host, out[i].host);  // the same logical block comes back from its host block
    EXPECT_EQ(kv.block_table(1)[i], in[i].device);
  }
  EXPECT_EQ(kv.n_free_swap_blocks(), 4);
  EXPECT_EQ(kv.n_swapped_out_blocks(), 3);
  EXPECT_EQ(kv.n_swapped_in_blocks(), 3);
  kv.append(1, t, 10, 11, copies);
  EXPECT_TRUE(copies.empty());  // swapped-in blocks are private
  kv.free(1);
  kv.check_invariants();
  EXPECT_EQ(kv.n_used_blocks(), 0);
}

TEST(KvManagerSwap, ASequenceSharingABlockIsNotSwappedAndTheHostPoolBoundsSwapOut) {
  KvManager kv({8, 4, false, 3});
  const std::vector<int32_t> t = prompt_of(8, 2);
  kv.allocate(1, t, 8);  // 2 blocks
  kv.fork(1, 2);
  EXPECT_FALSE(kv.can_swap_out(1));
  EXPECT_FALSE(kv.can_swap_out(2));
  kv.free(2);
  ASSERT_TRUE(kv.can_swap_out(1));
  kv.swap_out(1, t, 8);
  EXPECT_EQ(kv.n_free_swap_blocks(), 1);
  kv.allocate(3, prompt_of(8, 3), 8);
  EXPECT_FALSE(kv.can_swap_out(3));  // 2 blocks, 1 host block free
  kv.check_invariants();
  kv.free_swapped(1);
  EXPECT_EQ(kv.n_free_swap_blocks(), 3);
  EXPECT_TRUE(kv.can_swap_out(3));
  kv.free(3);
  kv.check_invariants();
  EXPECT_EQ(kv.n_used_blocks(), 0);
  EXPECT_THROW(KvManager(KvManagerConfig{8, 4, true, -1}), Error);
}

TEST(SchedulerSwap, ModeNamesRoundTripAndOthersAreErrors) {
  for (PreemptionMode m : {PreemptionMode::Recompute, PreemptionMode::Swap, PreemptionMode::Auto})
    EXPECT_EQ(parse_preemption_mode(preemption_mode_name(m)), m);
  EXPECT_THROW(parse_preemption_mode("never"), Error);
}

// 12 blocks of 4 tokens; 6 sequences that each grow to 24 tokens cannot all fit. Every mode gives
// the reference's tokens; swap preempts by swap only while the host pool has room.
TEST(SchedulerSwap, SwapGivesTheTokensOfRecomputeAndOfTheReference) {
  for (bool caching : {false, true})
    for (int32_t n_swap : {64, 5}) {
      SwapSim sim(12, n_swap, 4, 6, 64, PreemptionMode::Swap, caching);
      for (int i = 0; i < 6; ++i) sim.submit(prompt_of(8, i), 16);
      sim.run_to_end();
      EXPECT_GT(sim.n_swapped, 0) << "caching " << caching << " swap blocks " << n_swap;
      if (n_swap == 5) EXPECT_GT(sim.n_preempted, sim.n_swapped) << "a full host pool recomputes";
      for (int i = 0; i < 6; ++i)
        EXPECT_EQ(sim.results.at(static_cast<SeqId>(i + 1)), expected(prompt_of(8, i), 16)) << "sequence " << i;
      EXPECT_EQ(sim.kv.n_used_blocks(), 0);
      EXPECT_EQ(sim.kv.n_free_swap_blocks(), n_swap);
      EXPECT_GT(sim.kv.n_swapped_in_blocks(), 0);
      EXPECT_EQ(sim.kv.n_swapped_in_blocks(), sim.kv.n_swapped_out_blocks());
    }
}

TEST(SchedulerSwap, AutoSwapsOnlyWhenTheCostModelSaysSo) {
  for (const bool swap_cheaper : {false, true}) {
    SwapSim sim(12, 64, 4, 6, 64, PreemptionMode::Auto);
    // A held block of 4 tokens against its tokens' recompute time.
    sim.sched.set_preemption_costs(swap_cheaper ? PreemptionCosts{1.0, 1.0} : PreemptionCosts{8.0, 1.0});
    for (int i = 0; i < 6; ++i) sim.submit(prompt_of(8, i), 16);
    sim.run_to_end();
    EXPECT_GT(sim.n_preempted, 0);
    EXPECT_EQ(sim.n_swapped > 0, swap_cheaper);
    for (int i = 0; i < 6; ++i) EXPECT_EQ(sim.results.at(static_cast<SeqId>(i + 1)), expected(prompt_of(8, i), 16));
  }
}

// Window 8 (every block wholly before a sequence's window is released after each step): swapped
// tables keep their leading holes, and only held blocks take host blocks.
TEST(SchedulerSwap, WindowedSequencesSwapOnlyTheBlocksTheyHold) {
  SwapSim sim(12, 64, 4, 6, 12, PreemptionMode::Swap, true, 8);
  for (int i = 0; i < 6; ++i) sim.submit(prompt_of(24, i), 30);
  sim.run_to_end();
  EXPECT_GT(sim.n_swapped, 0);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(sim.results.at(static_cast<SeqId>(i + 1)), expected(prompt_of(24, i), 30));
  // A 54-token sequence spans 14 blocks; with the window it holds at most ceil((8 + 12) / 4) + 1.
  EXPECT_LE(sim.kv.n_swapped_out_blocks(), sim.n_swapped * 6);
  EXPECT_EQ(sim.kv.n_used_blocks(), 0);
  EXPECT_EQ(sim.kv.n_free_swap_blocks(), 64);
}

// Random submits (shared prefixes, so prefix-cache hits and copy-on-write), aborts (of swapped-out
// sequences too) and steps: finished sequences have the reference's tokens, and at the end every
// device and host block is free.
TEST(SchedulerSwap, ThousandRandomOperationsWithSwapLeakNothing) {
  std::mt19937 rng(4321);
  SwapSim sim(40, 24, 4, 6, 24, PreemptionMode::Swap);
  std::vector<std::vector<int32_t>> prefixes;
  for (int i = 0; i < 4; ++i) prefixes.push_back(prompt_of(12, 100 + i));
  for (int op = 0; op < 1000; ++op) {
    const int kind = static_cast<int>(rng() % 10);
    if (kind < 3) {
      std::vector<int32_t> p;
      if (rng() % 2) p = prefixes[rng() % prefixes.size()];
      const int32_t extra = 1 + static_cast<int32_t>(rng() % 30);
      for (int32_t i = 0; i < extra; ++i) p.push_back(static_cast<int32_t>(rng() % 500));
      sim.submit(std::move(p), 1 + static_cast<int64_t>(rng() % 20));
    } else if (kind < 4 && !sim.seqs.empty()) {
      // Half the time a swapped-out sequence, when there is one.
      auto it = sim.seqs.begin();
      std::advance(it, static_cast<long>(rng() % sim.seqs.size()));
      if (rng() % 2)
        for (auto s = sim.seqs.begin(); s != sim.seqs.end(); ++s)
          if (sim.kv.is_swapped(s->first)) it = s;
      sim.abort(it->first);
      sim.kv.check_invariants();
    } else {
      sim.step();
    }
  }
  EXPECT_GT(sim.n_swapped, 10);
  EXPECT_GT(sim.n_aborted_swapped, 0);
  EXPECT_GT(sim.kv.prefix_hit_tokens(), 0);
  for (const auto& [id, tokens] : sim.results) {
    const int64_t n_gen = sim.targets.at(id);
    const std::vector<int32_t> prompt(tokens.begin(), tokens.end() - n_gen);
    EXPECT_EQ(tokens, expected(prompt, n_gen)) << "sequence " << id;
  }
  while (!sim.seqs.empty()) sim.abort(sim.seqs.begin()->first);
  sim.kv.check_invariants();
  EXPECT_EQ(sim.kv.n_seqs(), 0u);
  EXPECT_EQ(sim.kv.n_used_blocks(), 0);
  EXPECT_EQ(sim.kv.n_free_swap_blocks(), sim.kv.n_swap_blocks());
}

}  // namespace
}  // namespace kestrel

namespace kestrel {

TEST(CpuBackendSwap, SwappedBlocksComeBackWithTheirKeysAndValues) {
  const std::string path = test::data_dir() + "/stories260K/stories260K.gguf";
  KESTREL_REQUIRE_FILE(path);
  const auto model = LlamaModel::load_gguf(path);
  for (const KvDtype dtype : {KvDtype::F32, KvDtype::F16, KvDtype::INT8}) {
    SCOPED_TRACE(kv_dtype_name(dtype));
    RunnerOptions o;
    o.block_size = 16;
    o.n_kv_blocks = 8;
    o.kv_dtype = dtype;
    o.n_threads = 1;
    test::expect_swap_roundtrip_keeps_logits([&] { return make_cpu_model_runner(*model, o); },
                                             static_cast<int32_t>(model->hparams().n_vocab));
  }
}

TEST(CpuBackendSwap, SwappedBlocksOutAndInAtOnceCopyEachBlockOutBeforeIn) {
  const std::string path = test::data_dir() + "/stories260K/stories260K.gguf";
  KESTREL_REQUIRE_FILE(path);
  const auto model = LlamaModel::load_gguf(path);
  RunnerOptions o;
  o.block_size = 16;
  o.n_kv_blocks = 8;
  o.n_threads = 1;
  test::expect_swap_out_in_orders_each_block([&] { return make_cpu_model_runner(*model, o); },
                                             static_cast<int32_t>(model->hparams().n_vocab));
}

TEST(CpuBackendKvTransfer, TransferredBlocksGiveTheLogitsOfTheRunnerThatComputedThem) {
  const std::string path = test::data_dir() + "/stories260K/stories260K.gguf";
  KESTREL_REQUIRE_FILE(path);
  const auto model = LlamaModel::load_gguf(path);
  for (const KvDtype dtype : {KvDtype::F32, KvDtype::F16, KvDtype::INT8}) {
    for (const int tp : {1, 2}) {
      SCOPED_TRACE(std::string(kv_dtype_name(dtype)) + ", tensor parallel " + std::to_string(tp));
      RunnerOptions o;
      o.block_size = 16;
      o.n_kv_blocks = 8;
      o.kv_dtype = dtype;
      o.n_threads = 2;
      o.tensor_parallel_size = tp;
      test::expect_kv_transfer_keeps_logits([&] { return make_cpu_model_runner(*model, o); },
                                            static_cast<int32_t>(model->hparams().n_vocab));
    }
  }
}

}  // namespace kestrel
