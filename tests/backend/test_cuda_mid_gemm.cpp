// CUDA mid GEMM (decode projections at 9-64 tokens) against a float64 reference, each token-tile
// size, with row tails (partial 64-row blocks), k tails (n_in not a multiple of the 128-wide
// chunk), split-K counts from 1 to past the chunk count; its SwiGLU input bit for bit against
// silu_mul followed by the plain kernel. Tolerances as skinny_gemm's test: bf16 output, one
// rounding of an f32 sum: relative L2 error <= 4e-3 (half a bf16 ulp is 2^-9 = 2e-3 relative); f32
// output: 1e-5 (f32 accumulation over at most 14336 products, in a different order from the
// reference: sqrt(n_in) x 2^-24 ~ 7e-6).
#include "cuda_test_util.h"

namespace kestrel::test {
namespace {

struct Case {
  int64_t n_tokens, n_in, n_out;
  int splits;  // 0: mid_gemm's own choice
};

std::vector<double> reference(const std::vector<uint16_t>& x, int64_t x_stride, const std::vector<uint16_t>& w,
                              const Case& c) {
  std::vector<double> ref(static_cast<size_t>(c.n_tokens * c.n_out));
  for (int64_t t = 0; t < c.n_tokens; ++t)
    for (int64_t o = 0; o < c.n_out; ++o) {
      double s = 0.0;
      for (int64_t k = 0; k < c.n_in; ++k)
        s += static_cast<double>(from_bf16(x[static_cast<size_t>(t * x_stride + k)])) *
             from_bf16(w[static_cast<size_t>(o * c.n_in + k)]);
      ref[static_cast<size_t>(t * c.n_out + o)] = s;
    }
  return ref;
}

// Runs mid_gemm on device copies; returns y as f32.
std::vector<float> run_mid(const std::vector<uint16_t>& x, int64_t x_stride, const std::vector<uint16_t>& w,
                           const Case& c, bool f32_out, bool swiglu) {
  DeviceBuffer<uint16_t> d_x(x), d_w(w);
  const size_t n_y = static_cast<size_t>(c.n_tokens * c.n_out);
  const size_t ws = cuda::mid_gemm_workspace_bytes(c.n_tokens, c.n_in, c.n_out, c.splits);
  DeviceBuffer<float> d_ws(std::max<size_t>(ws / sizeof(float), 1));
  d_ws.poison();
  cuda::MidGemmArgs a{};
  a.x = d_x.bf16();
  a.x_stride = x_stride;
  a.w = d_w.bf16();
  a.n_tokens = c.n_tokens;
  a.n_in = c.n_in;
  a.n_out = c.n_out;
  a.f32_out = f32_out;
  a.swiglu = swiglu;
  a.splits = c.splits;
  a.workspace = d_ws.get();
  a.workspace_bytes = ws;
  if (f32_out) {
    DeviceBuffer<float> d_y(n_y);
    d_y.poison();
    a.y = d_y.get();
    cuda::mid_gemm(a, nullptr);
    return d_y.download();
  }
  DeviceBuffer<uint16_t> d_y(n_y);
  d_y.poison();
  a.y = d_y.get();
  cuda::mid_gemm(a, nullptr);
  return bf16_to_f32(d_y.download());
}

TEST(CudaMidGemm, MatchesFloat64Reference) {
  KESTREL_REQUIRE_CUDA();
  std::mt19937 rng(21);
  // Token counts on both sides of the 16 / 32 tile edges; 40 and 200: k tails inside one chunk;
  // 33 and 65 rows: partial 64-row blocks; splits 1, 2, 3 and 7 (more than the 2 chunks of 200,
  // so it is cut to 2).
  std::vector<Case> cases = {{9, 264, 33, 1},  {16, 576, 65, 2}, {17, 40, 20, 0},  {24, 384, 130, 3},
                             {32, 200, 64, 7}, {33, 512, 31, 4}, {64, 576, 40, 0}, {64, 136, 128, 1}};
  if (!kCudaEmulated) {
    cases.push_back({64, 4096, 6144, 0});
    cases.push_back({64, 4096, 4096, 0});
    cases.push_back({48, 14336, 4096, 0});
    cases.push_back({12, 4096, 28672, 0});
  }
  for (const Case& c : cases) {
    for (const bool f32_out : {false, true}) {
      SCOPED_TRACE("tokens " + std::to_string(c.n_tokens) + " n_in " + std::to_string(c.n_in) + " n_out " +
                   std::to_string(c.n_out) + " splits " + std::to_string(c.splits) + (f32_out ? " f32" : " bf16"));
      const int64_t x_stride = c.n_in + 8;  // rows not packed: the stride is honoured
      const auto x = random_bf16(static_cast<size_t>(c.n_tokens * x_stride), rng);
      const auto w = random_bf16(static_cast<size_t>(c.n_out * c.n_in), rng);
      EXPECT_LE(rel_error(run_mid(x, x_stride, w, c, f32_out, false), reference(x, x_stride, w, c)),
                f32_out ? 1e-5 : 4e-3);
    }
  }
}

TEST(CudaMidGemm, SplitCountsAreWholeChunks) {
  KESTREL_REQUIRE_CUDA();
  EXPECT_EQ(cuda::mid_gemm_splits(200, 64, 7), 2);     // 2 chunks of 128: at most 2 splits
  EXPECT_EQ(cuda::mid_gemm_splits(4096, 4096, 3), 3);  // 32 chunks: 11 + 11 + 10
  EXPECT_EQ(cuda::mid_gemm_splits(4096, 4096, 5), 5);  // 7 x 4 + 4 chunks
  EXPECT_EQ(cuda::mid_gemm_splits(1024, 64, 6), 4);    // 8 chunks: 2 per split leaves 4 splits
  EXPECT_EQ(cuda::mid_gemm_workspace_bytes(64, 4096, 4096, 1), 0u);
  EXPECT_EQ(cuda::mid_gemm_workspace_bytes(64, 4096, 4096, 4), size_t{4} * 64 * 4096 * 4);
}

TEST(CudaMidGemm, SwigluInputIsBitIdenticalToSiluMulThenGemm) {
  KESTREL_REQUIRE_CUDA();
  std::mt19937 rng(22);
  std::vector<Case> cases = {{9, 192, 40, 1}, {20, 72, 17, 0}, {40, 256, 70, 2}, {64, 136, 9, 0}};
  if (!kCudaEmulated) cases.push_back({64, 14336, 4096, 0});
  for (const Case& c : cases) {
    SCOPED_TRACE("tokens " + std::to_string(c.n_tokens) + " n_ff " + std::to_string(c.n_in));
    const auto gate_up = random_bf16(static_cast<size_t>(c.n_tokens * 2 * c.n_in), rng, -6.0f, 6.0f);
    const auto w = random_bf16(static_cast<size_t>(c.n_out * c.n_in), rng);
    DeviceBuffer<uint16_t> d_gu(gate_up), d_act(static_cast<size_t>(c.n_tokens * c.n_in));
    cuda::silu_mul(d_gu.bf16(), d_act.bf16(), c.n_tokens, c.n_in, nullptr);
    const std::vector<uint16_t> act = d_act.download();
    EXPECT_EQ(run_mid(gate_up, 2 * c.n_in, w, c, false, true), run_mid(act, c.n_in, w, c, false, false));
  }
}

TEST(CudaMidGemm, RejectsWhatItCannotRun) {
  KESTREL_REQUIRE_CUDA();
  EXPECT_FALSE(cuda::mid_gemm_supports(0, 64, 16));
  EXPECT_FALSE(cuda::mid_gemm_supports(cuda::kMidGemmMaxTokens + 1, 64, 16));
  EXPECT_FALSE(cuda::mid_gemm_supports(16, 60, 16));  // n_in not a multiple of 8
  EXPECT_TRUE(cuda::mid_gemm_supports(cuda::kMidGemmMaxTokens, 64, 1));
  DeviceBuffer<uint16_t> d(64 * 256);
  cuda::MidGemmArgs a{};
  a.x = d.bf16();
  a.w = d.bf16();
  a.y = d.get();
  a.n_tokens = 16;
  a.n_in = 256;
  a.n_out = 16;
  a.x_stride = 200;  // shorter than a row
  EXPECT_THROW(cuda::mid_gemm(a, nullptr), Error);
  a.x_stride = 256;
  a.splits = 2;  // needs a workspace
  EXPECT_THROW(cuda::mid_gemm(a, nullptr), Error);
}

}  // namespace
}  // namespace kestrel::test
