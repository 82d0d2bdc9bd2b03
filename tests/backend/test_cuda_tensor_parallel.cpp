// Tensor parallelism on the CUDA backend (make_tensor_parallel_cuda_runner): stories260K (8 query
// heads over 4 KV heads, FFN 172, vocabulary 512) over 2 and 4 ranks, and mistral-swa-tiny (4 query
// heads over 2 KV heads, sliding window 16) over 2 and 4 ranks (at 4 each KV head is replicated on
// the two ranks whose query heads read it), against the same runner on one rank. On GPUs in
// kestrel_tests (rank r on GPU r, NCCL; skipped with fewer GPUs than ranks); in
// kestrel_cuda_emu_tests on the CPU emulation, every rank on its one device with the in-process
// communicator.
//
// A split changes the roundings, not the arithmetic: each rank's output and down projections sum
// their slice of the input columns in f32 and round the partial row to bf16, and the all-reduce
// adds the ranks' bf16 rows in f32 and rounds once more, where one rank rounds the whole sum once.
// So a row differs from the one-rank row by about a bf16 rounding of the block outputs, carried
// through the layers. Bound: each logits row within kBound of its largest magnitude (the relative
// part of the bf16 CUDA-against-f32 CPU bound in test_cuda_model_runner.cpp); a wrong slice, a
// missing all-reduce or another rank's embedding rows move the logits by O(1). Measured on the
// emulation: at most 0.0175 (mistral-swa-tiny, 2 ranks), 0.0163 (stories260K). The greedy tokens
// of the trained stories260K are asserted equal; the worst difference is printed.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "backend/cuda/cuda_runner.h"
#include "core/error.h"
#include "cuda_test_util.h"
#include "parallel_test_util.h"
#include "engine/engine.h"
#include "test_util.h"
#include "tokenizer/tokenizer.h"

using namespace kestrel;

namespace {

constexpr double kBound = 0.02;

RunnerOptions options(int tp, bool eager) {
  RunnerOptions o;
  o.block_size = 16;
  o.n_kv_blocks = 96;
  o.enforce_eager = eager;
  o.tensor_parallel_size = tp;
  o.cuda.gemm_tune = false;  // cuBLASLt's heuristic pick per shape, not a timing that may differ per runner
  test::skip_skinny_gemm_if_emulated(o);
  return o;
}

// Rank r on device r on GPUs; every rank on the one emulated device.
std::vector<int> devices(int tp) {
  std::vector<int> d;
  for (int r = 0; r < tp; ++r) d.push_back(test::kCudaEmulated ? 0 : r);
  return d;
}

// Why `tp` ranks cannot run here ("" when they can).
std::string ranks_unavailable(int tp) {
  if (!test::cuda_unavailable_reason().empty()) return test::cuda_unavailable_reason();
  if (!test::kCudaEmulated && cuda_device_count() < tp)
    return std::to_string(tp) + " ranks need " + std::to_string(tp) + " GPUs; " + std::to_string(cuda_device_count()) +
           " visible";
  return "";
}

std::unique_ptr<ModelRunner> runner(const LlamaModel& m, int tp, bool eager) {
  if (tp == 1) return make_cuda_model_runner(m, options(1, eager));
  return make_tensor_parallel_cuda_runner(m, options(tp, eager), devices(tp));
}

::testing::AssertionResult close_logits(const std::vector<float>& got, const std::vector<float>& want, int64_t width,
                                        const std::string& what) {
  if (got.size() != want.size()) return ::testing::AssertionFailure() << what << ": sizes differ";
  const double worst = test::worst_row_relative(got, want, width);
  std::printf("%s: worst difference %.3g of the row's largest magnitude\n", what.c_str(), worst);
  if (worst <= kBound) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": worst difference " << worst << " of the row's largest magnitude";
}

// Prompt logits of `long_prompt` (one pass, 5-token chunks and one token a step eagerly; one token
// a step through the graph path) on `tps` ranks against one; with `prompts`, their greedy
// continuations decoded together too.
void expect_close_to_one_rank(const LlamaModel& model, const Tokenizer* tok, const std::vector<int>& tps,
                              const std::vector<int32_t>& long_prompt,
                              const std::vector<std::vector<int32_t>>& prompts) {
  const int64_t V = model.hparams().n_vocab;
  for (const bool eager : {true, false}) {
    for (const int64_t chunk : eager ? std::vector<int64_t>{512, 5, 1} : std::vector<int64_t>{1}) {
      Engine one(model, tok, test::parallel_engine_config(chunk), runner(model, 1, eager));
      const std::vector<float> want = test::prompt_logits(one, long_prompt);
      for (const int tp : tps) {
        Engine split(model, tok, test::parallel_engine_config(chunk), runner(model, tp, eager));
        EXPECT_TRUE(close_logits(test::prompt_logits(split, long_prompt), want, V,
                                 "tp " + std::to_string(tp) + ", " + std::to_string(chunk) + "-token steps, " +
                                     (eager ? "eager" : "graph path")));
      }
    }
    if (prompts.empty()) continue;
    Engine one(model, tok, test::parallel_engine_config(64), runner(model, 1, eager));
    const auto want = test::greedy_ids(one, prompts, 24);
    for (const int tp : tps) {
      Engine split(model, tok, test::parallel_engine_config(64), runner(model, tp, eager));
      EXPECT_EQ(test::greedy_ids(split, prompts, 24), want) << "tp " << tp << (eager ? " eager" : " graph path");
    }
  }
}

std::vector<int> runnable(std::initializer_list<int> tps) {
  std::vector<int> out;
  for (int tp : tps)
    if (ranks_unavailable(tp).empty()) out.push_back(tp);
  return out;
}

}  // namespace

TEST(CudaTensorParallel, Stories260KCloseToOneRank) {
  if (!ranks_unavailable(2).empty()) GTEST_SKIP() << ranks_unavailable(2);
  KESTREL_REQUIRE_FILE(test::stories_path());
  const auto model = LlamaModel::load_gguf(test::stories_path());
  ASSERT_EQ(model->hparams().n_head, 8);
  ASSERT_EQ(model->hparams().n_head_kv, 4);
  const auto tok = Tokenizer::from_gguf(model->file());
  std::vector<std::vector<int32_t>> prompts;
  for (size_t i = 0; i < 5; ++i) prompts.push_back(tok->encode(test::story_prompts()[i * 5], true, false));
  const std::vector<int32_t> long_prompt = tok->encode(
      "Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her dog",
      true, false);
  expect_close_to_one_rank(*model, tok.get(), runnable({2, 4}), long_prompt, prompts);
}

TEST(CudaTensorParallel, MistralSlidingWindowCloseToOneRank) {
  if (!ranks_unavailable(2).empty()) GTEST_SKIP() << ranks_unavailable(2);
  const std::string folder = test::data_dir() + "/hf-tiny/mistral-swa-tiny";
  KESTREL_REQUIRE_FILE(folder + "/config.json");
  const auto model = LlamaModel::load_hf_dir(folder);
  ASSERT_EQ(model->hparams().n_head_kv, 2);
  // 34 tokens, past the window of 16, so the window's edge moves through the cache during the
  // steps. Logits only: the random weights leave near ties among the top tokens (greedy
  // continuations part at a rounding; measured on the emulation), which the trained stories260K
  // above does not have.
  std::vector<int32_t> prompt = {1};
  for (int i = 1; i < 34; ++i) prompt.push_back(3 + (i * 104729) % 31000);
  expect_close_to_one_rank(*model, nullptr, runnable({2, 4}), prompt, {});
}

// A hand-made step of four sequences (two prefills, two decodes over cached context) with the
// logits rows in an order other than the tokens', straight to the runners; the pool's sizes; a
// block's K/V record (the ranks' records in rank order) written into another split runner
// continues there as in the runner it came from.
TEST(CudaTensorParallel, MixedStepAndKvRecord) {
  if (!ranks_unavailable(2).empty()) GTEST_SKIP() << ranks_unavailable(2);
  KESTREL_REQUIRE_FILE(test::stories_path());
  const auto model = LlamaModel::load_gguf(test::stories_path());
  const int64_t V = model->hparams().n_vocab;
  const int32_t bs = 16, per_seq = 4;
  const std::vector<int32_t> cached = {0, 0, 9, 21}, fresh = {7, 12, 1, 1};
  std::vector<std::vector<int32_t>> prompts(4);
  for (size_t s = 0; s < 4; ++s)
    for (int32_t i = 0; i < 23; ++i) prompts[s].push_back(i == 0 ? 1 : 3 + static_cast<int32_t>((s * 131 + i * 37) % (V - 3)));
  std::vector<int32_t> tables(4 * per_seq);
  for (size_t i = 0; i < tables.size(); ++i) tables[i] = static_cast<int32_t>(i);
  auto step = [&](ModelRunner& r, const std::vector<int32_t>& from, const std::vector<int32_t>& to) {
    return test::forward_token_ranges(r, prompts, tables, per_seq, bs, from, to);
  };
  std::vector<int32_t> zero(4, 0), end(4), next(4);
  for (int s = 0; s < 4; ++s) end[s] = cached[s] + fresh[s], next[s] = end[s] + 1;
  const auto one = runner(*model, 1, true);
  step(*one, zero, cached);
  const std::vector<float> want = step(*one, cached, end);
  for (const int tp : runnable({2, 4})) {
    const auto split = runner(*model, tp, true);
    EXPECT_EQ(split->n_kv_blocks(), one->n_kv_blocks());
    EXPECT_EQ(split->kv_bytes_per_token(), one->kv_bytes_per_token());  // 4 KV heads: none replicated
    EXPECT_FALSE(split->samples_on_device());
    EXPECT_NE(split->description().find("tensor parallel " + std::to_string(tp)), std::string::npos);
    step(*split, zero, cached);
    EXPECT_TRUE(close_logits(step(*split, cached, end), want, V, "mixed step, tp " + std::to_string(tp)));
    const size_t record = tables.size() * bs * static_cast<size_t>(split->kv_bytes_per_token());
    std::vector<std::byte> kv(record);
    split->read_kv_blocks(tables, kv);
    const auto other = runner(*model, tp, true);
    other->write_kv_blocks(tables, kv);
    EXPECT_EQ(step(*other, end, next), step(*split, end, next)) << "tp " << tp;
  }
}

// Placements that cannot work are refused with the flag's name.
TEST(CudaTensorParallel, BadPlacementsAreErrors) {
  if (!test::cuda_unavailable_reason().empty()) GTEST_SKIP() << test::cuda_unavailable_reason();
  KESTREL_REQUIRE_FILE(test::stories_path());
  const auto model = LlamaModel::load_gguf(test::stories_path());
  const std::vector<int> far = {0, 1000}, three = {0, 0, 0};
  EXPECT_TRUE(test::error_contains([&] { make_tensor_parallel_cuda_runner(*model, options(2, true), far); },
                        "--tensor-parallel-size 2 needs 2 GPUs (rank 1 on device 1000)"));
  EXPECT_TRUE(test::error_contains([&] { make_tensor_parallel_cuda_runner(*model, options(2, true), three); },
                        "--tensor-parallel-size 2: 3 devices for 2 ranks"));
  EXPECT_TRUE(test::error_contains([&] { make_tensor_parallel_cuda_runner(*model, options(3, true), three); },
                        "does not divide the model's attention heads (8)"));
  RunnerOptions both = options(2, true);
  both.pipeline_parallel_size = 2;
  EXPECT_TRUE(test::error_contains([&] { make_tensor_parallel_cuda_runner(*model, both, devices(2)); }, "one way at a time"));
  if (!test::kCudaEmulated) {
    const std::vector<int> same = {0, 0};
    EXPECT_TRUE(test::error_contains([&] { make_tensor_parallel_cuda_runner(*model, options(2, true), same); },
                          "one rank per GPU"));
  }
}
