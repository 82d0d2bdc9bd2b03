// AVX2 + FMA + F16C kernels (for x86-64 CPUs without AVX-512 VNNI).
//
// Without vpdpbusd the integer dot products use vpmaddwd (s16 x s16 -> s32 pairs) and, for the
// K-quants, vpmaddubsw (u8 x s8 -> s16 pairs). The 32-element formats multiply the 16-bit
// activations Q = 255 q1 + q2 (see quantize_block_q16) against their quants widened to int16, so
// the activation block holds the int16 Q of its even elements, then of its odd ones
// (quant_formats_avx2.h). The K-quants multiply each int8 plane (q1, q2) with vpmaddubsw, whose
// saturation at 2^15 needs the unsigned operand small: their quants are made unsigned by an offset
// (applied via the activation's block sums, as in the AVX-512 kernels); a second vpmaddwd applies
// the sub-block scales. One 256-bit register holds one 32-element block, so the activation
// layouts are the scalar ones (ActLayout32, ActLayoutK) with identical rounding.
//
// As in the AVX-512 file, a (row, token) output runs the same instruction sequence alone or among
// a few tokens (GEMV: one row against up to 8 tokens) or inside a GEMM tile (2 rows x 4 tokens, weights
// unpacked once per row pair), and every accumulator is reduced by hsum8, so outputs do not
// depend on the batch.
#if defined(__x86_64__)

#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "backend/cpu/matmul_kernels.h"
#include "backend/cpu/quant_formats_avx2.h"

namespace kestrel::cpu::detail {
namespace {

// ((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7)): one fixed order for every output.
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline int hsum8_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}



// Packs 4 x 8 int32 (each in int8 range) to 32 int8 in element order.
inline void store_i8x32(int8_t* dst, const __m256i v[4]) {
  // packs work per 128-bit lane; the final permute restores element order.
  const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

// The 32 int16 values of v[0..3] (8 int32 each, elements 8k..8k+7, each in int16 range) stored
// as the 16 even elements, then the 16 odd ones (the 32-element formats' activation block).
inline void store_i16_even_odd(int16_t* dst, const __m256i v[4]) {
  // packs work per 128-bit lane: a 64-bit permute restores element order, a byte shuffle puts
  // each lane's even words before its odd ones, a second permute gathers the lanes' halves.
  const __m256i even_odd = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                            0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
  auto half = [&](__m256i a, __m256i b) {  // elements 0..15 of the pair -> [even 8 | odd 8]
    const __m256i natural = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xd8);
    return _mm256_permute4x64_epi64(_mm256_shuffle_epi8(natural, even_odd), 0xd8);
  };
  const __m256i lo = half(v[0], v[1]), hi = half(v[2], v[3]);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm256_permute2x128_si256(lo, hi, 0x20));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16), _mm256_permute2x128_si256(lo, hi, 0x31));
}

// Quantizes n (a multiple of 32) floats to 16 bits with one scale (the rounding of
// quantize_block_q16); returns the scale and stores the sum of Q over each 32-element run in
// sum32 (if not null). Stores the planes q1, q2 in natural order, or, given q16, Q = 255 q1 + q2
// of each 32-element run as int16 (store_i16_even_odd) instead.
float quantize_run(const float* x, int n, bool bits8, int8_t* q1, int8_t* q2, int* sum32, int16_t* q16 = nullptr) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 mx = _mm256_setzero_ps();
  for (int i = 0; i < n; i += 8) mx = _mm256_max_ps(mx, _mm256_and_ps(_mm256_loadu_ps(x + i), abs_mask));
  const float amax = hmax8(mx);
  const __m256 id = _mm256_set1_ps(act_inverse_scale(amax, bits8));
  const __m256 inv_split = _mm256_set1_ps(kInvActSplit);
  for (int i = 0; i < n; i += 32) {
    __m256i Q[4], hi[4], lo[4];
    for (int k = 0; k < 4; ++k) {
      Q[k] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8 * k), id));
      if (bits8) Q[k] = combine_planes(Q[k], _mm256_setzero_si256());
      hi[k] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_cvtepi32_ps(Q[k]), inv_split));
      lo[k] = _mm256_sub_epi32(Q[k], combine_planes(hi[k], _mm256_setzero_si256()));
    }
    if (sum32)
      sum32[i / 32] = hsum8_epi32(_mm256_add_epi32(_mm256_add_epi32(Q[0], Q[1]), _mm256_add_epi32(Q[2], Q[3])));
    if (q16) {
      // |hi|, |lo| <= 127 (act_inverse_scale bounds |Q| by 255 * 127 + 127), so Q is exactly the
      // value the int8 planes encode.
      store_i16_even_odd(q16 + i, Q);
    } else {
      store_i8x32(q1 + i, hi);
      store_i8x32(q2 + i, lo);
    }
  }
  return act_scale(amax);
}

void quantize_act(GgmlType type, const float* x, int64_t n_in, int64_t, bool bits8, uint8_t* dst) {
  if (is_k_quant(type)) {
    const ActLayoutK L(n_in);
    const auto [q1, q2, d, bsums1, bsums2] = L.planes(dst);
    auto bsum16 = [](const int8_t* q) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
      return static_cast<int16_t>(hsum8_epi32(_mm256_madd_epi16(_mm256_cvtepi8_epi16(v), _mm256_set1_epi16(1))));
    };
    for (int64_t b = 0; b < L.nsb; ++b) {
      d[b] = quantize_run(x + b * QK_K, QK_K, bits8, q1 + b * QK_K, q2 + b * QK_K, nullptr);
      for (int g = 0; g < QK_K / 16; ++g) {
        bsums1[b * (QK_K / 16) + g] = bsum16(q1 + b * QK_K + 16 * g);
        bsums2[b * (QK_K / 16) + g] = bsum16(q2 + b * QK_K + 16 * g);
      }
    }
    return;
  }
  const ActLayout32 L(n_in);
  auto* d = reinterpret_cast<float*>(dst + L.d_off);
  auto* s = reinterpret_cast<float*>(dst + L.s_off);
  // Q = 255 q1 + q2 as int16 in the planes' place (2 n_in bytes): per block the 16 even
  // elements, then the 16 odd ones (quant_formats_avx2.h).
  auto* q16 = reinterpret_cast<int16_t*>(dst);
  for (int64_t b = 0; b < L.nb; ++b) {
    int sum;
    d[b] = quantize_run(x + 32 * b, 32, bits8, nullptr, nullptr, &sum, q16 + 32 * b);
    s[b] = d[b] * static_cast<float>(sum);
  }
  std::memset(s + L.nb, 0, L.bytes - L.s_off - static_cast<size_t>(L.nb) * 4);
}


// ---- 32-element block formats (quant_formats_avx2.h) ----

// One token's activations for the 32-element formats: the int16 Q in the planes' place.
struct Act32 {
  const int16_t* q16;
  const float* d;
  const float* s;
  Act32(const uint8_t* p, const ActLayout32& L)
      : q16(reinterpret_cast<const int16_t*>(p)), d(reinterpret_cast<const float*>(p + L.d_off)),
        s(reinterpret_cast<const float*>(p + L.s_off)) {}
};


// Block b's exact sum(u * Q) spread over 8 lanes (lane j: elements 4j..4j+3).
template <class F>
inline __m256i dot_block(const Prepared& p, const Act32& x, int64_t b) {
  return dot16(p, x.q16 + 32 * b);
}

// The GEMV (one token) and calls of a few tokens (up to kFewTokensMax, in groups of up to
// kFewTokens): one row at a time with its blocks in order, each block's quants and scales decoded
// once and multiplied with every token of the group, a register accumulator per token; scratch
// holds the row's block offsets c (zero-padded to 8). Unpacking the rows first (the GEMM below)
// costs about a GEMV's worth of decoding per call, which only many tokens pay back (Zen 1,
// SmolLM2's matrices: 9 and 16 tokens 3% faster this way, 2-5 tokens 17-25%). A decode step
// streams the weights from memory, and a plain forward walk is what the hardware prefetcher
// follows best: interleaving rows (to overlap their FMA chains) or reading 8 blocks' scales ahead
// of their quants ran twice as fast from cache but half as fast from memory, and two rows at a
// time 7% slower on Zen 1.
constexpr int64_t kFewTokens = 8;
constexpr int64_t kFewTokensMax = 16;

template <class F, int T>
void few32(const MatmulArgs& a, int64_t r0, int64_t r1, uint8_t* scratch, int64_t t0) {
  const ActLayout32 L(a.w.n_in);
  const int64_t n_ch = (L.nb + 7) / 8;
  const int16_t* q16[T];
  const float* xd[T];
  const float* xs[T];
  for (int t = 0; t < T; ++t) {
    const Act32 x(a.act + (t0 + t) * a.act_stride, L);
    q16[t] = x.q16;
    xd[t] = x.d;
    xs[t] = x.s;
  }
  auto* c = reinterpret_cast<float*>(scratch);
  std::memset(c, 0, static_cast<size_t>(n_ch) * 32);
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = a.w.data + r * a.w_row_bytes;
    prefetch_ahead(a.w.data, a.w_row_bytes, r, r1);
    __m256 acc[T];
    for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < L.nb; ++b) {
      const uint8_t* blk = row + b * F::kBlockBytes;
      const Prepared p = F::prep(F::quants(blk));
      float dw, cw;
      F::dc(blk, dw, cw);
      for (int t = 0; t < T; ++t) {
        const __m256i isum = dot16(p, q16[t] + 32 * b);
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(dw * xd[t][b]), acc[t]);
      }
      if constexpr (F::kHasOffset) c[b] = cw;
    }
    for (int t = 0; t < T; ++t) {
      if constexpr (F::kHasOffset)
        for (int64_t ch = 0; ch < n_ch; ++ch)
          acc[t] = _mm256_fmadd_ps(_mm256_loadu_ps(c + 8 * ch), _mm256_loadu_ps(xs[t] + 8 * ch), acc[t]);
      a.y[(t0 + t) * a.w.n_out + r] = hsum8(acc[t]);
    }
  }
}

// The tokens in groups of at most kFewTokens, as even as possible (9 -> 5 + 4).
template <class F>
void few32_tokens(const MatmulArgs& a, int64_t r0, int64_t r1, uint8_t* scratch) {
  const int64_t groups = (a.n_tokens + kFewTokens - 1) / kFewTokens;
  for (int64_t g = 0, t0 = 0; g < groups; ++g) {
    const int64_t n = (a.n_tokens - t0) / (groups - g);
    switch (n) {
      case 1: few32<F, 1>(a, r0, r1, scratch, t0); break;
      case 2: few32<F, 2>(a, r0, r1, scratch, t0); break;
      case 3: few32<F, 3>(a, r0, r1, scratch, t0); break;
      case 4: few32<F, 4>(a, r0, r1, scratch, t0); break;
      case 5: few32<F, 5>(a, r0, r1, scratch, t0); break;
      case 6: few32<F, 6>(a, r0, r1, scratch, t0); break;
      case 7: few32<F, 7>(a, r0, r1, scratch, t0); break;
      default: few32<F, 8>(a, r0, r1, scratch, t0); break;
    }
    t0 += n;
  }
}

// GEMM: two rows unpacked into scratch (quants [nb][32], d [nb], c [n_ch * 8]), tokens 4 at a time.
struct Unpacked32 {
  int64_t n_ch;
  size_t d_off, c_off, row_bytes;
  explicit Unpacked32(const ActLayout32& L)
      : n_ch((L.nb + 7) / 8), d_off(static_cast<size_t>(L.nb) * 32), c_off(align64(d_off + static_cast<size_t>(L.nb) * 4)),
        row_bytes(align64(c_off + static_cast<size_t>(n_ch) * 32)) {}
};

template <class F, int T>
void tile32(const MatmulArgs& a, const ActLayout32& L, const Unpacked32& U, const uint8_t* wt, int64_t t0,
            int64_t r, int n_rows) {
  __m256 acc[2][T];
  for (int i = 0; i < 2; ++i)
    for (int t = 0; t < T; ++t) acc[i][t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < L.nb; ++b) {
    for (int i = 0; i < 2; ++i) {
      const uint8_t* u = wt + i * U.row_bytes;
      const Prepared p = F::prep(_mm256_load_si256(reinterpret_cast<const __m256i*>(u + 32 * b)));
      const float dw = reinterpret_cast<const float*>(u + U.d_off)[b];
      for (int t = 0; t < T; ++t) {
        const Act32 x(a.act + (t0 + t) * a.act_stride, L);
        const __m256i isum = dot_block<F>(p, x, b);
        acc[i][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(dw * x.d[b]), acc[i][t]);
      }
    }
  }
  if constexpr (F::kHasOffset) {
    for (int64_t ch = 0; ch < U.n_ch; ++ch) {
      for (int i = 0; i < 2; ++i) {
        const __m256 c = _mm256_load_ps(reinterpret_cast<const float*>(wt + i * U.row_bytes + U.c_off) + 8 * ch);
        for (int t = 0; t < T; ++t) {
          const Act32 x(a.act + (t0 + t) * a.act_stride, L);
          acc[i][t] = _mm256_fmadd_ps(c, _mm256_loadu_ps(x.s + 8 * ch), acc[i][t]);
        }
      }
    }
  }
  for (int t = 0; t < T; ++t)
    for (int i = 0; i < n_rows; ++i) a.y[(t0 + t) * a.w.n_out + r + i] = hsum8(acc[i][t]);
}

template <class F>
void gemm32(const MatmulArgs& a, int64_t r0, int64_t r1, uint8_t* scratch) {
  const ActLayout32 L(a.w.n_in);
  const Unpacked32 U(L);
  for (int64_t t0 = 0; t0 < a.n_tokens; t0 += kGemmTokenBlock) {
    for (int64_t r = r0; r < r1; r += 2) {
      const int n_rows = static_cast<int>(std::min<int64_t>(2, r1 - r));
      for (int i = 0; i < 2; ++i) {
        uint8_t* u = scratch + i * U.row_bytes;
        auto* d = reinterpret_cast<float*>(u + U.d_off);
        auto* c = reinterpret_cast<float*>(u + U.c_off);
        std::memset(c, 0, static_cast<size_t>(U.n_ch) * 32);
        // A missing second row repeats the first (its outputs are not stored).
        const uint8_t* row = a.w.data + (r + std::min(i, n_rows - 1)) * a.w_row_bytes;
        for (int64_t b = 0; b < L.nb; ++b) {
          const uint8_t* blk = row + b * F::kBlockBytes;
          _mm256_store_si256(reinterpret_cast<__m256i*>(u + 32 * b), F::quants(blk));
          F::dc(blk, d[b], c[b]);
        }
      }
      for_token_tiles(t0, std::min(a.n_tokens, t0 + kGemmTokenBlock),
                      [&](auto T, int64_t t) { tile32<F, decltype(T)::value>(a, L, U, scratch, t, r, n_rows); });
    }
  }
}


// ---- K-quants: one row against up to 4 tokens, a super-block unpacked once ----

template <class F, int T>
void kquant_tile(const MatmulArgs& a, const ActLayoutK& L, int64_t r, int64_t t0) {
  const auto* blocks = reinterpret_cast<const typename F::Block*>(a.w.data + r * a.w_row_bytes);
  __m256 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
  typename F::Unpacked u;
  for (int64_t b = 0; b < L.nsb; ++b) {
    F::unpack(blocks[b], u);
    for (int t = 0; t < T; ++t) {
      const uint8_t* at = a.act + (t0 + t) * a.act_stride;
      const KActs ka{reinterpret_cast<const int8_t*>(at) + b * QK_K, reinterpret_cast<const int8_t*>(at + L.q2_off) + b * QK_K,
                     reinterpret_cast<const int16_t*>(at + L.bsums_off) + b * (QK_K / 16),
                     reinterpret_cast<const int16_t*>(at + L.bsums2_off) + b * (QK_K / 16),
                     reinterpret_cast<const float*>(at + L.d_off)[b]};
      acc[t] = F::dot(u, ka, acc[t]);
    }
  }
  for (int t = 0; t < T; ++t) a.y[(t0 + t) * a.w.n_out + r] = hsum8(acc[t]);
}

template <class F>
void matmul_kquant(const MatmulArgs& a, int64_t r0, int64_t r1) {
  const ActLayoutK L(a.w.n_in);
  for (int64_t t0 = 0; t0 < a.n_tokens; t0 += kGemmTokenBlock) {
    for (int64_t r = r0; r < r1; ++r) {
      prefetch_ahead(a.w.data, a.w_row_bytes, r, r1);
      for_token_tiles(t0, std::min(a.n_tokens, t0 + kGemmTokenBlock),
                      [&](auto T, int64_t t) { kquant_tile<F, decltype(T)::value>(a, L, r, t); });
    }
  }
}

// ---- F32 / F16 / BF16: 8 elements at a time; a ragged tail goes through a zero-padded copy ----

struct A2F32 {
  static constexpr int kBytes = 4;
  static __m256 load(const uint8_t* p) { return _mm256_loadu_ps(reinterpret_cast<const float*>(p)); }
};
struct A2F16 {
  static constexpr int kBytes = 2;
  static __m256 load(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
};
struct A2BF16 {
  static constexpr int kBytes = 2;
  static __m256 load(const uint8_t* p) {
    const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
  }
};

template <class F>
__m256 load_w(const uint8_t* row, int64_t k, int64_t n) {
  if (k + 8 <= n) return F::load(row + k * F::kBytes);
  alignas(32) uint8_t tmp[32] = {};
  std::memcpy(tmp, row + k * F::kBytes, static_cast<size_t>(n - k) * F::kBytes);
  return F::load(tmp);
}
inline __m256 load_x(const float* x, int64_t k, int64_t n) {
  if (k + 8 <= n) return _mm256_loadu_ps(x + k);
  alignas(32) float tmp[8] = {};
  std::memcpy(tmp, x + k, static_cast<size_t>(n - k) * 4);
  return _mm256_load_ps(tmp);
}

template <class F, int T>
void float_tile(const MatmulArgs& a, int64_t r, int n_rows, int64_t t0) {
  const int64_t n = a.w.n_in;
  const uint8_t* rows[2] = {a.w.data + r * a.w_row_bytes, a.w.data + (r + n_rows - 1) * a.w_row_bytes};
  __m256 acc[2][T];
  for (int i = 0; i < 2; ++i)
    for (int t = 0; t < T; ++t) acc[i][t] = _mm256_setzero_ps();
  for (int64_t k = 0; k < n; k += 8) {
    for (int i = 0; i < 2; ++i) {
      const __m256 w = load_w<F>(rows[i], k, n);
      for (int t = 0; t < T; ++t) acc[i][t] = _mm256_fmadd_ps(w, load_x(a.x + (t0 + t) * n, k, n), acc[i][t]);
    }
  }
  for (int t = 0; t < T; ++t)
    for (int i = 0; i < n_rows; ++i) a.y[(t0 + t) * a.w.n_out + r + i] = hsum8(acc[i][t]);
}

template <class F>
void matmul_float(const MatmulArgs& a, int64_t r0, int64_t r1) {
  for (int64_t t0 = 0; t0 < a.n_tokens; t0 += kGemmTokenBlock) {
    for (int64_t r = r0; r < r1; r += 2) {
      const int n_rows = static_cast<int>(std::min<int64_t>(2, r1 - r));
      prefetch_ahead(a.w.data, a.w_row_bytes, r, r1);
      prefetch_ahead(a.w.data, a.w_row_bytes, r + 1, r1);
      for_token_tiles(t0, std::min(a.n_tokens, t0 + kGemmTokenBlock),
                      [&](auto T, int64_t t) { float_tile<F, decltype(T)::value>(a, r, n_rows, t); });
    }
  }
}

// ---- kernel table ----

size_t act_row_bytes(GgmlType type, int64_t n_in) {
  if (is_float_type(type)) return 0;
  return is_k_quant(type) ? ActLayoutK(n_in).bytes : ActLayout32(n_in).bytes;
}

size_t scratch_bytes(GgmlType type, int64_t n_in) {
  if (is_float_type(type) || is_k_quant(type)) return 0;
  return 2 * Unpacked32(ActLayout32(n_in)).row_bytes;
}

template <class F>
void matmul32(const MatmulArgs& a, int64_t r0, int64_t r1, uint8_t* scratch) {
  if (a.n_tokens <= kFewTokensMax) few32_tokens<F>(a, r0, r1, scratch);
  else gemm32<F>(a, r0, r1, scratch);
}

void matmul_rows(const MatmulArgs& a, int64_t r0, int64_t r1, uint8_t* scratch) {
  switch (a.w.type.storage) {
    case GgmlType::Q4_0: matmul32<A2Q4_0>(a, r0, r1, scratch); break;
    case GgmlType::Q4_1: matmul32<A2Q4_1>(a, r0, r1, scratch); break;
    case GgmlType::Q5_0: matmul32<A2Q5_0>(a, r0, r1, scratch); break;
    case GgmlType::Q5_1: matmul32<A2Q5_1>(a, r0, r1, scratch); break;
    case GgmlType::Q8_0: matmul32<A2Q8_0>(a, r0, r1, scratch); break;
    case GgmlType::Q2_K: matmul_kquant<A2Q2_K>(a, r0, r1); break;
    case GgmlType::Q3_K: matmul_kquant<A2Q3_K>(a, r0, r1); break;
    case GgmlType::Q4_K: matmul_kquant<A2Q4_K>(a, r0, r1); break;
    case GgmlType::Q5_K: matmul_kquant<A2Q5_K>(a, r0, r1); break;
    case GgmlType::Q6_K: matmul_kquant<A2Q6_K>(a, r0, r1); break;
    case GgmlType::F32: matmul_float<A2F32>(a, r0, r1); break;
    case GgmlType::F16: matmul_float<A2F16>(a, r0, r1); break;
    case GgmlType::BF16: matmul_float<A2BF16>(a, r0, r1); break;
    default: break;
  }
}

float vec_dot(const float* a, const float* b, int64_t n) {
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  int64_t i = 0;
  for (; i + 32 <= n; i += 32)
    for (int k = 0; k < 4; ++k)
      acc[k] = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8 * k), _mm256_loadu_ps(b + i + 8 * k), acc[k]);
  for (; i < n; i += 8) acc[0] = _mm256_fmadd_ps(load_x(a, i, n), load_x(b, i, n), acc[0]);
  return hsum8(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
}

}  // namespace

const MatmulKernels& kernels_avx2() {
  using Acts = PerTokenActs<act_row_bytes, quantize_act>;
  static const MatmulKernels k{"avx2", Acts::bytes, Acts::stride, Acts::quantize, scratch_bytes, matmul_rows, vec_dot, [](GgmlType, int64_t) -> int64_t { return 2; }};
  return k;
}

}  // namespace kestrel::cpu::detail

#endif  // __x86_64__
