// The quantizers of model/load_quantize.h against float64 references written here: RTN INT4
// codes, f16 scales and zero points exactly, each dequantized weight within s / 2 of the input;
// FP8 rows as max |x| / 448 scales and nearest-even E4M3 codes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "core/fp8.h"
#include "model/load_quantize.h"

namespace kestrel {
namespace {

// The value of an f16 bit pattern (IEEE 754 binary16), decoded from its fields.
double f16_value(uint16_t h) {
  const int e = (h >> 10) & 0x1F, m = h & 0x3FF;
  const double mag = e == 0 ? std::ldexp(m, -24) : std::ldexp(1.0 + m / 1024.0, e - 15);
  return (h & 0x8000) ? -mag : mag;
}

// The smallest finite f16 >= x >= 0, by search over the positive patterns (which increase with their values).
uint16_t f16_ceil(double x) {
  uint16_t lo = 0, hi = 0x7BFF;
  while (lo < hi) {
    const uint16_t mid = static_cast<uint16_t>((lo + hi) / 2);
    if (f16_value(mid) >= x) hi = mid;
    else lo = static_cast<uint16_t>(mid + 1);
  }
  return lo;
}

struct Case {
  int64_t n_out, n_in;
  std::vector<float> w;
};

// Rows of different character: uniform around 0, all positive, all negative, all zero, one large
// outlier, values of 1e-5 (f16 subnormal scales), widths that leave a short last group.
std::vector<Case> cases() {
  std::mt19937 rng(11);
  std::vector<Case> out;
  for (const auto& [n_out, n_in] : std::vector<std::pair<int64_t, int64_t>>{{8, 256}, {6, 200}, {3, 64}}) {
    Case c{n_out, n_in, std::vector<float>(static_cast<size_t>(n_out * n_in))};
    for (int64_t r = 0; r < n_out; ++r) {
      float* x = c.w.data() + r * n_in;
      std::uniform_real_distribution<float> u(-0.2f, 0.2f);
      for (int64_t k = 0; k < n_in; ++k) {
        const float v = u(rng);
        switch (r % 6) {
          case 0: x[k] = v; break;
          case 1: x[k] = std::fabs(v) + 0.01f; break;
          case 2: x[k] = -std::fabs(v) - 0.3f; break;
          case 3: x[k] = 0.0f; break;
          case 4: x[k] = k == 5 ? 37.0f : v; break;
          default: x[k] = v * 5e-5f; break;
        }
      }
    }
    out.push_back(std::move(c));
  }
  return out;
}

TEST(LoadQuantize, Fp16RoundUpIsTheSmallestF16NotBelow) {
  for (double x : {0.0, 1e-9, 5.96e-8, 6e-8, 1e-5, 0.013333, 1.0, 1.0 + 1e-9, 2.0 / 3.0, 1000.3, 65504.0}) {
    EXPECT_EQ(fp16_round_up(x), f16_ceil(x)) << x;
    EXPECT_GE(f16_value(fp16_round_up(x)), x);
  }
}

TEST(LoadQuantize, RtnInt4EqualsTheFloat64Reference) {
  for (const Case& c : cases()) {
    const int64_t G = 128, n_groups = (c.n_in + G - 1) / G;
    std::vector<uint8_t> codes(c.w.size()), zeros(static_cast<size_t>(c.n_out * n_groups));
    std::vector<uint16_t> scales(zeros.size());
    rtn_int4_quantize(c.w.data(), c.n_out, c.n_in, G, codes.data(), scales.data(), zeros.data());
    for (int64_t n = 0; n < c.n_out; ++n)
      for (int64_t g = 0; g < n_groups; ++g) {
        const int64_t k0 = g * G, k1 = std::min(c.n_in, k0 + G);
        double lo = 0, hi = 0;
        for (int64_t k = k0; k < k1; ++k) {
          lo = std::min(lo, static_cast<double>(c.w[n * c.n_in + k]));
          hi = std::max(hi, static_cast<double>(c.w[n * c.n_in + k]));
        }
        const uint16_t sb = hi > lo ? f16_ceil((hi - lo) / 15) : f16_ceil(1.0);
        const double s = f16_value(sb);
        const double z = std::nearbyint(-lo / s);
        ASSERT_EQ(scales[n * n_groups + g], sb) << "row " << n << " group " << g;
        ASSERT_EQ(zeros[n * n_groups + g], z) << "row " << n << " group " << g;
        for (int64_t k = k0; k < k1; ++k) {
          const double x = c.w[n * c.n_in + k];
          const double q = std::clamp(std::nearbyint(x / s) + z, 0.0, 15.0);
          ASSERT_EQ(codes[n * c.n_in + k], q) << "row " << n << " input " << k;
          EXPECT_LE(std::fabs(x - s * (q - z)), s / 2) << "row " << n << " input " << k;
        }
      }
  }
}

TEST(LoadQuantize, Fp8RowsEqualTheReference) {
  for (const Case& c : cases())
    for (int64_t r = 0; r < c.n_out; ++r) {
      const float* x = c.w.data() + r * c.n_in;
      std::vector<uint8_t> codes(static_cast<size_t>(c.n_in));
      const float scale = fp8_quantize_row(x, c.n_in, codes.data());
      double amax = 0;
      for (int64_t k = 0; k < c.n_in; ++k) amax = std::max(amax, std::fabs(static_cast<double>(x[k])));
      EXPECT_EQ(scale, amax > 0 ? static_cast<float>(amax) / 448.0f : 1.0f);
      for (int64_t k = 0; k < c.n_in; ++k) {
        ASSERT_EQ(codes[static_cast<size_t>(k)], float_to_e4m3(x[k] / scale)) << "row " << r << " input " << k;
        // E4M3 has 3 mantissa bits: relative error 2^-4 in the normal range, absolute 2^-10 below it.
        const double back = e4m3_to_float(codes[static_cast<size_t>(k)]) * static_cast<double>(scale);
        EXPECT_LE(std::fabs(back - x[k]), std::max(std::fabs(static_cast<double>(x[k])) / 16, std::ldexp(1.0, -10) * scale)) << k;
      }
    }
}

}  // namespace
}  // namespace kestrel
