#include "backend/cpu/ops.h"

#include <algorithm>
#include <cmath>

#include "backend/cpu/matmul_kernels.h"
#include "core/cpu_features.h"

namespace kestrel::cpu {

const OpsTable& ops() {
  switch (simd_level()) {
    case SimdLevel::Avx512: return ops_avx512();
    case SimdLevel::Avx2: return ops_avx2();
    default: return ops_generic();
  }
}

float quantize_row_int8(const float* x, int8_t* codes, int64_t n) {
  float amax = 0.0f;
  bool finite = true;
  for (int64_t i = 0; i < n; ++i) {
    finite = finite && std::isfinite(x[i]);
    amax = std::max(amax, std::fabs(x[i]));
  }
  const float scale = amax / 127.0f;  // 0 also for a row of subnormals too small to divide
  if (!finite || scale == 0.0f) {
    std::fill_n(codes, n, int8_t{0});
    return finite ? 0.0f : NAN;
  }
  for (int64_t i = 0; i < n; ++i) {
    const float c = std::nearbyint(x[i] / scale);  // the default rounding mode: nearest, ties to even
    codes[i] = static_cast<int8_t>(std::clamp(c, -127.0f, 127.0f));
  }
  return scale;
}

float quantize_query_q16(const float* q, int64_t n, int8_t* q1, int8_t* q2) {
  float amax = 0.0f;
  bool finite = true;
  for (int64_t i = 0; i < n; ++i) {
    finite = finite && std::isfinite(q[i]);
    amax = std::max(amax, std::fabs(q[i]));
  }
  const float inv = detail::act_inverse_scale(amax, false), dq = detail::act_scale(amax);
  if (!finite || dq == 0.0f || !std::isfinite(inv)) {
    std::fill_n(q1, n, int8_t{0});
    std::fill_n(q2, n, int8_t{0});
    return finite ? 0.0f : NAN;
  }
  for (int64_t i = 0; i < n; ++i) detail::act_split(static_cast<int32_t>(std::nearbyint(q[i] * inv)), q1 + i, q2 + i);
  return dq;
}

void rope(float* x, const int32_t* positions, int64_t n_tokens, int64_t n_heads, int64_t head_dim,
          int64_t rope_dim, const float* inv_freq, float position_scale, bool adjacent_pairs) {
  const int64_t half = rope_dim / 2;
  for (int64_t t = 0; t < n_tokens; ++t) {
    const double pos = static_cast<double>(positions[t]) / position_scale;
    float* row = x + t * n_heads * head_dim;
    for (int64_t i = 0; i < half; ++i) {
      const double angle = pos * static_cast<double>(inv_freq[i]);
      const float c = static_cast<float>(std::cos(angle));
      const float s = static_cast<float>(std::sin(angle));
      const int64_t i0 = adjacent_pairs ? 2 * i : i;
      const int64_t i1 = adjacent_pairs ? 2 * i + 1 : i + half;
      for (int64_t h = 0; h < n_heads; ++h) {
        float* hp = row + h * head_dim;
        const float x0 = hp[i0], x1 = hp[i1];
        hp[i0] = x0 * c - x1 * s;
        hp[i1] = x0 * s + x1 * c;
      }
    }
  }
}

}  // namespace kestrel::cpu
