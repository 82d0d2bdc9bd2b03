// cuBLASLt GEMM wrapper (y = x . W^T, W row-major [n_out, n_in]) against a float64 reference.
// Tolerances (relative L2): f32 output 1e-4 (bf16 operands are exact in both; only the f32
// accumulation order differs, ~sqrt(n_in) * 2^-24); bf16 output 4e-3 (one rounding to bf16).
// Not in the CPU emulation (cuBLASLt needs a GPU), nor in a build without cuBLASLt.
#if !defined(KESTREL_CUDA_EMULATE) && !defined(KESTREL_CUDA_NO_GEMM)

#include "backend/cuda/gemm.h"
#include "cuda_test_util.h"

namespace kestrel::test {
namespace {

TEST(CudaGemm, MatchesFloat64Reference) {
  KESTREL_REQUIRE_CUDA();
  std::mt19937 rng(8);
  struct Case {
    int64_t n_tokens, n_in, n_out;
    cuda::GemmOutput out;
  };
  const Case cases[] = {
      {1, 576, 576, cuda::GemmOutput::Bf16},      // SmolLM2 decode, q projection
      {7, 576, 3072, cuda::GemmOutput::Bf16},     // SmolLM2 gate|up, odd n_tokens
      {33, 4096, 1024, cuda::GemmOutput::Bf16},   // Llama-3.1-8B k/v projection
      {128, 1024, 4096, cuda::GemmOutput::F32},
      {5, 64, 49152, cuda::GemmOutput::F32},      // logits-like: wide n_out
      {257, 2048, 520, cuda::GemmOutput::Bf16},   // n_out not a multiple of 16
      // stories260K (n_embd 64, kv_dim 32, n_ff 172): rows of 344 and 172 elements, not whole
      // 16-byte chunks (the operands' bases stay 16-byte aligned).
      {7, 64, 32, cuda::GemmOutput::Bf16},        // k/v projection
      {7, 64, 344, cuda::GemmOutput::Bf16},       // gate|up
      {7, 172, 64, cuda::GemmOutput::Bf16},       // down: n_in 172
      {3, 64, 512, cuda::GemmOutput::F32},        // logits
      {1, 576, 576, cuda::GemmOutput::Bf16},      // a shape already cached
  };
  cuda::Gemm gemm;
  for (const Case& c : cases) {
    const bool f32 = c.out == cuda::GemmOutput::F32;
    SCOPED_TRACE("n_tokens " + std::to_string(c.n_tokens) + " n_in " + std::to_string(c.n_in) + " n_out " +
                 std::to_string(c.n_out) + (f32 ? " f32" : " bf16"));
    const auto x = random_bf16(static_cast<size_t>(c.n_tokens * c.n_in), rng);
    const auto w = random_bf16(static_cast<size_t>(c.n_out * c.n_in), rng);
    DeviceBuffer<uint16_t> d_x(x), d_w(w);
    const size_t n_y = static_cast<size_t>(c.n_tokens * c.n_out);
    DeviceBuffer<float> d_y32(f32 ? n_y : 0);
    DeviceBuffer<uint16_t> d_y16(f32 ? 0 : n_y);
    d_y32.poison();
    d_y16.poison();
    void* y = f32 ? static_cast<void*>(d_y32.get()) : static_cast<void*>(d_y16.get());
    gemm.run(d_x.bf16(), d_w.bf16(), y, c.out, c.n_tokens, c.n_in, c.n_out, nullptr);
    const std::vector<float> out = f32 ? d_y32.download() : bf16_to_f32(d_y16.download());
    std::vector<double> ref(n_y);
    std::vector<double> xr(static_cast<size_t>(c.n_in));
    for (int64_t t = 0; t < c.n_tokens; ++t) {
      for (int64_t k = 0; k < c.n_in; ++k) xr[static_cast<size_t>(k)] = from_bf16(x[static_cast<size_t>(t * c.n_in + k)]);
      for (int64_t o = 0; o < c.n_out; ++o) {
        const uint16_t* wr = w.data() + o * c.n_in;
        double s = 0.0;
        for (int64_t k = 0; k < c.n_in; ++k) s += xr[static_cast<size_t>(k)] * from_bf16(wr[k]);
        ref[static_cast<size_t>(t * c.n_out + o)] = s;
      }
    }
    EXPECT_LE(rel_error(out, ref), f32 ? 1e-4 : 4e-3);
  }
  EXPECT_EQ(gemm.cached_shapes(), 10u);  // the distinct shapes above
}

TEST(CudaGemm, RejectsBadArguments) {
  KESTREL_REQUIRE_CUDA();
  cuda::Gemm gemm(0);
  DeviceBuffer<uint16_t> d(64);
  EXPECT_THROW(gemm.run(d.bf16(), d.bf16(), d.get(), cuda::GemmOutput::Bf16, 0, 8, 8, nullptr), Error);
  EXPECT_THROW(gemm.run(d.bf16() + 1, d.bf16(), d.get(), cuda::GemmOutput::Bf16, 1, 8, 8, nullptr), Error);
}

}  // namespace
}  // namespace kestrel::test

#endif  // !KESTREL_CUDA_EMULATE && !KESTREL_CUDA_NO_GEMM
