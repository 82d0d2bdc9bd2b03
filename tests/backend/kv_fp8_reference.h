// The FP8 (E4M3) KV cache's row quantization on the host, for the CUDA tests' references: a row
// of n bf16 values gets scale = amax / 448 (1 for an all-zero row) and codes e4m3(x / scale),
// rounded by core/fp8.h (src/backend/cuda/kv_fp8.cuh states the format).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "core/fp8.h"
#include "cuda_test_util.h"

namespace kestrel::test {

inline void quantize_row_e4m3(const uint16_t* x, int64_t n, uint8_t* codes, float* scale) {
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(from_bf16(x[i])));
  const float s = amax > 0.0f ? amax / kFp8E4m3Max : 1.0f;
  for (int64_t i = 0; i < n; ++i) codes[i] = float_to_e4m3(from_bf16(x[i]) / s);
  *scale = s;
}

// A cache of rows of row_len values (any layout whose rows are contiguous): codes in the same
// layout, one scale per row in row order.
struct Fp8Rows {
  std::vector<uint8_t> codes;
  std::vector<float> scales;
};
inline Fp8Rows quantize_rows_e4m3(const std::vector<uint16_t>& x, int64_t row_len) {
  Fp8Rows q{std::vector<uint8_t>(x.size()), std::vector<float>(x.size() / static_cast<size_t>(row_len))};
  for (size_t r = 0; r < q.scales.size(); ++r)
    quantize_row_e4m3(x.data() + r * static_cast<size_t>(row_len), row_len, q.codes.data() + r * static_cast<size_t>(row_len),
                      &q.scales[r]);
  return q;
}
// The values the rows hold: code x scale, in double (exact).
inline std::vector<double> dequantize_rows(const Fp8Rows& q, int64_t row_len) {
  std::vector<double> v(q.codes.size());
  for (size_t i = 0; i < v.size(); ++i)
    v[i] = static_cast<double>(e4m3_to_float(q.codes[i])) * q.scales[i / static_cast<size_t>(row_len)];
  return v;
}

}  // namespace kestrel::test
