// CUDA SwiGLU (silu(gate) * up over the fused gate|up rows) against a float64 reference.
// Tolerance: output rounded to bf16: relative L2 error <= 4e-3.
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
      auto gate_up = random_bf16(static_cast<size_t>(n_tokens * 2 * n_ff), rng, -6.0f, 6.0f);
      // Gates where e^-g overflows or nears it (silu -> 0), and large positive ones (silu -> g).
      const float extremes[] = {-200.0f, -100.0f, -88.0f, -87.0f, -80.0f, 40.0f, 100.0f, 3e4f};
      for (size_t e = 0; e < std::size(extremes) && e < static_cast<size_t>(n_ff); ++e)
        gate_up[e * static_cast<size_t>(n_ff) / std::size(extremes)] = to_bf16(extremes[e]);
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

}  // namespace
}  // namespace kestrel::test
