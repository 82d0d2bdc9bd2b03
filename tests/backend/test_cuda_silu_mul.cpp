// CUDA SwiGLU and GeGLU (silu(gate) * up, gelu_tanh(gate) * up over the fused gate|up rows) against a
// float64 reference.
// Tolerance: output rounded to bf16: relative L2 error <= 4e-3; extreme gates element by element.
#include "cuda_test_util.h"

namespace kestrel::test {
namespace {

TEST(CudaSiluMul, MatchesFloat64Reference) {
  KESTREL_REQUIRE_CUDA();
  std::mt19937 rng(3);
  // 1536 (SmolLM2's n_ff), 14336 (Llama-3.1-8B's); 172 (stories260K's), 100 and 5 are not whole
  // 16-byte chunks.
  for (const int64_t n_ff : {1536, 14336, 172, 100, 5}) {
    for (const int64_t n_tokens : {1, 5, 64}) {
      SCOPED_TRACE("n_ff " + std::to_string(n_ff) + " n_tokens " + std::to_string(n_tokens));
      const auto gate_up = random_bf16(static_cast<size_t>(n_tokens * 2 * n_ff), rng, -6.0f, 6.0f);
      DeviceBuffer<uint16_t> d_in(gate_up), d_out(static_cast<size_t>(n_tokens * n_ff));
      d_out.poison();
      cuda::silu_mul(d_in.bf16(), d_out.bf16(), n_tokens, n_ff, nullptr);
      const auto out = bf16_to_f32(d_out.download());
      std::vector<double> ref(static_cast<size_t>(n_tokens * n_ff));
      for (int64_t t = 0; t < n_tokens; ++t)
        for (int64_t i = 0; i < n_ff; ++i) {
          const double g = from_bf16(gate_up[static_cast<size_t>(t * 2 * n_ff + i)]);
          const double u = from_bf16(gate_up[static_cast<size_t>(t * 2 * n_ff + n_ff + i)]);
          ref[static_cast<size_t>(t * n_ff + i)] = g / (1.0 + std::exp(-g)) * u;
        }
      EXPECT_LE(rel_error(out, ref), 4e-3);
    }
  }
}

// Gates where e^-g overflows f32 or nears it (silu -> 0, the fast division's range where it
// returns 0) and large positive ones (silu -> g), element by element: within a bf16 rounding
// (2^-8 relative) of g * u / (1 + e^-g), or within 1e-30 of it (0 for the tiny ones is right).
TEST(CudaSiluMul, ExtremeGates) {
  KESTREL_REQUIRE_CUDA();
  const std::vector<float> gates = {-1000.0f, -200.0f, -100.0f, -88.5f, -88.0f, -87.5f, -87.0f, -80.0f,
                                    -20.0f,   20.0f,   40.0f,   100.0f, 1000.0f, 3e4f,   -0.0f,  0.0f};
  const int64_t n_ff = static_cast<int64_t>(gates.size());
  std::vector<uint16_t> gate_up;
  for (float g : gates) gate_up.push_back(to_bf16(g));
  for (int64_t i = 0; i < n_ff; ++i) gate_up.push_back(to_bf16(i % 2 == 0 ? 1.5f : -0.75f));
  DeviceBuffer<uint16_t> d_in(gate_up), d_out(static_cast<size_t>(n_ff));
  d_out.poison();
  cuda::silu_mul(d_in.bf16(), d_out.bf16(), 1, n_ff, nullptr);
  const auto out = bf16_to_f32(d_out.download());
  for (int64_t i = 0; i < n_ff; ++i) {
    const double g = from_bf16(gate_up[static_cast<size_t>(i)]);
    const double u = from_bf16(gate_up[static_cast<size_t>(n_ff + i)]);
    const double want = g / (1.0 + std::exp(-g)) * u;
    const float got = out[static_cast<size_t>(i)];
    SCOPED_TRACE("gate " + std::to_string(g) + " up " + std::to_string(u));
    ASSERT_TRUE(std::isfinite(got));
    EXPECT_LE(std::abs(got - want), std::max(std::abs(want) * 0x1p-8, 1e-30));
  }
}

// GeGLU with GELU's tanh approximation (Gemma's MLP): 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) * u,
// over gates from -12 to 12 (past both saturations of tanh), same tolerance as SwiGLU's.
TEST(CudaGeluTanhMul, MatchesFloat64Reference) {
  KESTREL_REQUIRE_CUDA();
  std::mt19937 rng(5);
  for (const int64_t n_ff : {2048, 172, 5}) {
    for (const int64_t n_tokens : {1, 7}) {
      SCOPED_TRACE("n_ff " + std::to_string(n_ff) + " n_tokens " + std::to_string(n_tokens));
      const auto gate_up = random_bf16(static_cast<size_t>(n_tokens * 2 * n_ff), rng, -12.0f, 12.0f);
      DeviceBuffer<uint16_t> d_in(gate_up), d_out(static_cast<size_t>(n_tokens * n_ff));
      d_out.poison();
      cuda::gelu_tanh_mul(d_in.bf16(), d_out.bf16(), n_tokens, n_ff, nullptr);
      const auto out = bf16_to_f32(d_out.download());
      std::vector<double> ref(static_cast<size_t>(n_tokens * n_ff));
      for (int64_t t = 0; t < n_tokens; ++t)
        for (int64_t i = 0; i < n_ff; ++i) {
          const double g = from_bf16(gate_up[static_cast<size_t>(t * 2 * n_ff + i)]);
          const double u = from_bf16(gate_up[static_cast<size_t>(t * 2 * n_ff + n_ff + i)]);
          const double c = std::sqrt(2.0 / M_PI);
          ref[static_cast<size_t>(t * n_ff + i)] = 0.5 * g * (1.0 + std::tanh(c * (g + 0.044715 * g * g * g))) * u;
        }
      EXPECT_LE(rel_error(out, ref), 4e-3);
    }
  }
}

}  // namespace
}  // namespace kestrel::test
