// The device generator of --load-format dummy weights (fill_random.cu) against the host's
// (core/random_fill.h): equal bit for bit, for the 16-byte path and the element path, from any
// first element, leaving the bytes around the range alone.
#include "backend/cuda/fill_ops.h"
#include "core/random_fill.h"
#include "cuda_test_util.h"

namespace kestrel::test {
namespace {

TEST(CudaFillRandom, EqualsTheHostGeneratorBitForBit) {
  KESTREL_REQUIRE_CUDA();
  const RandomFill f{random_fill_key(0, "model.layers.0.mlp.up_proj.weight", 33), 0.125f / kRandomFillLevels};
  // Whole 16-byte chunks from a first element at a group of four (vector path); odd sizes, a
  // misaligned start or a first element inside a group (element path).
  const int64_t big = kCudaEmulated ? 4096 : 1 << 22;
  for (const int64_t n : {int64_t{8}, int64_t{1}, int64_t{7}, int64_t{1000}, big + 3, big}) {
    for (const int64_t at : {0, 1}) {
      for (const uint64_t first : {uint64_t{0}, uint64_t{12344}, uint64_t{12345}}) {
        SCOPED_TRACE("n " + std::to_string(n) + " at " + std::to_string(at) + " first " + std::to_string(first));
        DeviceBuffer<uint16_t> d(static_cast<size_t>(n + 2));
        d.poison();
        cuda::fill_random_bf16(d.bf16() + at, n, first, f, nullptr);
        const std::vector<uint16_t> got = d.download();
        for (int64_t i = 0; i < at; ++i) EXPECT_EQ(got[static_cast<size_t>(i)], 0xFFFF);
        for (int64_t i = 0; i < n; ++i)
          ASSERT_EQ(got[static_cast<size_t>(at + i)], random_fill_bf16(f, first + static_cast<uint64_t>(i))) << i;
        for (int64_t i = at + n; i < n + 2; ++i) EXPECT_EQ(got[static_cast<size_t>(i)], 0xFFFF);
      }
    }
  }
}

// The values are those of the stated distribution: uniform in [-a, a), a = step * 2^15.
TEST(CudaFillRandom, UniformInTheStatedRange) {
  KESTREL_REQUIRE_CUDA();
  const RandomFill f{random_fill_key(7, "w", 1), 0.5f / kRandomFillLevels};
  const int64_t n = 1 << 16;
  DeviceBuffer<uint16_t> d(static_cast<size_t>(n));
  cuda::fill_random_bf16(d.bf16(), n, 0, f, nullptr);
  double sum = 0, sum2 = 0;
  for (uint16_t h : d.download()) {
    const double x = from_bf16(h);
    ASSERT_LE(std::abs(x), 0.5);
    sum += x;
    sum2 += x * x;
  }
  EXPECT_NEAR(sum / n, 0.0, 4 * 0.5 / std::sqrt(3.0 * n));
  EXPECT_NEAR(sum2 / n, 0.25 / 3, 0.01);
}

}  // namespace
}  // namespace kestrel::test
