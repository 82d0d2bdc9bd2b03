// Preemption by swap on a real model (stories260K, CPU backend): 32 mixed requests (greedy, seeded
// sampling, two choices of one prompt) in a KV pool too small for them give the tokens of an
// unconstrained pool whether preempted sequences are recomputed or swapped to host memory (the
// CPU forward pass is batch-invariant, so equal K/V give equal bits), and every device and host
// block is free at the end, aborts of swapped-out requests included.
#include <gtest/gtest.h>

#include <cstdio>
#include <map>

#include "core/error.h"
#include "engine/engine.h"
#include "test_util.h"

using namespace kestrel;

namespace {

using test::eog_ids;
using test::story_prompts;

using Loaded = test::LoadedModel;
Loaded load_stories() { return test::load_model(test::stories_path()); }
using test::stories_path;

// Request i of 32: i % 4 == 0 greedy; 1 seeded sampling; 2 and 3 two seeded choices of request
// (i - i % 4 + 2)'s prompt (n = 2: the second shares the first's prompt blocks copy-on-write).
std::vector<Request> mixed_requests(const Loaded& l) {
  const std::vector<std::string> texts = story_prompts();
  std::vector<Request> out;
  for (size_t i = 0; i < 32; ++i) {
    Request r;
    r.prompt = l.tokenizer->encode(texts[i % 4 == 3 ? i - 1 : i], true, false);
    r.max_tokens = 64;
    r.stop_ids = eog_ids(*l.tokenizer);
    if (i % 4 == 0) {
      r.sampling.temperature = 0;
    } else {
      r.sampling.temperature = 0.8f;
      r.sampling.top_p = 0.95f;
      r.sampling.seed = 1000 + i;
    }
    out.push_back(std::move(r));
  }
  return out;
}

// A pool of 24 blocks of 8 tokens (192 slots) for 32 sequences of up to ~75 tokens: preemption.
EngineConfig tight_config() {
  EngineConfig c;
  c.block_size = 8;
  c.max_model_len = 128;
  c.n_kv_blocks = 24;
  c.max_num_batched_tokens = 64;
  c.max_num_seqs = 16;
  return c;
}

void expect_all_free(const Engine& e) {
  EXPECT_EQ(e.stats().kv_blocks_used, 0);
  EXPECT_EQ(e.stats().kv_blocks_free, e.stats().n_kv_blocks);
  EXPECT_EQ(e.stats().swap_blocks_free, e.stats().n_swap_blocks);
  EXPECT_EQ(e.n_running() + e.n_waiting(), 0u);
}

}  // namespace

TEST(EngineSwap, SwapAndRecomputeGiveTheTokensOfAnUnconstrainedPool) {
  KESTREL_REQUIRE_FILE(stories_path());
  const Loaded l = load_stories();
  const std::vector<Request> requests = mixed_requests(l);

  EngineConfig roomy = tight_config();
  roomy.n_kv_blocks = 0;  // sized for max_num_seqs whole sequences
  Engine reference(*l.model, l.tokenizer.get(), roomy);
  const auto want = test::run_to_end(reference, requests);
  ASSERT_EQ(reference.stats().n_preemptions, 0);

  const int64_t bytes = test::kv_block_bytes(l, tight_config());
  int64_t recomputed_prompt_tokens = 0;
  struct Case {
    const char* name;
    PreemptionMode mode;
    int64_t swap_blocks;
  };
  // 64 host blocks hold every preempted sequence; 6 hold few, so most preemptions recompute.
  for (const Case& k : {Case{"recompute", PreemptionMode::Recompute, 0}, Case{"swap", PreemptionMode::Swap, 64},
                        Case{"swap, small host pool", PreemptionMode::Swap, 6}, Case{"auto", PreemptionMode::Auto, 64}}) {
    EngineConfig c = tight_config();
    c.preemption_mode = k.mode;
    c.swap_space_bytes = k.swap_blocks * bytes;
    Engine e(*l.model, l.tokenizer.get(), c);
    EXPECT_EQ(e.stats().n_swap_blocks, k.swap_blocks) << k.name;
    const auto got = test::run_to_end(e, requests);
    for (size_t i = 0; i < requests.size(); ++i) EXPECT_EQ(got[i], want[i]) << k.name << ", request " << i;
    const EngineStats& s = e.stats();
    EXPECT_GT(s.n_preemptions, 0) << k.name;
    if (k.mode == PreemptionMode::Recompute) {
      EXPECT_EQ(s.n_swap_preemptions, 0);
      recomputed_prompt_tokens = s.n_prompt_tokens_computed;
    }
    if (k.mode == PreemptionMode::Swap) {
      EXPECT_GT(s.n_swap_preemptions, 0) << k.name;
      EXPECT_GT(s.n_swapped_out_blocks, 0) << k.name;
      // A swapped sequence's K/V come back instead of being prefilled again.
      EXPECT_LT(s.n_prompt_tokens_computed, recomputed_prompt_tokens) << k.name;
    }
    std::printf("%s: %lld preemptions (%lld by swap), %lld blocks out, %lld in, %lld prompt tokens computed\n", k.name,
                static_cast<long long>(s.n_preemptions), static_cast<long long>(s.n_swap_preemptions),
                static_cast<long long>(s.n_swapped_out_blocks), static_cast<long long>(s.n_swapped_in_blocks),
                static_cast<long long>(s.n_prompt_tokens_computed));
    if (k.swap_blocks == 6) EXPECT_GT(s.n_preemptions, s.n_swap_preemptions) << "a full host pool recomputes";
    EXPECT_EQ(s.n_swapped_in_blocks, s.n_swapped_out_blocks) << k.name;
    expect_all_free(e);
  }
}

// With n-gram speculation (drafts proposed before the step, dropped when their sequence is
// preempted): swap gives recompute's tokens, and both the greedy ones of the unconstrained pool.
TEST(EngineSwap, SwapWithSpeculativeDecodingGivesRecomputesTokens) {
  KESTREL_REQUIRE_FILE(stories_path());
  const Loaded l = load_stories();
  const std::vector<Request> requests = mixed_requests(l);
  EngineConfig c = tight_config();
  const int64_t bytes = test::kv_block_bytes(l, c);
  c.speculative.method = SpecMethod::Ngram;
  c.speculative.num_speculative_tokens = 3;
  EngineConfig roomy = c;
  roomy.n_kv_blocks = 0;
  Engine reference(*l.model, l.tokenizer.get(), roomy);
  const auto unconstrained = test::run_to_end(reference, requests);
  Engine recompute(*l.model, l.tokenizer.get(), c);
  const auto want = test::run_to_end(recompute, requests);
  c.swap_space_bytes = 64 * bytes;
  c.preemption_mode = PreemptionMode::Swap;
  Engine swap(*l.model, l.tokenizer.get(), c);
  const auto got = test::run_to_end(swap, requests);
  EXPECT_GT(swap.stats().n_swap_preemptions, 0);
  EXPECT_GT(swap.stats().spec_num_accepted_tokens, 0);
  for (size_t i = 0; i < requests.size(); ++i) {
    EXPECT_EQ(got[i], want[i]) << "request " << i;
    if (requests[i].sampling.temperature == 0) EXPECT_EQ(got[i], unconstrained[i]) << "request " << i;
  }
  expect_all_free(swap);
}

TEST(EngineSwap, AbortingSwappedOutRequestsFreesTheirHostBlocks) {
  KESTREL_REQUIRE_FILE(stories_path());
  const Loaded l = load_stories();
  EngineConfig c = tight_config();
  c.swap_space_bytes = 64 * test::kv_block_bytes(l, c);
  c.preemption_mode = PreemptionMode::Swap;
  Engine e(*l.model, l.tokenizer.get(), c);
  std::vector<RequestId> ids;
  for (const Request& r : mixed_requests(l)) ids.push_back(e.add_request(r));
  // Step until some request is swapped out right now, then abort every request.
  for (int i = 0; i < 10000 && e.stats().swap_blocks_free == e.stats().n_swap_blocks; ++i) {
    ASSERT_TRUE(e.has_unfinished()) << "nothing was ever swapped out";
    e.step();
  }
  ASSERT_LT(e.stats().swap_blocks_free, e.stats().n_swap_blocks);
  EXPECT_GT(e.stats().n_swapped_out_blocks, e.stats().n_swapped_in_blocks);
  for (RequestId id : ids) e.abort_request(id);
  int n_aborted = 0;
  while (e.has_unfinished())
    for (const RequestOutput& o : e.step()) n_aborted += o.finish_reason == "abort";
  EXPECT_GT(n_aborted, 0);
  expect_all_free(e);
}

TEST(EngineSwap, BadSwapSettingsAreErrors) {
  KESTREL_REQUIRE_FILE(stories_path());
  const Loaded l = load_stories();
  EngineConfig c = tight_config();
  c.swap_space_bytes = -1;
  EXPECT_NE(test::error_of([&] { Engine e(*l.model, l.tokenizer.get(), c); }).find("swap_space"), std::string::npos);
  c.swap_space_bytes = 0;
  c.preemption_mode = PreemptionMode::Swap;
  EXPECT_NE(test::error_of([&] { Engine e(*l.model, l.tokenizer.get(), c); }).find("swap_space > 0"),
            std::string::npos);
}
