// Pipeline parallelism on the CUDA backend (make_pipeline_parallel_cuda_runner): stories260K's 5
// layers over 2 stages (3 + 2) and 3 stages (2 + 2 + 1), every stage on device 0 (the machine the
// tests run on has one GPU; the stages still have their own weights, KV caches, streams and
// graphs, and hand the residual stream on by the peer-copy path), against the same runner in one
// stage. On a GPU in kestrel_tests; in kestrel_cuda_emu_tests on the CPU emulation.
//
// A stage runs its layers with the one-stage arithmetic (the residual stream is handed on in f32
// as it is, and the add of the last block's output is the one add_rms_norm makes). What a
// micro-batch changes is the shape of each kernel call: on the CPU emulation every kernel and the
// plain-loop GEMM compute a token's row the same way whatever the other rows, so logits, K/V and
// tokens are asserted equal bit for bit there. On a GPU cuBLASLt picks its algorithm per problem
// shape (a micro-batch is a smaller M than its step), so a row's sums may run in another order and
// round differently in bf16: there each logits row is asserted within 2% of its largest magnitude
// of the one-stage row (the relative part of the bf16 CUDA-against-f32 CPU bound in
// test_cuda_model_runner.cpp), the greedy tokens equal; the worst difference is printed.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
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

RunnerOptions options(int pp, bool eager) {
  RunnerOptions o;
  o.block_size = 16;
  o.n_kv_blocks = 96;
  o.enforce_eager = eager;
  o.pipeline_parallel_size = pp;
  o.cuda.gemm_tune = false;  // cuBLASLt's heuristic pick per shape, not a timing that may differ per runner
  test::skip_skinny_gemm_if_emulated(o);
  return o;
}

std::unique_ptr<ModelRunner> runner(const LlamaModel& m, int pp, bool eager) {
  if (pp == 1) return make_cuda_model_runner(m, options(1, eager));
  const std::vector<int> devices(static_cast<size_t>(pp), 0);
  return make_pipeline_parallel_cuda_runner(m, options(pp, eager), devices);
}

// Bit for bit on the emulation; within kGpuBound of each row's largest magnitude on a GPU.
constexpr double kGpuBound = 0.02;
::testing::AssertionResult same_logits(const std::vector<float>& got, const std::vector<float>& want, int64_t width,
                                       const std::string& what) {
  if (got.size() != want.size()) return ::testing::AssertionFailure() << what << ": sizes differ";
  const double worst = test::worst_row_relative(got, want, width);
  if (!test::kCudaEmulated) std::printf("%s: worst difference %.3g of the row's largest magnitude\n", what.c_str(), worst);
  if (test::kCudaEmulated ? worst == 0.0 : worst <= kGpuBound) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": worst difference " << worst << " of the row's largest magnitude";
}

}  // namespace

// One sequence's prompt logits (one pass split into token ranges over the stages; 5-token chunks;
// one token a step) and greedy continuations of five prompts decoded together (micro-batches of
// whole sequences; decode steps through the graph path), eagerly and through the graph path.
TEST(CudaPipelineParallel, Stories260KEqualsOneStage) {
  if (!test::cuda_unavailable_reason().empty()) GTEST_SKIP() << test::cuda_unavailable_reason();
  KESTREL_REQUIRE_FILE(test::stories_path());
  const auto model = LlamaModel::load_gguf(test::stories_path());
  ASSERT_EQ(model->hparams().n_layer, 5);
  const auto tok = Tokenizer::from_gguf(model->file());
  std::vector<std::vector<int32_t>> prompts;
  for (size_t i = 0; i < 5; ++i) prompts.push_back(tok->encode(test::story_prompts()[i * 5], true, false));
  const std::vector<int32_t> long_prompt = tok->encode(
      "Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her dog",
      true, false);
  const int64_t V = model->hparams().n_vocab;
  for (const bool eager : {true, false}) {
    // Prompt chunks run eagerly either way; one-token steps take the graph path unless eager.
    for (const int64_t chunk : eager ? std::vector<int64_t>{512, 5, 1} : std::vector<int64_t>{1}) {
      Engine one(*model, tok.get(), test::parallel_engine_config(chunk), runner(*model, 1, eager));
      const std::vector<float> want = test::prompt_logits(one, long_prompt);
      for (const int pp : {2, 3}) {
        Engine split(*model, tok.get(), test::parallel_engine_config(chunk), runner(*model, pp, eager));
        const std::vector<float> got = test::prompt_logits(split, long_prompt);
        EXPECT_TRUE(same_logits(got, want, V, "pp " + std::to_string(pp) + ", " + std::to_string(chunk) +
                                                  "-token steps, " + (eager ? "eager" : "graph path")));
      }
    }
    Engine one(*model, tok.get(), test::parallel_engine_config(64), runner(*model, 1, eager));
    const auto want = test::greedy_ids(one, prompts, 24);
    for (const int pp : {2, 3}) {
      Engine split(*model, tok.get(), test::parallel_engine_config(64), runner(*model, pp, eager));
      EXPECT_EQ(test::greedy_ids(split, prompts, 24), want) << "pp " << pp << (eager ? " eager" : " graph path");
    }
  }
}

// A hand-made step of four sequences (two prefills, two decodes over cached context) with the
// logits rows in an order other than the tokens', straight to the runners: the rows come back in
// the batch's order; the stages' K/V records (bf16: per layer K and V), concatenated in stage
// order, are the one-stage record (on a GPU: each bf16 value within kGpuBound of the block's
// largest magnitude).
TEST(CudaPipelineParallel, MixedStepRowsAndKvRecordEqualOneStage) {
  if (!test::cuda_unavailable_reason().empty()) GTEST_SKIP() << test::cuda_unavailable_reason();
  KESTREL_REQUIRE_FILE(test::stories_path());
  const auto model = LlamaModel::load_gguf(test::stories_path());
  const int64_t V = model->hparams().n_vocab;
  const int32_t bs = 16, per_seq = 4;
  const std::vector<int32_t> cached = {0, 0, 9, 21}, fresh = {7, 12, 1, 1};
  std::vector<std::vector<int32_t>> prompts(4);
  for (size_t s = 0; s < 4; ++s)
    for (int32_t i = 0; i < 22; ++i) prompts[s].push_back(i == 0 ? 1 : 3 + static_cast<int32_t>((s * 131 + i * 37) % (V - 3)));
  std::vector<int32_t> tables(4 * per_seq);
  for (size_t i = 0; i < tables.size(); ++i) tables[i] = static_cast<int32_t>(i);
  auto step = [&](ModelRunner& r, const std::vector<int32_t>& from, const std::vector<int32_t>& to) {
    return test::forward_token_ranges(r, prompts, tables, per_seq, bs, from, to);
  };
  std::vector<int32_t> zero(4, 0), end(4);
  for (int s = 0; s < 4; ++s) end[s] = cached[s] + fresh[s];
  const auto one = runner(*model, 1, true);
  const size_t record = tables.size() * bs * static_cast<size_t>(one->kv_bytes_per_token());
  const std::vector<std::byte> zeros(record);
  one->write_kv_blocks(tables, zeros);
  step(*one, zero, cached);
  const std::vector<float> want = step(*one, cached, end);
  std::vector<std::byte> want_kv(record);
  one->read_kv_blocks(tables, want_kv);
  for (const int pp : {2, 3}) {
    const auto split = runner(*model, pp, true);
    EXPECT_EQ(split->n_kv_blocks(), one->n_kv_blocks());
    EXPECT_EQ(split->kv_bytes_per_token(), one->kv_bytes_per_token());
    EXPECT_NE(split->description().find("pipeline parallel " + std::to_string(pp)), std::string::npos);
    split->write_kv_blocks(tables, zeros);
    step(*split, zero, cached);
    EXPECT_TRUE(same_logits(step(*split, cached, end), want, V, "mixed step, pp " + std::to_string(pp)));
    std::vector<std::byte> kv(record);
    split->read_kv_blocks(tables, kv);
    if (test::kCudaEmulated) {
      EXPECT_TRUE(kv == want_kv) << "pp " << pp;
    } else {
      std::vector<float> a(record / 2), b(record / 2);
      for (size_t i = 0; i < a.size(); ++i) {
        uint16_t x, y;
        std::memcpy(&x, kv.data() + 2 * i, 2);
        std::memcpy(&y, want_kv.data() + 2 * i, 2);
        a[i] = test::from_bf16(x), b[i] = test::from_bf16(y);
      }
      const int64_t per_block = bs * one->kv_bytes_per_token() / 2;
      EXPECT_TRUE(same_logits(a, b, per_block, "K/V record, pp " + std::to_string(pp)));
    }
    // The one-stage record written back into the stages reads back the same.
    split->write_kv_blocks(tables, want_kv);
    split->read_kv_blocks(tables, kv);
    EXPECT_TRUE(kv == want_kv) << "pp " << pp;
  }
}

// Stages on devices that are not there, or a device list of another length, are refused with
// the flag's name; so are a model the stages cannot split and tensor parallelism beside.
TEST(CudaPipelineParallel, BadPlacementsAreErrors) {
  if (!test::cuda_unavailable_reason().empty()) GTEST_SKIP() << test::cuda_unavailable_reason();
  KESTREL_REQUIRE_FILE(test::stories_path());
  const auto model = LlamaModel::load_gguf(test::stories_path());
  const std::vector<int> far = {0, 1000}, three = {0, 0, 0};
  EXPECT_TRUE(test::error_contains([&] { make_pipeline_parallel_cuda_runner(*model, options(2, true), far); },
                              "--pipeline-parallel-size 2 needs 2 GPUs (stage 1 on device 1000)"));
  EXPECT_TRUE(test::error_contains([&] { make_pipeline_parallel_cuda_runner(*model, options(2, true), three); },
                              "3 devices for 2 stages"));
  EXPECT_TRUE(test::error_contains([&] { make_pipeline_parallel_cuda_runner(*model, options(6, true), three); },
                              "exceeds the model's layers (5)"));
  RunnerOptions both = options(2, true);
  both.tensor_parallel_size = 2;
  EXPECT_TRUE(test::error_contains([&] { make_cuda_model_runner(*model, both); }, "one way at a time"));
}
