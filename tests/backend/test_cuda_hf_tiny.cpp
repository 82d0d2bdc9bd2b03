// The CUDA backend on architectures beyond Llama, against the CPU backend (f32 KV cache) and, for
// the tiny Hugging Face folders of ../shared/data/hf-tiny, against transformers' references:
// - mistral-swa-tiny (window 16 in every layer; prompts of 7, 40 and 100 tokens, far past it);
// - a tiny random Gemma 3 (tests/gemma3_tiny.h: QK-norm, post-norms, GeGLU, scaled embedding,
//   window 4 with RoPE base 1e4 in five layers, the sixth global with base 1e6).
// On a GPU in kestrel_tests; on the CPU emulation of the kernels in kestrel_cuda_emu_tests.
//
// Tolerances. The CUDA backend keeps weights, activations and the KV cache in bf16 (the residual
// stream in f32): prompt logits must lie within 0.05 + 2% of each row's largest magnitude of the
// CPU backend's f32 ones (as test_cuda_model_runner.cpp's stories260K check), with the same argmax
// wherever the CPU's top two differ by more than 0.1. Greedy continuations: bf16 activations move
// these models' logits by up to a few hundredths, and the references have steps whose top two
// differ by less (mistral-swa-tiny: 0.0078 at the smallest), so each continuation must equal the
// reference's up to its first differing token, and that token's step must be such a near-tie
// (reference margin below kNearTie); the test prints how many of the three are equal throughout.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "backend/cuda/cuda_runner.h"
#include "core/error.h"
#include "cuda_test_util.h"
#include "engine/engine.h"
#include "gemma3_tiny.h"
#include "hf_tiny_reference.h"
#include "test_util.h"

using namespace kestrel;

namespace {

// Reference margins below this may flip under bf16 activations (see the header comment).
constexpr double kNearTie = 0.05;

// The bounds a run is held to, and how it runs: bf16 weights (the header comment), or FP8 weights
// (--quantization fp8), stated where used.
struct Bounds {
  float abs = 0.05f, rel = 0.02f;  // |cuda - cpu| <= abs + rel * the row's largest magnitude
  double near_tie = kNearTie;      // greedy steps whose reference margin is below may differ
  bool fp8 = false;                // RunnerOptions::quantize_fp8
  int64_t chunk = 24;              // tokens per step (prompt chunks), both engines
  float argmax_margin = 0.1f;      // prompt rows whose CPU top two differ by more keep their argmax
  bool int4 = false;               // the runner must have taken the int4 path (GPTQ / AWQ 4-bit)
};
Bounds g_bounds;  // the running test's
// Sets g_bounds for its scope and puts the defaults back when it ends, also when a missing file
// skips the test midway (a test's bounds must not leak into the next test).
struct BoundsScope {
  explicit BoundsScope(const Bounds& b) { g_bounds = b; }
  ~BoundsScope() { g_bounds = Bounds{}; }
  BoundsScope(const BoundsScope&) = delete;
  BoundsScope& operator=(const BoundsScope&) = delete;
};

EngineConfig cpu_config(const LlamaModel& m) {
  EngineConfig c;
  c.block_size = 4;
  c.n_kv_blocks = 256;
  c.max_model_len = std::min<int64_t>(m.hparams().n_ctx_train, 140);  // the 100-token prompt + 32 tokens
  c.max_num_batched_tokens = g_bounds.chunk;  // prompts in chunks beside decodes
  c.kv_dtype = KvDtype::F32;
  return c;
}

std::unique_ptr<ModelRunner> cuda_runner(const LlamaModel& m, bool eager) {
  RunnerOptions o;
  o.block_size = 4;
  o.n_kv_blocks = 256;
  o.enforce_eager = eager;
  o.quantize_fp8 = g_bounds.fp8;
  test::skip_skinny_gemm_if_emulated(o);
  auto r = make_cuda_model_runner(m, o);
  if (g_bounds.int4) EXPECT_NE(r->description().find("int4 W4A16"), std::string::npos) << r->description();
  return r;
}

double g_worst_rel = 0;  // the largest |cuda - cpu| / row scale seen by expect_logits_close

// The largest |cuda - cpu| over the prompt's logits, checked against the bound row by row.
double expect_logits_close(const std::vector<float>& got, const std::vector<float>& want, int64_t n_vocab) {
  EXPECT_EQ(got.size(), want.size());
  double worst = 0;
  for (size_t row = 0; row * n_vocab < std::min(got.size(), want.size()); ++row) {
    const float* g = got.data() + row * n_vocab;
    const float* w = want.data() + row * n_vocab;
    float scale = 0, row_worst = 0;
    for (int64_t i = 0; i < n_vocab; ++i) {
      scale = std::max(scale, std::fabs(w[i]));
      row_worst = std::max(row_worst, std::fabs(g[i] - w[i]));
    }
    EXPECT_LE(row_worst, g_bounds.abs + g_bounds.rel * scale) << "row " << row;
    g_worst_rel = std::max(g_worst_rel, static_cast<double>(row_worst / scale));
    worst = std::max(worst, static_cast<double>(row_worst));
    std::vector<float> sorted(w, w + n_vocab);
    std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<>());
    if (sorted[0] - sorted[1] > g_bounds.argmax_margin)
      EXPECT_EQ(std::max_element(g, g + n_vocab) - g, std::max_element(w, w + n_vocab) - w) << "row " << row;
  }
  return worst;
}


// Equal up to the first differing token, which must come at a step whose margin is a near-tie.
// Returns whether the whole continuation is equal.
bool expect_equal_up_to_a_near_tie(const std::vector<int32_t>& got, const std::vector<int32_t>& want,
                                   const std::vector<double>& margins, const std::string& name) {
  EXPECT_EQ(got.size(), want.size()) << name;
  const size_t n = std::min(got.size(), want.size());
  for (size_t i = 0; i < n; ++i) {
    if (got[i] == want[i]) continue;
    EXPECT_LT(margins[i], g_bounds.near_tie) << name << ": token " << i << " differs (" << got[i] << " against " << want[i]
                                    << ") at a step whose reference margin is " << margins[i];
    std::printf("  %s: equal for %zu of %zu tokens (then a near-tie of margin %.4f)\n", name.c_str(), i, n,
                margins[i]);
    return false;
  }
  return true;
}

// Top-1 minus top-2 logit of each row of [rows, n_vocab] logits from row `first` on.
std::vector<double> margins_from(const std::vector<float>& logits, int64_t n_vocab, size_t first) {
  std::vector<double> out;
  for (size_t row = first; (row + 1) * n_vocab <= logits.size(); ++row) {
    std::vector<float> r(logits.begin() + row * n_vocab, logits.begin() + (row + 1) * n_vocab);
    std::partial_sort(r.begin(), r.begin() + 2, r.end(), std::greater<>());
    out.push_back(r[0] - r[1]);
  }
  return out;
}

// Runs the prompts on the CPU backend and on the CUDA backend, eagerly and through decode graphs:
// logits within the bound of the CPU's; greedy continuations equal to `want` up to a near-tie.
// Without a reference (want empty) the CPU's greedy continuations are wanted, their margins from
// the CPU's logits over prompt + continuation.
void expect_cuda_matches(const LlamaModel& model, const std::vector<std::vector<int32_t>>& prompts,
                         std::vector<std::vector<int32_t>> want, std::vector<std::vector<double>> margins,
                         const std::vector<std::string>& names) {
  const int64_t n_vocab = model.hparams().n_vocab;
  Engine cpu(model, nullptr, cpu_config(model));
  if (want.empty()) {
    want = test::greedy_ids(cpu, prompts, 32);
    for (size_t i = 0; i < prompts.size(); ++i) {
      std::vector<int32_t> forced = prompts[i];
      forced.insert(forced.end(), want[i].begin(), want[i].end() - 1);
      margins.push_back(margins_from(test::prompt_logits(cpu, forced), n_vocab, prompts[i].size() - 1));
    }
  }
  std::vector<std::vector<float>> cpu_logits;
  for (const auto& p : prompts) cpu_logits.push_back(test::prompt_logits(cpu, p));
  for (const bool eager : {true, false}) {
    SCOPED_TRACE(eager ? "eager" : "graph path");
    Engine gpu(model, nullptr, cpu_config(model), cuda_runner(model, eager));
    const auto got = test::greedy_ids(gpu, prompts, 32);
    int equal = 0;
    for (size_t i = 0; i < prompts.size(); ++i)
      equal += expect_equal_up_to_a_near_tie(got[i], want[i], margins[i], names[i]);
    std::printf("  %s: %d of %zu continuations equal throughout\n", eager ? "eager" : "graphs", equal, prompts.size());
    if (!eager) continue;  // prompts are prefills, never graphed: the eager run covers their logits
    double worst = 0;
    for (size_t i = 0; i < prompts.size(); ++i)
      worst = std::max(worst, expect_logits_close(test::prompt_logits(gpu, prompts[i]), cpu_logits[i], n_vocab));
    std::printf("  worst |cuda - cpu| prompt logit %.4f (%.4f of its row's largest magnitude)\n", worst, g_worst_rel);
  }
}

void expect_cuda_matches_reference(const std::string& folder) {
  const auto model = LlamaModel::load_hf_dir(folder);
  const auto ref = test::read_reference(folder);
  std::vector<std::vector<int32_t>> prompts, want;
  std::vector<std::vector<double>> margins;
  std::vector<std::string> names;
  for (const auto& p : ref) {
    prompts.push_back(p.ids);
    want.push_back(p.greedy);
    margins.push_back(p.greedy_margins);
    names.push_back(p.name);
  }
  expect_cuda_matches(*model, prompts, want, margins, names);
}

}  // namespace

TEST(CudaHfTiny, MistralSlidingWindowMatchesTransformers) {
  if (!test::cuda_unavailable_reason().empty()) GTEST_SKIP() << test::cuda_unavailable_reason();
  const std::string folder = test::data_dir() + "/hf-tiny/mistral-swa-tiny";
  KESTREL_REQUIRE_FILE(folder + "/reference.json");
  expect_cuda_matches_reference(folder);
}

// No transformers reference for the random tiny Gemma 3: the CPU backend's greedy tokens are the
// reference (it matches transformers on Gemma 3 270M, tests/e2e/test_gemma3_270m.cpp).
TEST(CudaGemma3, TinyModelMatchesTheCpuBackend) {
  if (!test::cuda_unavailable_reason().empty()) GTEST_SKIP() << test::cuda_unavailable_reason();
  namespace g = test::gemma3_tiny;
  test::TempDir dir;
  const auto model = LlamaModel::load_hf_dir(g::write_hf(dir, g::random_tensors(), g::hf_config()));
  const std::vector<std::vector<int32_t>> prompts = {
      {2, 7, 19, 3, 44, 12, 12, 30, 5, 21, 9, 40}, {1, 2, 3}, {33, 8, 8, 8, 41, 17, 2, 29, 0, 11, 48, 6, 25, 3, 19, 4}};
  expect_cuda_matches(*model, prompts, {}, {}, {"p0", "p1", "p2"});
}

// Quantized 4-bit checkpoints (GPTQ, AWQ; int4 on the device, int4_ops.h) against transformers,
// whose references use the exactly dequantized float32 weights: the bf16 bounds. In prompt chunks
// of 24 tokens every projection takes the W4A16 skinny GEMM (exact weights, f32 sums); in chunks
// of 128 the prompts take the dequantized weight and cuBLASLt (the bf16 upload's values).
TEST(CudaHfTiny, GptqAndAwqCheckpointsMatchTransformers) {
  if (!test::cuda_unavailable_reason().empty()) GTEST_SKIP() << test::cuda_unavailable_reason();
  for (const int64_t chunk : {24, 128})
    for (const char* name : {"llama-awq-tiny", "llama-gptq-actorder-tiny", "llama-gptq-tiny"}) {
      SCOPED_TRACE(std::string(name) + " chunk " + std::to_string(chunk));
      Bounds b;
      b.int4 = true;
      b.chunk = chunk;
      const BoundsScope scope(b);
      const std::string folder = test::data_dir() + "/hf-tiny/" + name;
      KESTREL_REQUIRE_FILE(folder + "/reference.json");
      expect_cuda_matches_reference(folder);
    }
}

// FP8 checkpoints run in FP8: the per-channel folder's codes and scales uploaded as stored, the
// 128 x 128 block folder dequantized and requantized per output channel. In prompt chunks of at
// most 16 tokens every pass takes the FP8 skinny GEMM (W8A16: E4M3 weights widened exactly, bf16
// activations), so the per-channel folder runs transformers' weights exactly and is held to the
// bf16 bounds (measured worst 0.078, 2.2% of its row's largest magnitude); the requantized block
// folder's weights move by up to 2^-4 relative each (measured worst 6.9% of a row's largest
// magnitude: bound 0.05 + 9%, the argmax kept where the top two differ by more than 0.4, greedy
// steps of reference margin below 0.2 may differ: 0.1425 measured). The W8A8 path of longer chunks (E4M3 activations) is checked in test_cuda_fp8.cpp and
// test_cuda_model_runner.cpp.
TEST(CudaHfTiny, Fp8CheckpointsRunInFp8) {
  if (!test::cuda_unavailable_reason().empty()) GTEST_SKIP() << test::cuda_unavailable_reason();
  for (const auto& [name, bounds] : {std::pair{"llama-fp8-tiny", Bounds{0.05f, 0.02f, kNearTie, true, 16}},
                                     std::pair{"llama-fp8-block-tiny", Bounds{0.05f, 0.09f, 0.2, true, 16, 0.4f}}}) {
    SCOPED_TRACE(name);
    const BoundsScope scope(bounds);
    g_worst_rel = 0;
    const std::string folder = test::data_dir() + "/hf-tiny/" + name;
    KESTREL_REQUIRE_FILE(folder + "/reference.json");
    expect_cuda_matches_reference(folder);
  }
}
