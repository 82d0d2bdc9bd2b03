// The CPU forward pass over flat batches: a token's logits do not depend on how its prompt was
// chunked, on which physical blocks hold its KV, or on what other sequences share the batch (with
// an f32, f16 or int8 KV cache).
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>

#include "backend/cpu/cpu_model_runner.h"
#include "engine/engine.h"
#include "test_util.h"

using namespace kestrel;

namespace {
const std::vector<int32_t> kPrompt = {1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421,
                                      395, 317, 426, 338, 401, 396, 267, 337};  // stories260K ids
}  // namespace

TEST(Forward, PrefillChunkingDoesNotChangeLogits) {
  const std::string path = test::data_dir() + "/stories260K/stories260K.gguf";
  KESTREL_REQUIRE_FILE(path);
  auto model = LlamaModel::load_gguf(path);
  std::vector<float> reference;
  for (int64_t chunk : {256, 1, 3, 7}) {
    EngineConfig c;
    c.max_num_batched_tokens = chunk;
    c.block_size = 4;
    const auto logits = test::prompt_logits(*model, kPrompt, c);
    ASSERT_EQ(logits.size(), kPrompt.size() * 512);
    if (reference.empty()) reference = logits;
    else EXPECT_EQ(logits, reference) << "chunk " << chunk;  // bitwise
  }
}

TEST(Forward, MixedBatchOverScatteredBlocksMatchesSeparateRuns) {
  const std::string path = test::data_dir() + "/stories260K/stories260K.gguf";
  KESTREL_REQUIRE_FILE(path);
  auto model = LlamaModel::load_gguf(path);
  const int64_t n_vocab = model->hparams().n_vocab;
  // Separate runs: logits of every position of two prompts.
  const std::vector<int32_t> a(kPrompt.begin(), kPrompt.begin() + 13);
  const std::vector<int32_t> b = {1, 291, 280, 294, 262, 294, 353, 265, 284};
  for (KvDtype dtype : {KvDtype::F32, KvDtype::F16, KvDtype::INT8}) {
  SCOPED_TRACE(kv_dtype_name(dtype));
  EngineConfig c;
  c.block_size = 4;
  c.kv_dtype = dtype;
  const auto ref_a = test::prompt_logits(*model, a, c);
  const auto ref_b = test::prompt_logits(*model, b, c);

  // One KV cache, blocks handed out in a shuffled order; one batch holds a's first 9 tokens and b's
  // first 5, the next batch a's remaining 4 tokens (a chunk) and b's next 4 (decode-like rows).
  ThreadPool pool(2);
  KvCache kv(model->hparams().n_layer, model->hparams().n_head_kv, model->hparams().head_dim, 4, 16, dtype);
  cpu::CpuModelRunner runner(*model, kv, pool);
  std::vector<int32_t> blocks(16);
  std::iota(blocks.begin(), blocks.end(), 0);
  std::shuffle(blocks.begin(), blocks.end(), std::mt19937(7));
  const int max_blocks = 4;
  std::vector<int32_t> tables(blocks.begin(), blocks.begin() + 2 * max_blocks);  // [2, 4]
  auto slot = [&](int seq, int pos) {
    return static_cast<int64_t>(tables[seq * max_blocks + pos / 4]) * 4 + pos % 4;
  };
  auto run = [&](int a0, int a1, int b0, int b1) {
    std::vector<int32_t> ids, pos, rows;
    std::vector<int64_t> slots;
    for (int p = a0; p < a1; ++p) ids.push_back(a[p]), pos.push_back(p), slots.push_back(slot(0, p));
    for (int p = b0; p < b1; ++p) ids.push_back(b[p]), pos.push_back(p), slots.push_back(slot(1, p));
    for (int r = 0; r < static_cast<int>(ids.size()); ++r) rows.push_back(r);
    const std::vector<int32_t> qs = {0, a1 - a0, a1 - a0 + b1 - b0};
    const std::vector<int32_t> ctx = {a1, b1};
    ForwardBatch fb;
    fb.token_ids = ids;
    fb.positions = pos;
    fb.slot_mapping = slots;
    fb.query_start = qs;
    fb.context_lens = ctx;
    fb.block_tables = tables;
    fb.max_blocks_per_seq = max_blocks;
    fb.logits_indices = rows;
    const auto out = runner.forward(fb);
    for (int r = 0; r < static_cast<int>(ids.size()); ++r) {
      const bool in_a = r < a1 - a0;
      const int p = in_a ? a0 + r : b0 + (r - (a1 - a0));
      const auto& ref = in_a ? ref_a : ref_b;
      for (int64_t v = 0; v < n_vocab; ++v)
        ASSERT_EQ(out[r * n_vocab + v], ref[p * n_vocab + v]) << "seq " << (in_a ? "a" : "b") << " pos " << p;
    }
  };
  run(0, 9, 0, 5);
  run(9, 13, 5, 9);
  }
}

TEST(Forward, InconsistentBatchIsAnError) {
  const std::string path = test::data_dir() + "/stories260K/stories260K.gguf";
  KESTREL_REQUIRE_FILE(path);
  auto model = LlamaModel::load_gguf(path);
  ThreadPool pool(1);
  KvCache kv(model->hparams().n_layer, model->hparams().n_head_kv, model->hparams().head_dim, 4, 2);
  cpu::CpuModelRunner runner(*model, kv, pool);
  const std::vector<int32_t> table = {0, 1}, qs = {0, 1}, ctx = {1}, rows = {0}, pos = {0};
  const std::vector<int64_t> slots = {0};
  ForwardBatch fb;
  fb.positions = pos;
  fb.slot_mapping = slots;
  fb.query_start = qs;
  fb.context_lens = ctx;
  fb.block_tables = table;
  fb.max_blocks_per_seq = 2;
  fb.logits_indices = rows;
  const std::vector<int32_t> bad_token = {512};
  fb.token_ids = bad_token;
  EXPECT_THROW(runner.forward(fb), Error);
  const std::vector<int32_t> ok_token = {5};
  fb.token_ids = ok_token;
  const std::vector<int64_t> bad_slot = {8};
  fb.slot_mapping = bad_slot;
  EXPECT_THROW(runner.forward(fb), Error);
  fb.slot_mapping = slots;
  EXPECT_NO_THROW(runner.forward(fb));
}
