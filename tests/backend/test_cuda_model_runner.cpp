// The whole CUDA backend (model runner: staging, graph-shaped padding, every kernel of a forward
// pass, device sampling) against the CPU backend on stories260K. On a GPU in kestrel_tests; in
// kestrel_cuda_emu_tests on the CPU emulation of the kernels, with the runtime calls emulated and a
// plain-loop GEMM in cuBLASLt's place (src/backend/cuda/emulate_*.cpp), so CI runs it without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "backend/cuda/cuda_runner.h"
#include "core/error.h"
#include "cuda_test_util.h"
#include "engine/engine.h"
#include "test_util.h"
#include "tokenizer/tokenizer.h"

using namespace kestrel;
using test::greedy_ids;

namespace {

std::string stories_path() { return test::data_dir() + "/stories260K/stories260K.gguf"; }

std::unique_ptr<ModelRunner> cuda_runner(const LlamaModel& m, bool eager) {
  RunnerOptions o;
  o.block_size = 16;
  o.n_kv_blocks = 96;
  o.enforce_eager = eager;
  return make_cuda_model_runner(m, o);
}

EngineConfig config() {
  EngineConfig c;
  c.block_size = 16;
  c.n_kv_blocks = 96;
  c.max_model_len = 512;  // stories260K's trained context
  c.max_num_batched_tokens = 24;  // prompts in chunks beside decodes
  c.kv_dtype = KvDtype::F32;      // the CPU side; the CUDA runner's cache is bf16
  return c;
}

}  // namespace

// Prompt logits (every position, the prompt in chunks) within 0.05 + 2% of each row's largest
// magnitude of the CPU backend's f32 ones (the CUDA backend keeps weights, activations and KV in
// bf16), the same argmax wherever the CPU's top two differ by more than 0.1; and the same 32 greedy
// tokens for three prompts decoded together: eagerly, and through the graph path (batches padded
// to the 4-sequence bucket, block tables to 16 columns).
TEST(CudaModelRunner, WholeForwardMatchesTheCpuBackendOnStories260K) {
  if (!test::cuda_unavailable_reason().empty()) GTEST_SKIP() << test::cuda_unavailable_reason();
  KESTREL_REQUIRE_FILE(stories_path());
  const auto model = LlamaModel::load_gguf(stories_path());
  const auto tok = Tokenizer::from_gguf(model->file());
  const std::vector<std::vector<int32_t>> prompts = {
      tok->encode("Once upon a time, there was a little girl named Lily. She", true, false),
      tok->encode("One day, a big dog", true, false), tok->encode("Tim and his mom went to the park", true, false)};
  const int64_t n_vocab = model->hparams().n_vocab;

  Engine cpu(*model, tok.get(), config());
  const auto want = greedy_ids(cpu, prompts, 32);
  const std::vector<float> want_logits = test::prompt_logits(*model, prompts[0], config());

  for (const bool eager : {true, false}) {
    SCOPED_TRACE(eager ? "eager" : "graph path");
    Engine gpu(*model, tok.get(), config(), cuda_runner(*model, eager));
    EXPECT_EQ(greedy_ids(gpu, prompts, 32), want);

    Request r;
    r.prompt = prompts[0];
    r.max_tokens = 1;
    r.sampling.temperature = 0;
    r.prompt_logits = true;
    gpu.add_request(r);
    std::vector<float> got;
    while (gpu.has_unfinished())
      for (RequestOutput& o : gpu.step())
        if (!o.prompt_logits.empty()) got = std::move(o.prompt_logits);
    ASSERT_EQ(got.size(), want_logits.size());
    for (size_t row = 0; row < prompts[0].size(); ++row) {
      const float* g = got.data() + row * n_vocab;
      const float* w = want_logits.data() + row * n_vocab;
      float scale = 0, worst = 0;
      for (int64_t i = 0; i < n_vocab; ++i) {
        scale = std::max(scale, std::fabs(w[i]));
        worst = std::max(worst, std::fabs(g[i] - w[i]));
      }
      EXPECT_LE(worst, 0.05f + 0.02f * scale) << "row " << row;
      std::vector<float> sorted(w, w + n_vocab);
      std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<>());
      if (sorted[0] - sorted[1] > 0.1f)
        EXPECT_EQ(std::max_element(g, g + n_vocab) - g, std::max_element(w, w + n_vocab) - w) << "row " << row;
    }
  }
}

// llama-2-tiny-random has head_dim 4, which the attention kernels do not cover (a multiple of 8
// from 8 to 256): the runner refuses it at start with a message naming head_dim, never computes.
TEST(CudaModelRunner, AHeadDimTheKernelsLackIsRefusedAtStart) {
  if (!test::cuda_unavailable_reason().empty()) GTEST_SKIP() << test::cuda_unavailable_reason();
  const std::string path = test::data_dir() + "/llama-2-tiny-random/llama-2-tiny-random.gguf";
  KESTREL_REQUIRE_FILE(path);
  const auto model = LlamaModel::load_gguf(path);
  ASSERT_EQ(model->hparams().head_dim, 4);
  try {
    cuda_runner(*model, true);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("head_dim 4"), std::string::npos) << e.what();
  }
}
