// Helpers shared by the AVX-512 kernel files. Include only from *_avx512.cpp (compiled with the
// AVX-512 flags); everything has internal linkage so no AVX-512 code can leak into another TU
// through the linker's choice of one inline definition.
#pragma once

#if defined(__x86_64__)
// GCC 12's AVX-512 intrinsics pass _mm*_undefined_*() placeholders that -Wall reports as
// uninitialized (GCC bug 105593); the warning is about the system header, not this code.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

#include <cstdint>

namespace kestrel::cpu::detail {
namespace {

// Lane i of the result is the sum of the lanes of v[i], always added in the same tree
// ((l0 + l2) + (l1 + l3) within 128-bit lanes, then lanes 0+1 and 2+3, then the two halves), so a
// vector's sum does not depend on its position or on the other 15 vectors: the GEMV and the GEMM
// tiles reduce through here and give bitwise equal outputs.
inline __m512 reduce16(const __m512 v[16]) {
  __m512 p[8], q[4];
  for (int i = 0; i < 8; ++i)
    p[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(p[2 * i]), b = _mm512_castps_pd(p[2 * i + 1]);
    q[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 r01 = _mm512_add_ps(_mm512_shuffle_f32x4(q[0], q[1], 0x88),
                                   _mm512_shuffle_f32x4(q[0], q[1], 0xdd));
  const __m512 r23 = _mm512_add_ps(_mm512_shuffle_f32x4(q[2], q[3], 0x88),
                                   _mm512_shuffle_f32x4(q[2], q[3], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(r01, r23, 0x88), _mm512_shuffle_f32x4(r01, r23, 0xdd));
}

// Collects per-output accumulators and reduces them 16 at a time, so the horizontal sums cost
// ~3 instructions per output instead of ~10.
class OutputCollector {
 public:
  void add(__m512 acc, float* dst) {
    v_[n_] = acc;
    dst_[n_] = dst;
    if (++n_ == 16) flush();
  }
  void flush() {
    if (n_ == 0) return;
    for (int i = n_; i < 16; ++i) v_[i] = _mm512_setzero_ps();
    alignas(64) float out[16];
    _mm512_store_ps(out, reduce16(v_));
    for (int i = 0; i < n_; ++i) *dst_[i] = out[i];
    n_ = 0;
  }

 private:
  __m512 v_[16];
  float* dst_[16];
  int n_ = 0;
};

// Stores the reduce16 result of a (4 rows x n_tok tokens) tile: lane 4t + r goes to y[t * ldy + r].
inline void store_tile(__m512 sums, int n_tok, int n_rows, float* y, int64_t ldy) {
  alignas(64) float out[16];
  _mm512_store_ps(out, sums);
  // Masked 4-float stores: a scalar loop here compiles to a memcpy call per token.
  const __mmask8 m = static_cast<__mmask8>((1u << n_rows) - 1);
  for (int t = 0; t < n_tok; ++t) _mm_mask_storeu_ps(y + t * ldy, m, _mm_load_ps(out + 4 * t));
}

inline __mmask64 byte_mask(int n) { return n >= 64 ? ~__mmask64{0} : ((__mmask64{1} << n) - 1); }
inline __mmask16 lane_mask(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << n) - 1);
}

}  // namespace
}  // namespace kestrel::cpu::detail

#endif  // __x86_64__
