// CUDA fused residual add + RMSNorm against a float64 reference.
// Tolerances: the residual is f32 (one f32 rounding of an exact sum): relative L2 error <= 1e-6;
// the normalised output is rounded to bf16 (relative error <= 2^-9 per element): <= 4e-3. And
// add_residual (the residual add alone) exactly.
#include "cuda_test_util.h"

namespace kestrel::test {
namespace {

TEST(CudaAddRmsNorm, MatchesFloat64Reference) {
  KESTREL_REQUIRE_CUDA();
  std::mt19937 rng(2);
  const float eps = 1e-5f;
  // 576 (SmolLM2), 4096 (Llama-3.1-8B), 8192 and 9000 (two and four chunks per thread), 64
  // (stories260K: 8 chunks, one warp); 100 and 3 are not whole 16-byte chunks (scalar kernel).
  for (const int64_t dim : {576, 4096, 8192, 9000, 64, 100, 3}) {
    for (const int64_t n_tokens : {1, 7, 33}) {
      for (const bool with_add : {true, false}) {
        SCOPED_TRACE("dim " + std::to_string(dim) + " n_tokens " + std::to_string(n_tokens) +
                     (with_add ? " with add" : " without add"));
        const size_t n = static_cast<size_t>(n_tokens * dim);
        const auto residual = random_f32(n, rng, -2.0f, 2.0f);
        const auto add = random_bf16(n, rng);
        const auto weight = random_bf16(static_cast<size_t>(dim), rng, 0.5f, 1.5f);
        DeviceBuffer<float> d_res(residual);
        DeviceBuffer<uint16_t> d_add(add), d_w(weight), d_out(n);
        d_out.poison();
        cuda::add_rms_norm(d_res.get(), with_add ? d_add.bf16() : nullptr, d_w.bf16(), d_out.bf16(), n_tokens, dim,
                           eps, nullptr);
        const auto out = bf16_to_f32(d_out.download());
        const auto res_out = d_res.download();
        std::vector<double> ref_res(n), ref_out(n);
        for (int64_t t = 0; t < n_tokens; ++t) {
          double ss = 0.0;
          for (int64_t i = 0; i < dim; ++i) {
            const size_t j = static_cast<size_t>(t * dim + i);
            ref_res[j] = static_cast<double>(residual[j]) + (with_add ? static_cast<double>(from_bf16(add[j])) : 0.0);
            ss += ref_res[j] * ref_res[j];
          }
          const double inv = 1.0 / std::sqrt(ss / static_cast<double>(dim) + eps);
          for (int64_t i = 0; i < dim; ++i) {
            const size_t j = static_cast<size_t>(t * dim + i);
            ref_out[j] = ref_res[j] * inv * from_bf16(weight[static_cast<size_t>(i)]);
          }
        }
        EXPECT_LE(rel_error(res_out, ref_res), 1e-6);
        EXPECT_LE(rel_error(out, ref_out), 4e-3);
      }
    }
  }
}

// The residual stream a pipeline stage hands on: out = residual + add, each element the f32
// rounding of the exact float64 sum (a sum of an f32 and a bf16 value), so equal to it exactly,
// and equal to the residual add_rms_norm leaves (the next stage's first norm then sees the
// one-stage values). Without add: a copy.
TEST(CudaAddRmsNorm, AddResidualIsTheRoundedExactSum) {
  KESTREL_REQUIRE_CUDA();
  std::mt19937 rng(3);
  for (const int64_t dim : {64, 100, 4096}) {
    for (const int64_t n_tokens : {1, 5, 300}) {
      SCOPED_TRACE("dim " + std::to_string(dim) + " n_tokens " + std::to_string(n_tokens));
      const size_t n = static_cast<size_t>(n_tokens * dim);
      const auto residual = random_f32(n, rng, -2.0f, 2.0f);
      const auto add = random_bf16(n, rng);
      const auto weight = random_bf16(static_cast<size_t>(dim), rng, 0.5f, 1.5f);
      DeviceBuffer<float> d_res(residual), d_out(n), d_copy(n);
      DeviceBuffer<uint16_t> d_add(add), d_w(weight), d_norm(n);
      cuda::add_residual(d_res.get(), d_add.bf16(), d_out.get(), n_tokens, dim, nullptr);
      cuda::add_residual(d_res.get(), nullptr, d_copy.get(), n_tokens, dim, nullptr);
      cuda::add_rms_norm(d_res.get(), d_add.bf16(), d_w.bf16(), d_norm.bf16(), n_tokens, dim, 1e-5f, nullptr);
      const auto out = d_out.download(), copy = d_copy.download(), fused = d_res.download();
      for (size_t j = 0; j < n; ++j) {
        const float want = static_cast<float>(static_cast<double>(residual[j]) + static_cast<double>(from_bf16(add[j])));
        ASSERT_EQ(out[j], want) << "element " << j;
        ASSERT_EQ(fused[j], want) << "element " << j;
        ASSERT_EQ(copy[j], residual[j]) << "element " << j;
      }
    }
  }
}

}  // namespace
}  // namespace kestrel::test
