// The engine on a model whose every layer is windowed (mistral-swa-tiny: window 16): KV blocks
// wholly before the window are released after each step, so a sequence longer than the whole KV
// pool runs, and its tokens still equal transformers' greedy continuation.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "engine/engine.h"
#include "hf_tiny_reference.h"
#include "test_util.h"

namespace kestrel {
namespace {

std::string folder() { return test::data_dir() + "/hf-tiny/mistral-swa-tiny"; }

// Blocks of 4 and 16 tokens a step: one sequence holds at most ceil((16 + 16) / 4) + 1 = 9
// blocks; the pool has 12 (48 positions).
EngineConfig small_pool() {
  EngineConfig c;
  c.kv_dtype = KvDtype::F32;
  c.block_size = 4;
  c.n_kv_blocks = 12;
  c.max_num_batched_tokens = 16;
  c.max_model_len = 256;
  c.n_threads = 1;
  return c;
}

// The 100-token prompt and 32 tokens (132 positions, 33 blocks) in a pool of 12 blocks.
TEST(EngineWindow, MistralSwaRunsInAPoolSmallerThanTheSequence) {
  KESTREL_REQUIRE_FILE(folder() + "/reference.json");
  const auto model = LlamaModel::load_hf_dir(folder());
  ASSERT_EQ(model->hparams().kv_lookback(), 16);
  const std::vector<test::ReferencePrompt> refs = test::read_reference(folder());
  ASSERT_EQ(refs.size(), 3u);
  const test::ReferencePrompt& p = refs[2];
  ASSERT_EQ(p.ids.size(), 100u);
  ASSERT_GT(p.ids.size() + p.greedy.size(), 12u * 4u);

  Engine engine(*model, nullptr, small_pool());
  Request r;
  r.prompt = p.ids;
  r.max_tokens = 32;
  r.sampling.temperature = 0;
  engine.add_request(r);
  std::vector<int32_t> got;
  std::vector<int32_t> free_in_decode;  // free blocks after each decode step
  while (engine.has_unfinished()) {
    for (const RequestOutput& o : engine.step()) {
      ASSERT_NE(o.finish_reason, "error") << o.error;
      got.insert(got.end(), o.new_token_ids.begin(), o.new_token_ids.end());
    }
    if (got.size() >= 2) free_in_decode.push_back(engine.stats().kv_blocks_free);
  }
  EXPECT_EQ(got, p.greedy);
  EXPECT_EQ(engine.stats().n_preemptions, 0);
  EXPECT_LE(engine.stats().peak_kv_blocks_used, 9);
  // A decode step that crosses into a new block releases the oldest one: free blocks come back
  // (without releasing they only fall, one every 4 tokens, and 12 blocks would run out at 48).
  int n_rises = 0;
  for (size_t i = 1; i < free_in_decode.size(); ++i) n_rises += free_in_decode[i] > free_in_decode[i - 1];
  EXPECT_GE(n_rises, 6);
  EXPECT_EQ(engine.stats().kv_blocks_used, 0);
}

// All three prompts at once in the same small pool: sequences are preempted and recomputed (their
// released blocks found again in the prefix cache or computed anew), and every continuation
// still equals the reference.
TEST(EngineWindow, MistralSwaThreePromptsShareASmallPool) {
  KESTREL_REQUIRE_FILE(folder() + "/reference.json");
  const auto model = LlamaModel::load_hf_dir(folder());
  const std::vector<test::ReferencePrompt> refs = test::read_reference(folder());
  Engine engine(*model, nullptr, small_pool());
  std::vector<std::vector<int32_t>> prompts;
  for (const test::ReferencePrompt& p : refs) prompts.push_back(p.ids);
  const auto got = test::greedy_ids(engine, prompts, 32);
  for (size_t i = 0; i < refs.size(); ++i) EXPECT_EQ(got[i], refs[i].greedy) << refs[i].name;
  EXPECT_EQ(engine.stats().kv_blocks_used, 0);
}

// The pool must still hold one sequence's window plus a step's tokens: the error names both.
TEST(EngineWindow, PoolSmallerThanTheWindowAndAStepIsAnError) {
  KESTREL_REQUIRE_FILE(folder() + "/config.json");
  const auto model = LlamaModel::load_hf_dir(folder());
  EngineConfig c = small_pool();
  c.max_num_batched_tokens = 64;  // ceil(80 / 4) + 1 = 21 blocks
  const std::string e = test::error_of([&] { Engine engine(*model, nullptr, c); });
  EXPECT_NE(e.find("cannot hold one sequence's sliding window of 16 tokens plus a step of max_num_batched_tokens 64"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("needs 21 blocks"), std::string::npos) << e;
}

}  // namespace
}  // namespace kestrel
