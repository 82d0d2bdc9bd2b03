// One source for the CPU ops, compiled once per ISA (see ops.h). Included only by ops_*.cpp, each
// of which defines KESTREL_OPS_NS before including it.
#include <cmath>
#include <cstring>
#include <string>
#include <type_traits>

#if defined(__AVX__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "backend/cpu/ops.h"
#include "core/dtype.h"
#include "core/error.h"

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
inline v8f exp8(v8f x) {
  typedef int32_t v8i __attribute__((vector_size(32), aligned(4)));
  const v8f hi = {88, 88, 88, 88, 88, 88, 88, 88};
  const v8f lo = {-87, -87, -87, -87, -87, -87, -87, -87};
  x = x > hi ? hi : x;
  x = x < lo ? lo : x;
  const v8f log2e = x * 1.4426950408889634f;
  v8i k = __builtin_convertvector(log2e + (log2e >= 0 ? 0.5f : -0.5f), v8i);
  const v8f kf = __builtin_convertvector(k, v8f);
  const v8f r = (x - kf * 0.693145751953125f) - kf * 1.428606765330187e-06f;
  v8f p = r * (1.0f / 720) + (1.0f / 120);
  p = p * r + (1.0f / 24);
  p = p * r + (1.0f / 6);
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const v8i bits = (k + 127) << 23;
  v8f scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

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

template <class T>
void attention_impl(const AttentionArgs& a) {
  constexpr bool kQuantized = std::is_same_v<T, int8_t>;
  constexpr int kMaxGroup = 64;
  constexpr int kMaxTile = 64;
  const int64_t hd = a.head_dim;
  const int64_t vd = a.v_dim > 0 ? a.v_dim : hd;
  const int64_t g_n = a.group;
  const T* kc = static_cast<const T*>(a.k_cache) + a.head_offset;
  const T* vc = static_cast<const T*>(a.v_cache) + a.head_offset;
  float m[kMaxGroup];  // running max of the scores of each query head
  float l[kMaxGroup];  // running sum of exp(score - m)
  float s[kMaxTile + 8] = {};  // + 8: the vector exp reads whole lanes past the tile's end
  for (int64_t g = 0; g < g_n; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.0f;
    std::memset(a.out + g * vd, 0, sizeof(float) * static_cast<size_t>(vd));
  }
  const int64_t bs = a.block_size;
  // Block by block from kv_begin (a window may start inside a block): n keys from offset `first`.
  for (int64_t start = a.kv_begin; start < a.n_ctx;) {
    const int64_t first = start % bs;
    const int64_t n = std::min<int64_t>(bs - first, a.n_ctx - start);
    // This KV head's keys of the block: n rows of head_dim, contiguous.
    const int64_t base = static_cast<int64_t>(a.block_table[start / bs]) * a.block_stride + first * hd;
    // INT8: the scale index of the block's first key row (element offset / head_dim).
    const int64_t scale_row = (a.head_offset + base) / hd;
    if (start - first + bs < a.n_ctx) {  // the next block is elsewhere in memory: start fetching it
      const int64_t next = static_cast<int64_t>(a.block_table[start / bs + 1]) * a.block_stride;
      __builtin_prefetch(kc + next);
      __builtin_prefetch(vc + next);
    }
    // Tiles of at most kMaxTile keys, so any block size works.
    for (int64_t t0 = 0; t0 < n; t0 += kMaxTile) {
      const int64_t tn = std::min<int64_t>(kMaxTile, n - t0);
      for (int64_t g = 0; g < g_n; ++g) {
        const float* q = a.q + g * hd;
        float tile_max = -INFINITY;
        for (int64_t j = 0; j < tn; ++j) {
          const T* kr = kc + base + (t0 + j) * hd;
          if constexpr (kQuantized) {
            const int64_t r = scale_row + t0 + j;
            if (a.k_rope_scale != nullptr) {
              s[j] = (dot(q, kr, vd) * a.k_scale[r] + dot(q + vd, kr + vd, hd - vd) * a.k_rope_scale[r]) * a.scale;
            } else {
              s[j] = dot(q, kr, hd) * a.k_scale[r] * a.scale;
            }
          } else {
            s[j] = dot(q, kr, hd) * a.scale;
          }
          tile_max = std::max(tile_max, s[j]);
        }
        const float m_new = std::max(m[g], tile_max);
        const float correction = std::exp(m[g] - m_new);  // exp(-inf) = 0 on the first tile
        // Probabilities of the tile, 8 lanes at a time (padding lanes are never read).
        float pr[kMaxTile];
        for (int64_t j = 0; j < tn; j += 8) {
          v8f sv = load8(s + j) - m_new;
          store8(pr + j, exp8(sv));
        }
        float* o = a.out + g * vd;
        l[g] *= correction;
        for (int64_t j = 0; j < tn; ++j) {
          l[g] += pr[j];
          const float p = kQuantized ? pr[j] * a.v_scale[scale_row + t0 + j] : pr[j];
          scale_add(o, j == 0 ? correction : 1.0f, p, vc + base + (t0 + j) * hd, vd);
        }
        m[g] = m_new;
      }
    }
    start += n;
  }
  for (int64_t g = 0; g < g_n; ++g) {
    const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
    float* o = a.out + g * vd;
    for (int64_t i = 0; i < vd; ++i) o[i] *= inv;
  }
}

void attention(const AttentionArgs& a) {
  switch (a.kv_dtype) {
    case KvDtype::F32: attention_impl<float>(a); break;
    case KvDtype::F16: attention_impl<uint16_t>(a); break;
    case KvDtype::INT8: attention_impl<int8_t>(a); break;
    default: KESTREL_ASSERT(false, "CPU attention: KV dtype " + std::string(kv_dtype_name(a.kv_dtype)) + " has no kernel");
  }
}

void f32_to_f16(const float* x, uint16_t* y, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) store8(y + i, load8(x + i));
  for (; i < n; ++i) y[i] = fp32_to_fp16(x[i]);
}

const OpsTable kTable{rms_norm, silu_mul, add, attention, f32_to_f16, gelu_mul};

}  // namespace kestrel::cpu::KESTREL_OPS_NS
