// AVX-512 kernels for the weight types that are not on SmolLM2's hot path: the K-quants Q2_K..Q6_K
// (256-element super-blocks) and F32 / F16 / BF16.
//
// K-quants: the 2- to 6-bit quants (made unsigned, below 64) times the int8 activation planes (q1, q2; see
// quantize_block_q16) go through vpmaddubsw (pairs -> s16, no saturation: 2 * 63 * 127 < 2^15)
// and vpdpwssd with the sub-block scales (-> s32), so a whole super-block is summed in integers
// per plane; the planes combine in f32 (255 * s1 + s2 could overflow int32). The min / offset
// terms use each plane's 16-element sums (bsums). Activations are in natural order (ActLayoutK).
//
// Every (row, token) output runs the same instruction sequence whether it is computed alone or in
// a tile of 4 tokens (the tile only shares the unpacked weights), and is reduced by reduce16, so
// outputs do not depend on the batch.
#if defined(__x86_64__)

// First: it sets up <immintrin.h> (see there).
#include "backend/cpu/quant_formats_avx512.h"

#include <algorithm>
#include <cstring>

#include "backend/cpu/matmul_avx512_internal.h"

namespace kestrel::cpu::detail {
namespace {

// ---- K-quants ----

// One token's activations for one super-block (ActLayoutK: planes q1, q2 and their bsums).
struct KActs {
  const int8_t *q1, *q2;
  const int16_t *bsums1, *bsums2;
  float d;
};

// 255 * hi + lo per lane, in f32 (K-quant sums can exceed int32 when combined).
inline __m512 planes_f32(__m512i hi, __m512i lo) {
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_set1_ps(static_cast<float>(kActSplit)), _mm512_cvtepi32_ps(lo));
}
inline __m512 planes_f32(__m256i hi, __m256i lo) {
  return planes_f32(_mm512_zextsi256_si512(hi), _mm512_zextsi256_si512(lo));
}

// Scale-and-min formats (Q4_K, Q5_K, Q2_K): w = d * sc * u - dmin * m per sub-block.
struct UnpackedQ4K {
  __m512i q[4];   // quants (unsigned) of elements 64k..64k+63
  __m512i sc[4];  // s16 scale of each maddubs lane (lane i: bytes 2i, 2i + 1)
  __m256i m16;    // s16 min of each bsum (16 elements)
  float d, dmin;
};

// For formats with one scale per 16 elements: maddubs lane i of register k covers sub-block
// 4k + i / 8; scv holds the 16 scales as s16.
inline void scales_per16(__m512i scv, __m512i sc[4]) {
  alignas(64) static constexpr int16_t kLanes[32] = {0,  1,  2,  3,  4,  5,  6,  7,  8,  9,  10,
                                                     11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21,
                                                     22, 23, 24, 25, 26, 27, 28, 29, 30, 31};
  const __m512i lane_index = _mm512_load_si512(kLanes);
  for (int k = 0; k < 4; ++k) {
    const __m512i idx = _mm512_add_epi16(_mm512_srli_epi16(lane_index, 3), _mm512_set1_epi16(static_cast<short>(4 * k)));
    sc[k] = _mm512_permutexvar_epi16(idx, scv);
  }
}

struct KScaleMin {
  using Unpacked = UnpackedQ4K;
  static __m512i isum(const Unpacked& u, const int8_t* aq) {
    __m512i iacc = _mm512_setzero_si512();
    for (int k = 0; k < 4; ++k)
      iacc = _mm512_dpwssd_epi32(iacc, _mm512_maddubs_epi16(u.q[k], _mm512_loadu_si512(aq + 64 * k)), u.sc[k]);
    return iacc;
  }
  static __m256i imin(const Unpacked& u, const int16_t* bsums) {
    return _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bsums)), u.m16);
  }
  static __m512 dot(const Unpacked& u, const KActs& a, __m512 acc) {
    const __m512 isums = planes_f32(isum(u, a.q1), isum(u, a.q2));
    const __m512 imins = planes_f32(imin(u, a.bsums1), imin(u, a.bsums2));
    acc = _mm512_fmadd_ps(isums, _mm512_set1_ps(u.d * a.d), acc);
    return _mm512_fmadd_ps(imins, _mm512_set1_ps(-(u.dmin * a.d)), acc);
  }
  // Q4_K / Q5_K: 4-bit quants (u.q) from qs, and the 6-bit scales / mins of the 32-element
  // sub-blocks, d, dmin.
  template <class B>
  static void unpack_k4(const B& b, Unpacked& u) {
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    for (int h = 0; h < 2; ++h) {
      // 64 bytes of qs: low nibbles are sub-blocks 4h and 4h+2, high nibbles 4h+1 and 4h+3
      // (32 elements each); reorder the 256-bit halves into element order.
      const __m512i v = _mm512_loadu_si512(b.qs + 64 * h);
      const __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
      u.q[2 * h] = _mm512_shuffle_i64x2(lo, hi, 0x44);
      u.q[2 * h + 1] = _mm512_shuffle_i64x2(lo, hi, 0xee);
    }
    uint64_t sc8, mn8;
    q4k_scales_mins(b.scales, &sc8, &mn8);
    const __m128i mn = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<long long>(mn8)));
    const __m512i scv = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<long long>(sc8))));
    for (int k = 0; k < 4; ++k) {  // lanes 0..15: sub-block 2k, 16..31: 2k + 1
      const __m512i idx = _mm512_mask_blend_epi16(0xffff0000u, _mm512_set1_epi16(static_cast<short>(2 * k)),
                                                  _mm512_set1_epi16(static_cast<short>(2 * k + 1)));
      u.sc[k] = _mm512_permutexvar_epi16(idx, scv);
    }
    u.m16 = _mm256_permutexvar_epi16(_mm256_setr_epi16(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7), _mm256_castsi128_si256(mn));
    u.d = _cvtsh_ss(b.d);
    u.dmin = _cvtsh_ss(b.dmin);
  }
};

// 32 bytes b as a 512-bit register whose upper half is b shifted right by `shift` bits (per
// 16-bit word): bit n of the lower half's bytes lines up with bit n + shift of the upper's.
inline __m512i halves_shifted(const uint8_t* p, int shift) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, shift), 1);
}

struct KFmtQ4_K : KScaleMin {
  using Block = BlockQ4_K;
  static void unpack(const Block& b, Unpacked& u) { unpack_k4(b, u); }
};

struct KFmtQ5_K : KScaleMin {
  using Block = BlockQ5_K;
  static void unpack(const Block& b, Unpacked& u) {
    unpack_k4(b, u);
    // u.q[k] holds sub-blocks 2k, 2k + 1, whose 5th bits are bits 2k, 2k + 1 of qh[l].
    const __m512i qh = halves_shifted(b.qh, 1), one = _mm512_set1_epi8(1);
    for (int k = 0; k < 4; ++k)
      u.q[k] = _mm512_or_si512(u.q[k], _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qh, 2 * k), one), 4));
  }
};

// Q2_K / Q3_K 2-bit quants: element 128h + 32j + l is bits 2j of qs[32h + l]; register k holds
// h = k / 2, j = 2 (k % 2) and j + 1.
inline __m512i two_bits(const uint8_t* qs, int k) {
  return _mm512_and_si512(_mm512_srli_epi16(halves_shifted(qs + 32 * (k / 2), 2), 4 * (k % 2)), _mm512_set1_epi8(3));
}

struct KFmtQ2_K : KScaleMin {
  using Block = BlockQ2_K;
  static void unpack(const Block& b, Unpacked& u) {
    for (int k = 0; k < 4; ++k) u.q[k] = two_bits(b.qs, k);
    const __m256i sm = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b.scales)));
    scales_per16(_mm512_castsi256_si512(_mm256_and_si256(sm, _mm256_set1_epi16(0x0f))), u.sc);
    u.m16 = _mm256_srli_epi16(sm, 4);
    u.d = _cvtsh_ss(b.d);
    u.dmin = _cvtsh_ss(b.dmin);
  }
};

// Signed-scale formats (Q6_K, Q3_K): w = d * sc_j * (u - 2^kShift) per 16-element sub-block j.
struct UnpackedQ6K {
  __m512i q[4];   // quants (value + 2^kShift) of elements 64k..64k+63
  __m512i sc[4];  // s16 scale of each maddubs lane: sub-block 4k + lane / 8
  __m256i sc16;   // the 16 scales as s16, one per bsum
  float d;
};

template <int kShift>
struct KSigned16 {
  using Unpacked = UnpackedQ6K;
  static void set_scales(__m128i sc8, Unpacked& u) {  // the 16 int8 scales
    u.sc16 = _mm256_cvtepi8_epi16(sc8);
    scales_per16(_mm512_castsi256_si512(u.sc16), u.sc);
  }
  static __m512i isum(const Unpacked& u, const int8_t* aq, const int16_t* bsums) {
    __m512i iacc = _mm512_setzero_si512();
    for (int k = 0; k < 4; ++k)
      iacc = _mm512_dpwssd_epi32(iacc, _mm512_maddubs_epi16(u.q[k], _mm512_loadu_si512(aq + 64 * k)), u.sc[k]);
    // The unpacked quants are value + 2^kShift: subtract 2^kShift * sum_j scale_j * bsum_j.
    const __m256i ioff = _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bsums)), u.sc16);
    return _mm512_sub_epi32(iacc, _mm512_slli_epi32(_mm512_zextsi256_si512(ioff), kShift));
  }
  static __m512 dot(const Unpacked& u, const KActs& a, __m512 acc) {
    const __m512 isums = planes_f32(isum(u, a.q1, a.bsums1), isum(u, a.q2, a.bsums2));
    return _mm512_fmadd_ps(isums, _mm512_set1_ps(u.d * a.d), acc);
  }
};

struct KFmtQ6_K : KSigned16<5> {
  using Block = BlockQ6_K;
  static void unpack(const Block& b, Unpacked& u) {
    const __m512i m4 = _mm512_set1_epi8(0x0f), m2 = _mm512_set1_epi8(3);
    for (int h = 0; h < 2; ++h) {
      // Element 32k + l of the half: ql[(k & 1) * 32 + l] nibble (low for k < 2), qh[l] bits 2k.
      const __m512i ql = _mm512_loadu_si512(b.ql + 64 * h);
      const __m512i qhz = halves_shifted(b.qh + 32 * h, 2);
      u.q[2 * h] = _mm512_or_si512(_mm512_and_si512(ql, m4), _mm512_slli_epi16(_mm512_and_si512(qhz, m2), 4));
      u.q[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4),
                                       _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qhz, 4), m2), 4));
    }
    set_scales(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b.scales)), u);
    u.d = _cvtsh_ss(b.d);
  }
};

struct KFmtQ3_K : KSigned16<2> {
  using Block = BlockQ3_K;
  static void unpack(const Block& b, Unpacked& u) {
    // The 2-bit field plus 4 where bit 4h + j of hmask[l] is set.
    const __m512i hm = halves_shifted(b.hmask, 1), one = _mm512_set1_epi8(1);
    for (int k = 0; k < 4; ++k) {
      const __m512i high = _mm512_and_si512(_mm512_srli_epi16(hm, 4 * (k / 2) + 2 * (k % 2)), one);
      u.q[k] = _mm512_or_si512(two_bits(b.qs, k), _mm512_slli_epi16(high, 2));
    }
    uint32_t w[4];
    q3k_scales_biased(b.scales, w);
    const __m128i biased = _mm_setr_epi32(static_cast<int>(w[0]), static_cast<int>(w[1]), static_cast<int>(w[2]),
                                          static_cast<int>(w[3]));
    set_scales(_mm_sub_epi8(biased, _mm_set1_epi8(32)), u);
    u.d = _cvtsh_ss(b.d);
  }
};

// One weight row against T tokens; rows outer, so a row stays in L1 while the tokens stream by.
template <class F, int T>
void kquant_tile(const MatmulArgs& a, const ActLayoutK& L, const uint8_t* row, int64_t t0, OutputCollector& out,
                 int64_t r) {
  const auto* blocks = reinterpret_cast<const typename F::Block*>(row);
  __m512 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
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
  for (int t = 0; t < T; ++t) out.add(acc[t], a.y + (t0 + t) * a.w.n_out + r);
}

template <class F>
void matmul_kquant(const MatmulArgs& a, int64_t r0, int64_t r1) {
  const ActLayoutK L(a.w.n_in);
  OutputCollector out;
  for (int64_t t0 = 0; t0 < a.n_tokens; t0 += kGemmTokenBlock) {
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* row = a.w.data + r * a.w_row_bytes;
      prefetch_ahead(a.w.data, a.w_row_bytes, r, r1);
      for_token_tiles(t0, std::min(a.n_tokens, t0 + kGemmTokenBlock),
                      [&](auto T, int64_t t) { kquant_tile<F, decltype(T)::value>(a, L, row, t, out, r); });
    }
  }
  out.flush();
}

// ---- F32 / F16 / BF16: f32 FMA, 16 elements at a time, masked tail ----

struct FFmtF32 {
  static __m512 load(const uint8_t* row, int64_t i, __mmask16 m) {
    return _mm512_maskz_loadu_ps(m, reinterpret_cast<const float*>(row) + i);
  }
};
struct FFmtF16 {
  static __m512 load(const uint8_t* row, int64_t i, __mmask16 m) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, row + 2 * i));
  }
};
struct FFmtBF16 {
  static __m512 load(const uint8_t* row, int64_t i, __mmask16 m) {
    const __m512i u = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, row + 2 * i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
  }
};

template <class F>
void gemv_float(const MatmulArgs& a, int64_t r0, int64_t r1) {
  const int64_t n = a.w.n_in;
  OutputCollector out;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = a.w.data + r * a.w_row_bytes;
    prefetch_ahead(a.w.data, a.w_row_bytes, r, r1);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 m = lane_mask(n - i);
      acc = _mm512_fmadd_ps(F::load(row, i, m), _mm512_maskz_loadu_ps(m, a.x + i), acc);
    }
    out.add(acc, a.y + r);
  }
  out.flush();
}

template <class F, int T>
void float_tile(const MatmulArgs& a, int64_t r, int n_rows, int64_t t0) {
  const int64_t n = a.w.n_in;
  const uint8_t* rows[4];
  for (int i = 0; i < 4; ++i) rows[i] = a.w.data + (r + std::min(i, n_rows - 1)) * a.w_row_bytes;
  __m512 acc[4][T];
  for (int i = 0; i < 4; ++i)
    for (int t = 0; t < T; ++t) acc[i][t] = _mm512_setzero_ps();
  for (int64_t k = 0; k < n; k += 16) {
    const __mmask16 m = lane_mask(n - k);
    for (int i = 0; i < 4; ++i) {
      const __m512 w = F::load(rows[i], k, m);
      for (int t = 0; t < T; ++t)
        acc[i][t] = _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(m, a.x + (t0 + t) * n + k), acc[i][t]);
    }
  }
  __m512 v[16];
  for (int t = 0; t < 4; ++t)
    for (int i = 0; i < 4; ++i) v[4 * t + i] = t < T ? acc[i][t] : _mm512_setzero_ps();
  store_tile(reduce16(v), T, n_rows, a.y + t0 * a.w.n_out + r, a.w.n_out);
}

template <class F>
void matmul_float(const MatmulArgs& a, int64_t r0, int64_t r1) {
  if (a.n_tokens == 1) return gemv_float<F>(a, r0, r1);
  for (int64_t t0 = 0; t0 < a.n_tokens; t0 += kGemmTokenBlock) {
    for (int64_t r = r0; r < r1; r += 4) {
      // A tile past the last row repeats the last row (outputs not stored) rather than reading
      // beyond the matrix.
      const int n_rows = static_cast<int>(std::min<int64_t>(4, r1 - r));
      for_token_tiles(t0, std::min(a.n_tokens, t0 + kGemmTokenBlock),
                      [&](auto T, int64_t t) { float_tile<F, decltype(T)::value>(a, r, n_rows, t); });
    }
  }
}

}  // namespace

void avx512_quantize_act_k(const float* x, int64_t n_in, bool bits8, uint8_t* dst) {
  const ActLayoutK L(n_in);
  const auto [q1, q2, d, bsums1, bsums2] = L.planes(dst);
  const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  for (int64_t b = 0; b < L.nsb; ++b) {
    const float* xb = x + b * QK_K;
    __m512 mx = _mm512_setzero_ps();
    for (int k = 0; k < QK_K / 16; ++k) mx = _mm512_max_ps(mx, _mm512_and_ps(_mm512_loadu_ps(xb + 16 * k), abs_mask));
    const float amax = _mm512_reduce_max_ps(mx);
    const __m512 id = _mm512_set1_ps(act_inverse_scale(amax, bits8));
    d[b] = act_scale(amax);
    for (int k = 0; k < QK_K / 16; ++k) {
      const int64_t e = b * QK_K + 16 * k;
      quantize16(xb + 16 * k, id, bits8, q1 + e, q2 + e);
      const __m128i v1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q1 + e));
      const __m128i v2 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q2 + e));
      bsums1[e / 16] = static_cast<int16_t>(_mm512_reduce_add_epi32(_mm512_cvtepi8_epi32(v1)));
      bsums2[e / 16] = static_cast<int16_t>(_mm512_reduce_add_epi32(_mm512_cvtepi8_epi32(v2)));
    }
  }
}

void avx512_matmul_other(const MatmulArgs& a, int64_t r0, int64_t r1) {
  switch (a.w.type.storage) {
    case GgmlType::Q2_K: matmul_kquant<KFmtQ2_K>(a, r0, r1); break;
    case GgmlType::Q3_K: matmul_kquant<KFmtQ3_K>(a, r0, r1); break;
    case GgmlType::Q4_K: matmul_kquant<KFmtQ4_K>(a, r0, r1); break;
    case GgmlType::Q5_K: matmul_kquant<KFmtQ5_K>(a, r0, r1); break;
    case GgmlType::Q6_K: matmul_kquant<KFmtQ6_K>(a, r0, r1); break;
    case GgmlType::F32: matmul_float<FFmtF32>(a, r0, r1); break;
    case GgmlType::F16: matmul_float<FFmtF16>(a, r0, r1); break;
    case GgmlType::BF16: matmul_float<FFmtBF16>(a, r0, r1); break;
    default: break;
  }
}

}  // namespace kestrel::cpu::detail

#endif  // __x86_64__
