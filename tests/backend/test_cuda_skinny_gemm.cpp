// CUDA skinny GEMM (decode-step projections) against a float64 reference, every kernel variant and
// token-tile size, with row and k tails; and its SwiGLU input against silu_mul + the plain GEMM.
// Tolerances: bf16 output, one rounding of an f32 sum: relative L2 error <= 4e-3 (half a bf16 ulp
// is 2^-9 = 2e-3 relative); f32 output: 1e-5 (f32 accumulation over at most 4096 products, whose
// relative error grows like sqrt(n_in) * 2^-24 ~ 4e-6).
#include "cuda_test_util.h"

namespace kestrel::test {
namespace {

struct Case {
  int64_t n_tokens, n_in, n_out;
};

// The variants skinny_gemm builds per token tile: {unroll, warps}; {0, 0} is the default.
std::vector<std::pair<int, int>> variants(int64_t n_tokens) {
  if (n_tokens <= 8) return {{0, 0}, {4, 4}, {2, 8}, {2, 4}, {8, 8}, {8, 4}};
  if (n_tokens <= 16) return {{0, 0}, {2, 8}};
  if (n_tokens <= 32) return {{0, 0}, {1, 8}};
  return {{0, 0}};
}

TEST(CudaSkinnyGemm, MatchesFloat64ReferenceForEveryVariant) {
  KESTREL_REQUIRE_CUDA();
  std::mt19937 rng(11);
  // 576 -> 960: SmolLM2's fused QKV; 40 and 8: k tails shorter than one k-step; 17 and 1 rows:
  // a partial 16-row tile; token counts on both sides of each 8-token tile edge.
  std::vector<Case> cases = {{1, 576, 960}, {3, 40, 17}, {8, 8, 1}, {9, 264, 33}, {16, 576, 48},
                             {17, 136, 20}, {32, 64, 16}, {33, 200, 31}, {64, 576, 40}};
  if (!kCudaEmulated) {
    cases.push_back({1, 4096, 6144});
    cases.push_back({7, 14336, 4096});
    cases.push_back({64, 4096, 1000});
  }
  for (const Case& c : cases) {
    for (const bool f32_out : {false, true}) {
      for (const auto& [unroll, warps] : variants(c.n_tokens)) {
        SCOPED_TRACE("tokens " + std::to_string(c.n_tokens) + " n_in " + std::to_string(c.n_in) + " n_out " +
                     std::to_string(c.n_out) + (f32_out ? " f32" : " bf16") + " unroll " + std::to_string(unroll) +
                     " warps " + std::to_string(warps));
        const int64_t x_stride = c.n_in + 8;  // rows not packed: the stride is honoured
        const auto x = random_bf16(static_cast<size_t>(c.n_tokens * x_stride), rng);
        const auto w = random_bf16(static_cast<size_t>(c.n_out * c.n_in), rng);
        DeviceBuffer<uint16_t> d_x(x), d_w(w);
        const size_t n_y = static_cast<size_t>(c.n_tokens * c.n_out);
        std::vector<float> out;
        cuda::SkinnyGemmArgs a{};
        a.x = d_x.bf16();
        a.x_stride = x_stride;
        a.w = d_w.bf16();
        a.n_tokens = c.n_tokens;
        a.n_in = c.n_in;
        a.n_out = c.n_out;
        a.f32_out = f32_out;
        a.unroll = unroll;
        a.warps = warps;
        out = run_to_f32(n_y, f32_out, [&](void* y) {
          a.y = y;
          cuda::skinny_gemm(a, nullptr);
        });
        EXPECT_LE(rel_error(out, gemv_reference(x, x_stride, w, c.n_tokens, c.n_in, c.n_out)), f32_out ? 1e-5 : 4e-3);
      }
    }
  }
}

TEST(CudaSkinnyGemm, SwigluInputIsBitIdenticalToSiluMulThenGemm) {
  KESTREL_REQUIRE_CUDA();
  std::mt19937 rng(12);
  std::vector<Case> cases = {{1, 192, 40}, {5, 72, 17}, {12, 64, 16}, {30, 40, 9}, {40, 32, 20}};
  if (!kCudaEmulated) cases.push_back({1, 14336, 4096});
  for (const Case& c : cases) {
    SCOPED_TRACE("tokens " + std::to_string(c.n_tokens) + " n_ff " + std::to_string(c.n_in));
    const auto gate_up = random_bf16(static_cast<size_t>(c.n_tokens * 2 * c.n_in), rng, -6.0f, 6.0f);
    const auto w = random_bf16(static_cast<size_t>(c.n_out * c.n_in), rng);
    DeviceBuffer<uint16_t> d_gu(gate_up), d_w(w), d_act(static_cast<size_t>(c.n_tokens * c.n_in));
    DeviceBuffer<uint16_t> d_fused(static_cast<size_t>(c.n_tokens * c.n_out)),
        d_plain(static_cast<size_t>(c.n_tokens * c.n_out));
    d_fused.poison();
    d_plain.poison();
    cuda::silu_mul(d_gu.bf16(), d_act.bf16(), c.n_tokens, c.n_in, nullptr);
    cuda::SkinnyGemmArgs a{};
    a.x = d_act.bf16();
    a.x_stride = c.n_in;
    a.w = d_w.bf16();
    a.y = d_plain.get();
    a.n_tokens = c.n_tokens;
    a.n_in = c.n_in;
    a.n_out = c.n_out;
    cuda::skinny_gemm(a, nullptr);
    a.x = d_gu.bf16();
    a.x_stride = 2 * c.n_in;
    a.swiglu = true;
    a.y = d_fused.get();
    cuda::skinny_gemm(a, nullptr);
    EXPECT_EQ(d_fused.download(), d_plain.download());
  }
}

TEST(CudaSkinnyGemm, RejectsWhatItCannotRun) {
  KESTREL_REQUIRE_CUDA();
  EXPECT_FALSE(cuda::skinny_gemm_supports(0, 64, 16));
  EXPECT_FALSE(cuda::skinny_gemm_supports(cuda::kSkinnyMaxTokens + 1, 64, 16));
  EXPECT_FALSE(cuda::skinny_gemm_supports(1, 60, 16));  // n_in not a multiple of 8
  EXPECT_TRUE(cuda::skinny_gemm_supports(cuda::kSkinnyMaxTokens, 64, 1));
  DeviceBuffer<uint16_t> d(64 * 16);
  cuda::SkinnyGemmArgs a{};
  a.x = d.bf16();
  a.w = d.bf16();
  a.y = d.get();
  a.n_tokens = 1;
  a.n_in = 64;
  a.n_out = 16;
  a.x_stride = 60;  // shorter than a row
  EXPECT_THROW(cuda::skinny_gemm(a, nullptr), Error);
  a.x_stride = 64;
  a.unroll = 3;  // no such variant
  EXPECT_THROW(cuda::skinny_gemm(a, nullptr), Error);
}

}  // namespace
}  // namespace kestrel::test
