// CUDA in-place RMSNorm of heads (rms_norm_heads: Gemma 3's QK-norm over the q or k heads of fused
// QKV rows, and its post-attention / post-FFN norms over whole rows) against a float64 reference:
// x / sqrt(mean(x^2) + eps) * w per head. Tolerance: the output is rounded to bf16 once (2^-9
// relative per element): relative L2 error <= 4e-3. Values outside the normed heads (the v heads
// of a QKV row) must be left bit for bit.
#include <string>

#include "cuda_test_util.h"

namespace kestrel::test {
namespace {

struct NormCase {
  const char* name;
  int64_t n_rows, row_stride, offset, n_heads, dim;
};

TEST(CudaRmsNormHeads, MatchesFloat64Reference) {
  KESTREL_REQUIRE_CUDA();
  std::mt19937 rng(9);
  const float eps = 1e-6f;
  // Gemma 3 270M: 4 q heads and 1 k head of 256 in rows of 4*256 + 2*256, n_embd 640; a dim over
  // 1024 (the register part plus the re-read tail); odd sizes.
  const NormCase cases[] = {
      {"q heads of Gemma 3 270M QKV rows", 5, 1536, 0, 4, 256},
      {"k head of Gemma 3 270M QKV rows", 5, 1536, 1024, 1, 256},
      {"post-norm over rows of 640", 3, 640, 0, 1, 640},
      {"rows of 1500 (longer than the registers)", 2, 1500, 0, 1, 1500},
      {"odd: 3 heads of 13 in rows of 45", 7, 45, 2, 3, 13},
  };
  for (const NormCase& c : cases) {
    SCOPED_TRACE(c.name);
    const auto x = random_bf16(static_cast<size_t>(c.n_rows * c.row_stride), rng, -4.0f, 4.0f);
    const auto w = random_bf16(static_cast<size_t>(c.dim), rng, 0.5f, 2.0f);
    DeviceBuffer<uint16_t> d_x(x), d_w(w);
    cuda::rms_norm_heads(d_x.bf16() + c.offset, c.n_rows, c.row_stride, c.n_heads, c.dim, d_w.bf16(), eps, nullptr);
    const auto got_bits = d_x.download();
    const auto got = bf16_to_f32(got_bits);
    std::vector<float> got_normed;
    std::vector<double> ref;
    for (int64_t r = 0; r < c.n_rows; ++r)
      for (int64_t h = 0; h < c.n_heads; ++h) {
        const int64_t at = r * c.row_stride + c.offset + h * c.dim;
        double ss = 0.0;
        for (int64_t i = 0; i < c.dim; ++i) ss += std::pow(from_bf16(x[static_cast<size_t>(at + i)]), 2);
        const double inv = 1.0 / std::sqrt(ss / static_cast<double>(c.dim) + eps);
        for (int64_t i = 0; i < c.dim; ++i) {
          ref.push_back(from_bf16(x[static_cast<size_t>(at + i)]) * inv * from_bf16(w[static_cast<size_t>(i)]));
          got_normed.push_back(got[static_cast<size_t>(at + i)]);
        }
      }
    EXPECT_LE(rel_error(got_normed, ref), 4e-3);
    // Everything outside the heads is untouched.
    for (int64_t r = 0; r < c.n_rows; ++r)
      for (int64_t i = 0; i < c.row_stride; ++i) {
        const bool in_heads = i >= c.offset && i < c.offset + c.n_heads * c.dim;
        if (!in_heads) ASSERT_EQ(got_bits[static_cast<size_t>(r * c.row_stride + i)], x[static_cast<size_t>(r * c.row_stride + i)]);
      }
  }
}

TEST(CudaRmsNormHeads, RejectsHeadsWiderThanTheRow) {
  EXPECT_THROW(cuda::rms_norm_heads(nullptr, 1, 100, 2, 64, nullptr, 1e-6f, nullptr), Error);
  EXPECT_THROW(cuda::rms_norm_heads(nullptr, 1, 100, 1, 0, nullptr, 1e-6f, nullptr), Error);
}

}  // namespace
}  // namespace kestrel::test
