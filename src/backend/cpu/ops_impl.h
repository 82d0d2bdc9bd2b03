// One source for the CPU ops, compiled once per ISA (see ops.h). Included only by ops_*.cpp, each
// of which defines KESTREL_OPS_NS before including it; the attention kernel is in
// attention_impl.h (its INT8 parts in attention_int8_impl.h), included from here.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>
#include <string>
#include <type_traits>

#if defined(__AVX__) || defined(__F16C__)
// GCC 12's AVX-512 intrinsics pass _mm*_undefined_*() placeholders that -Wall reports as
// uninitialized (GCC bug 105593), as in simd_avx512.h: the warning is about the system header.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#endif

#include "backend/cpu/matmul_kernels.h"
#include "backend/cpu/ops.h"
#include "core/dtype.h"
#include "core/error.h"

// The attention kernel's helpers are inlined whatever GCC's size heuristics say: a call out of
// the tile loop spills every live vector register (all are caller-saved).
#define KESTREL_INLINE inline __attribute__((always_inline))

namespace kestrel::cpu::KESTREL_OPS_NS {

typedef float v8f __attribute__((vector_size(32), aligned(4)));

// With AVX the loads and stores are the unaligned-access intrinsics: a memcpy into v8f made
// GCC 12 assemble each vector from two 16-byte halves through a stack slot, and the 32-byte reload
// of two 16-byte stores cannot be store-forwarded (a stall per vector, most of attention's time).
// The arithmetic is the same either way.
inline v8f load8(const float* p) {
#if defined(__AVX__)
  return reinterpret_cast<v8f>(_mm256_loadu_ps(p));
#else
  v8f v;
  std::memcpy(&v, p, sizeof v);
  return v;
#endif
}
inline void store8(float* p, v8f v) {
#if defined(__AVX__)
  _mm256_storeu_ps(p, reinterpret_cast<__m256>(v));
#else
  std::memcpy(p, &v, sizeof v);
#endif
}
// 8 f16 values widened to f32 (exact), and 8 f32 values rounded to f16 (nearest even).
inline v8f load8(const uint16_t* p) {
#if defined(__F16C__)
  return reinterpret_cast<v8f>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  v8f v;
  for (int i = 0; i < 8; ++i) v[i] = fp16_to_fp32(p[i]);
  return v;
#endif
}
inline void store8(uint16_t* p, v8f v) {
#if defined(__F16C__)
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(reinterpret_cast<__m256>(v), _MM_FROUND_TO_NEAREST_INT));
#else
  for (int i = 0; i < 8; ++i) p[i] = fp32_to_fp16(v[i]);
#endif
}
// 8 int8 codes widened to f32 (exact).
inline v8f load8(const int8_t* p) {
#if defined(__AVX2__)
  return reinterpret_cast<v8f>(
      _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#else
  v8f v;
  for (int i = 0; i < 8; ++i) v[i] = static_cast<float>(p[i]);
  return v;
#endif
}
inline float hsum8(v8f v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

inline float to_f32(float x) { return x; }
inline float to_f32(uint16_t h) { return fp16_to_fp32(h); }
inline float to_f32(int8_t c) { return static_cast<float>(c); }

template <class T>
inline float dot(const float* a, const T* b, int64_t n) {
  v8f acc0 = {}, acc1 = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 += load8(a + i) * load8(b + i);
    acc1 += load8(a + i + 8) * load8(b + i + 8);
  }
  for (; i + 8 <= n; i += 8) acc0 += load8(a + i) * load8(b + i);
  float s = hsum8(acc0 + acc1);
  for (; i < n; ++i) s += a[i] * to_f32(b[i]);
  return s;
}

// y = y * c + p * x
template <class T>
inline void scale_add(float* y, float c, float p, const T* x, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) store8(y + i, load8(y + i) * c + load8(x + i) * p);
  for (; i < n; ++i) y[i] = y[i] * c + to_f32(x[i]) * p;
}

void rms_norm(const float* x, const float* w, float* y, int64_t n_rows, int64_t dim, float eps) {
  for (int64_t r = 0; r < n_rows; ++r) {
    const float* xr = x + r * dim;
    float* yr = y + r * dim;
    const float ss = dot(xr, xr, dim);
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(dim) + eps);
    int64_t i = 0;
    for (; i + 8 <= dim; i += 8) store8(yr + i, load8(xr + i) * inv * load8(w + i));
    for (; i < dim; ++i) yr[i] = xr[i] * inv * w[i];
  }
}

// exp(x) for 8 lanes: x = k ln2 + r with |r| <= ln2/2, exp(r) by its degree-6 Taylor polynomial
// (relative error below 2e-7 on that range), scaled by 2^k through the exponent bits. Inputs are
// clamped to [-87, 88] so 2^k stays a normal float.
// VF: a vector of floats, VI: the int32 vector of as many lanes (every lane computed alike, so a
// lane's result does not depend on the vector's width).
template <class VF, class VI>
KESTREL_INLINE VF exp_lanes(VF x) {
  const VF hi = VF{} + 88.0f, lo = VF{} - 87.0f;
  x = x > hi ? hi : x;
  x = x < lo ? lo : x;
  const VF log2e = x * 1.4426950408889634f;
  VI k = __builtin_convertvector(log2e + (log2e >= 0 ? 0.5f : -0.5f), VI);
  const VF kf = __builtin_convertvector(k, VF);
  const VF r = (x - kf * 0.693145751953125f) - kf * 1.428606765330187e-06f;
  VF p = r * (1.0f / 720) + (1.0f / 120);
  p = p * r + (1.0f / 24);
  p = p * r + (1.0f / 6);
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const VI bits = (k + 127) << 23;
  VF scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}
typedef int32_t v8i __attribute__((vector_size(32), aligned(4)));
inline v8f exp8(v8f x) { return exp_lanes<v8f, v8i>(x); }

void silu_mul(const float* gate, const float* up, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const v8f g = load8(gate + i);
    store8(out + i, g / (1.0f + exp8(-g)) * load8(up + i));
  }
  for (; i < n; ++i) {
    const float g = gate[i];
    out[i] = g / (1.0f + std::exp(-g)) * up[i];
  }
}

// GELU's tanh approximation times up: 0.5 x (1 + tanh(u)) with u = sqrt(2 / pi) (x + 0.044715 x^3),
// computed as x / (1 + exp(-2u)) (the same function: 1 + tanh(u) = 2 / (1 + exp(-2u))), which
// needs one vector exp and no cancellation for negative x.
void gelu_mul(const float* gate, const float* up, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const v8f x = load8(gate + i);
    const v8f u = (x + x * x * x * 0.044715f) * 0.7978845608028654f;
    store8(out + i, x / (1.0f + exp8(u * -2.0f)) * load8(up + i));
  }
  for (; i < n; ++i) {
    const float x = gate[i];
    const float u = (x + x * x * x * 0.044715f) * 0.7978845608028654f;
    out[i] = x / (1.0f + std::exp(u * -2.0f)) * up[i];
  }
}

void add(float* x, const float* y, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) store8(x + i, load8(x + i) + load8(y + i));
  for (; i < n; ++i) x[i] += y[i];
}

// a * b + c: one rounding where the ISA has FMA (the AVX2 and AVX-512 builds), two otherwise.
inline v8f fma8(v8f a, v8f b, v8f c) {
#if defined(__FMA__)
  return reinterpret_cast<v8f>(_mm256_fmadd_ps(reinterpret_cast<__m256>(a), reinterpret_cast<__m256>(b),
                                               reinterpret_cast<__m256>(c)));
#else
  return a * b + c;
#endif
}
inline float fma1(float a, float b, float c) {
#if defined(__FMA__)
  return __builtin_fmaf(a, b, c);
#else
  return a * b + c;
#endif
}
inline v8f splat8(float x) { return v8f{x, x, x, x, x, x, x, x}; }

// r[i][k] -> r[k][i] for an 8 x 8 block.
inline void transpose8(v8f* r) {
  v8f t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = __builtin_shufflevector(r[i], r[i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
    t[i + 1] = __builtin_shufflevector(r[i], r[i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = __builtin_shufflevector(t[i], t[i + 2], 0, 1, 8, 9, 4, 5, 12, 13);
    u[i + 1] = __builtin_shufflevector(t[i], t[i + 2], 2, 3, 10, 11, 6, 7, 14, 15);
    u[i + 2] = __builtin_shufflevector(t[i + 1], t[i + 3], 0, 1, 8, 9, 4, 5, 12, 13);
    u[i + 3] = __builtin_shufflevector(t[i + 1], t[i + 3], 2, 3, 10, 11, 6, 7, 14, 15);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = __builtin_shufflevector(u[i], u[i + 4], 0, 1, 2, 3, 8, 9, 10, 11);
    r[i + 4] = __builtin_shufflevector(u[i], u[i + 4], 4, 5, 6, 7, 12, 13, 14, 15);
  }
}

// 16 floats: one AVX-512 register, two AVX registers elsewhere (the lanes' arithmetic is the same).
typedef float v16f __attribute__((vector_size(64), aligned(4)));
inline v16f load16(const float* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<v16f>(_mm512_loadu_ps(p));
#else
  return __builtin_shufflevector(load8(p), load8(p + 8), 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#endif
}
// 16 f16 values or int8 codes widened to f32 (exact).
inline v16f load16(const uint16_t* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<v16f>(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#else
  return __builtin_shufflevector(load8(p), load8(p + 8), 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#endif
}
inline v16f load16(const int8_t* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<v16f>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#else
  return __builtin_shufflevector(load8(p), load8(p + 8), 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#endif
}
inline void store16(float* p, v16f v) {
#if defined(__AVX512F__)
  _mm512_storeu_ps(p, reinterpret_cast<__m512>(v));
#else
  store8(p, __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7));
  store8(p + 8, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15));
#endif
}
// (Not v16f{} + x: that is a scalar add per call, and turns -0 into +0.)
inline v16f splat16(float x) {
#if defined(__AVX512F__)
  return reinterpret_cast<v16f>(_mm512_set1_ps(x));
#else
  const v8f h = v8f{x, x, x, x, x, x, x, x};
  return __builtin_shufflevector(h, h, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#endif
}
inline v16f fma16(v16f a, v16f b, v16f c) {
#if defined(__AVX512F__)
  return reinterpret_cast<v16f>(_mm512_fmadd_ps(reinterpret_cast<__m512>(a), reinterpret_cast<__m512>(b),
                                                reinterpret_cast<__m512>(c)));
#elif defined(__FMA__)
  const v8f lo = fma8(__builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7), __builtin_shufflevector(b, b, 0, 1, 2, 3, 4, 5, 6, 7),
                      __builtin_shufflevector(c, c, 0, 1, 2, 3, 4, 5, 6, 7));
  const v8f hi = fma8(__builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15),
                      __builtin_shufflevector(b, b, 8, 9, 10, 11, 12, 13, 14, 15),
                      __builtin_shufflevector(c, c, 8, 9, 10, 11, 12, 13, 14, 15));
  return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  return a * b + c;
#endif
}

typedef int32_t v16i __attribute__((vector_size(64)));
typedef int8_t v16c __attribute__((vector_size(16)));

#include "backend/cpu/attention_impl.h"

void f32_to_f16(const float* x, uint16_t* y, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) store8(y + i, load8(x + i));
  for (; i < n; ++i) y[i] = fp32_to_fp16(x[i]);
}

const OpsTable kTable{rms_norm, silu_mul, add, attention, attention_chunks, attention_merge, f32_to_f16, gelu_mul};

}  // namespace kestrel::cpu::KESTREL_OPS_NS
#undef KESTREL_INLINE
