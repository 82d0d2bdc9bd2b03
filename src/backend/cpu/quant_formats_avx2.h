// Weight formats for the AVX2 kernels (matmul_avx2.cpp describes the scheme): how each block
// type turns into unsigned quants for vpmaddubsw plus per-block (32-element types) or
// per-sub-block (K-quants) scales and offsets. Include only from *_avx2.cpp (compiled with the
// AVX2 flags); all definitions have internal linkage, so no AVX2 code can reach another
// translation unit through the linker's choice of one inline definition.
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "backend/cpu/matmul_kernels.h"

namespace kestrel::cpu::detail {
namespace {

inline float load_fp16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// The f16 pair at p, p + 2 (a block's d and m) with one load and one conversion.
inline void load_fp16_pair(const uint8_t* p, float& a, float& b) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(v)));
  a = _mm_cvtss_f32(f);
  b = _mm_cvtss_f32(_mm_movehdup_ps(f));
}

// 255 * hi + lo in int32 lanes (see quantize_block_q16).
inline __m256i combine_planes(__m256i hi, __m256i lo) {
  return _mm256_add_epi32(_mm256_sub_epi32(_mm256_slli_epi32(hi, 8), hi), lo);
}

// 255 * hi + lo per lane, in f32 (K-quant sums can exceed int32 when combined).
inline __m256 planes_f32(__m256i hi, __m256i lo) {
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_set1_ps(static_cast<float>(kActSplit)), _mm256_cvtepi32_ps(lo));
}

inline __m256i load_a(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// ---- 32-element block formats ----
// Each gives kBlockBytes, quants(blk) (the block's 32 quants in element order), dc(blk, d, c):
// the scale d and the offset c with w = d * u + c (kHasOffset: c != 0; the kernel adds c * s,
// s = dx * sum(Q)), and prep(): the quants as the operands of dot16().
//
// Every format multiplies the 16-bit activations Q = 255 q1 + q2 directly with vpmaddwd, against
// the quants widened to int16: two multiplies per block and token where the two int8 planes took
// four (vpmaddubsw on each plane, then vpmaddwd to widen and weight them). On CPUs that issue all
// integer multiplies on one port (AMD Zen 1 runs each 256-bit one as two halves there) the
// multiplies bound both the GEMV and the GEMM, so this halves their cost. The activation block
// holds Q of its 16 even elements, then of its 16 odd ones (see quantize_act); prep() splits the
// quants the same way (the low and high byte of each 16-bit word), so lane j of the dot product
// sums elements 4j..4j+3. The products stay far inside int32: |u Q| <= 255 * 32512 for Q8_0's
// signed quants, 31 * 32512 for the unsigned ones.

struct Prepared {
  __m256i u, v;  // the block's even and odd elements as int16
};

// 16 bytes of nibbles -> 32 quants: element l < 16 is the low nibble of byte l, l + 16 the high.
inline __m256i nibbles(const uint8_t* qs) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i m4 = _mm_set1_epi8(0x0f);
  return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_and_si128(q, m4)), _mm_and_si128(_mm_srli_epi16(q, 4), m4), 1);
}

// Q5_0 / Q5_1 5th bits: bit i of the little-endian uint32 at qh, as 0x10 in byte i.
inline __m256i fifth_bits(const uint8_t* qh) {
  uint32_t h;
  std::memcpy(&h, qh, 4);
  // Byte i takes byte i / 8 of h (vpshufb works per 128-bit lane; both lanes hold h) and keeps
  // bit i % 8 of it.
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(h)),
      _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL, 0x0303030303030303LL));
  const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
}

// sum(w * Q) of a block in 8 lanes; q16: the block's 16 even-element Q, then 16 odd-element Q.
inline __m256i dot16(const Prepared& p, const int16_t* q16) {
  return _mm256_add_epi32(_mm256_madd_epi16(p.u, _mm256_load_si256(reinterpret_cast<const __m256i*>(q16))),
                          _mm256_madd_epi16(p.v, _mm256_load_si256(reinterpret_cast<const __m256i*>(q16 + 16))));
}

struct A2Q4_0 {
  static constexpr int kBlockBytes = sizeof(BlockQ4_0);
  static constexpr bool kHasOffset = true;
  static __m256i quants(const uint8_t* blk) { return nibbles(blk + offsetof(BlockQ4_0, qs)); }
  // The block's scale d and offset c.
  static void dc(const uint8_t* blk, float& d, float& c) { d = load_fp16(blk), c = -8.0f * d; }
  // Unsigned quants (< 32): zero-extended bytes.
  static Prepared prep(__m256i q) { return {_mm256_and_si256(q, _mm256_set1_epi16(0x00ff)), _mm256_srli_epi16(q, 8)}; }
};

struct A2Q4_1 : A2Q4_0 {
  static constexpr int kBlockBytes = sizeof(BlockQ4_1);
  static __m256i quants(const uint8_t* blk) { return nibbles(blk + offsetof(BlockQ4_1, qs)); }
  static void dc(const uint8_t* blk, float& d, float& c) {
    static_assert(offsetof(BlockQ4_1, m) == 2);
    load_fp16_pair(blk, d, c);
  }
};

struct A2Q5_0 : A2Q4_0 {
  static constexpr int kBlockBytes = sizeof(BlockQ5_0);
  static __m256i quants(const uint8_t* blk) {
    return _mm256_or_si256(nibbles(blk + offsetof(BlockQ5_0, qs)), fifth_bits(blk + offsetof(BlockQ5_0, qh)));
  }
  static void dc(const uint8_t* blk, float& d, float& c) { d = load_fp16(blk), c = -16.0f * d; }
};

struct A2Q5_1 : A2Q4_0 {
  static constexpr int kBlockBytes = sizeof(BlockQ5_1);
  static __m256i quants(const uint8_t* blk) {
    return _mm256_or_si256(nibbles(blk + offsetof(BlockQ5_1, qs)), fifth_bits(blk + offsetof(BlockQ5_1, qh)));
  }
  static void dc(const uint8_t* blk, float& d, float& c) {
    static_assert(offsetof(BlockQ5_1, m) == 2);
    load_fp16_pair(blk, d, c);
  }
};

struct A2Q8_0 {
  static constexpr int kBlockBytes = sizeof(BlockQ8_0);
  static constexpr bool kHasOffset = false;
  static __m256i quants(const uint8_t* blk) { return load32(blk + offsetof(BlockQ8_0, qs)); }
  static void dc(const uint8_t* blk, float& d, float& c) { d = load_fp16(blk), c = 0.0f; }
  // Signed quants: sign-extended bytes.
  static Prepared prep(__m256i q) {
    return {_mm256_srai_epi16(_mm256_slli_epi16(q, 8), 8), _mm256_srai_epi16(q, 8)};
  }
};

// ---- K-quants ----
// Each gives Block, Unpacked, unpack(block, unpacked) (once per super-block and row) and
// dot(unpacked, acts, acc): acc plus the super-block's contribution, spread over 8 lanes. The
// quants are unpacked to 8 registers of 32 unsigned values in element order (u < 32, so
// vpmaddubsw cannot saturate); vpmaddwd then applies a s16 scale per pair of products.

// One token's activations for one super-block.
struct KActs {
  const int8_t *q1, *q2;
  const int16_t *bsums1, *bsums2;
  float d;
};

// Scale and min formats (Q4_K, Q5_K, Q2_K): w = d * sc * u - dmin * m per sub-block.
struct A2UnpackedScaleMin {
  __m256i q[8], sc[8];  // quants of elements 32k..32k+31; s16 scale of each vpmaddubsw lane
  __m256i m16;          // s16 min of each 16-element activation sum (bsum)
  float d, dmin;
};

// The 8-bit scales of two 16-element sub-blocks as the s16 multipliers of one register's
// vpmaddubsw lanes (lanes 0..7: the first sub-block, 8..15: the second).
inline __m256i pair_scales(int lo, int hi) {
  return _mm256_blend_epi32(_mm256_set1_epi16(static_cast<short>(lo)), _mm256_set1_epi16(static_cast<short>(hi)), 0xf0);
}

struct A2ScaleMin {
  using Unpacked = A2UnpackedScaleMin;
  static __m256i isum(const Unpacked& u, const int8_t* aq) {
    __m256i iacc = _mm256_setzero_si256();
    for (int k = 0; k < 8; ++k)
      iacc = _mm256_add_epi32(iacc, _mm256_madd_epi16(_mm256_maddubs_epi16(u.q[k], load_a(aq + 32 * k)), u.sc[k]));
    return iacc;
  }
  static __m256i imin(const Unpacked& u, const int16_t* bsums) {
    return _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bsums)), u.m16);
  }
  static __m256 dot(const Unpacked& u, const KActs& a, __m256 acc) {
    const __m256 isums = planes_f32(isum(u, a.q1), isum(u, a.q2));
    const __m256 imins = planes_f32(imin(u, a.bsums1), imin(u, a.bsums2));
    acc = _mm256_fmadd_ps(isums, _mm256_set1_ps(u.d * a.d), acc);
    return _mm256_fmadd_ps(imins, _mm256_set1_ps(-(u.dmin * a.d)), acc);
  }
  // Q4_K / Q5_K: the 6-bit scales and mins of the 32-element sub-blocks, and d, dmin.
  template <class B>
  static void unpack_scales_k4(const B& b, Unpacked& u) {
    uint64_t sc, mn;
    q4k_scales_mins(b.scales, &sc, &mn);
    for (int j = 0; j < 8; ++j) u.sc[j] = _mm256_set1_epi16(static_cast<short>((sc >> (8 * j)) & 0xff));
    // Min j applies to bsums 2j and 2j + 1.
    const __m128i m8 = _mm_cvtsi64_si128(static_cast<long long>(mn));
    u.m16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8));
    u.d = _cvtsh_ss(b.d);
    u.dmin = _cvtsh_ss(b.dmin);
  }
};

struct A2Q4_K : A2ScaleMin {
  using Block = BlockQ4_K;
  static void unpack(const Block& b, Unpacked& u) {
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    for (int j = 0; j < 4; ++j) {  // 32 bytes of qs: low nibbles are sub-block 2j, high 2j+1
      const __m256i v = load32(b.qs + 32 * j);
      u.q[2 * j] = _mm256_and_si256(v, m4);
      u.q[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    }
    unpack_scales_k4(b, u);
  }
};

struct A2Q5_K : A2ScaleMin {
  using Block = BlockQ5_K;
  static void unpack(const Block& b, Unpacked& u) {
    const __m256i m4 = _mm256_set1_epi8(0x0f), one = _mm256_set1_epi8(1);
    const __m256i qh = load32(b.qh);
    // Sub-block s (elements 32s..32s+31): nibbles as in Q4_K, 5th bit = bit s of qh[l].
    auto fifth = [&](int s) { return _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, s), one), 4); };
    for (int j = 0; j < 4; ++j) {
      const __m256i v = load32(b.qs + 32 * j);
      u.q[2 * j] = _mm256_or_si256(_mm256_and_si256(v, m4), fifth(2 * j));
      u.q[2 * j + 1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4), fifth(2 * j + 1));
    }
    unpack_scales_k4(b, u);
  }
};

struct A2Q2_K : A2ScaleMin {
  using Block = BlockQ2_K;
  static void unpack(const Block& b, Unpacked& u) {
    const __m256i m2 = _mm256_set1_epi8(3);
    for (int h = 0; h < 2; ++h) {  // element 128h + 32j + l: bits 2j of qs[32h + l]
      const __m256i v = load32(b.qs + 32 * h);
      for (int j = 0; j < 4; ++j) u.q[4 * h + j] = _mm256_and_si256(_mm256_srli_epi16(v, 2 * j), m2);
    }
    for (int k = 0; k < 8; ++k) u.sc[k] = pair_scales(b.scales[2 * k] & 0x0f, b.scales[2 * k + 1] & 0x0f);
    const __m128i s = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b.scales));
    u.m16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(s, 4), _mm_set1_epi8(0x0f)));
    u.d = _cvtsh_ss(b.d);
    u.dmin = _cvtsh_ss(b.dmin);
  }
};

// Signed-scale formats (Q6_K, Q3_K): w = d * sc_j * (u - 2^kShift) per 16-element sub-block j.
struct A2UnpackedSigned16 {
  __m256i q[8], sc[8];  // quants (u) of elements 32k..32k+31; s16 scales (sub-blocks 2k, 2k+1)
  __m256i sc16;         // the 16 scales as s16
  float d;
};

template <int kShift>
struct A2Signed16 {
  using Unpacked = A2UnpackedSigned16;
  static void set_scales(const int8_t sc[16], Unpacked& u) {
    u.sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)));
    for (int k = 0; k < 8; ++k) u.sc[k] = pair_scales(sc[2 * k], sc[2 * k + 1]);
  }
  // The same from the 16 scales as s16 lanes, without a trip through memory: dword k of sc16 is
  // (sc_2k, sc_2k+1); broadcast it, then spread its low word over the lower 128-bit lane and its
  // high word over the upper one.
  static void set_scales(__m256i sc16, Unpacked& u) {
    u.sc16 = sc16;
    const __m256i spread = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3,
                                            2, 3, 2, 3, 2, 3);
    for (int k = 0; k < 8; ++k)
      u.sc[k] = _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(sc16, _mm256_set1_epi32(k)), spread);
  }
  static __m256i isum(const Unpacked& u, const int8_t* aq, const int16_t* bsums) {
    __m256i iacc = _mm256_setzero_si256();
    for (int k = 0; k < 8; ++k)
      iacc = _mm256_add_epi32(iacc, _mm256_madd_epi16(_mm256_maddubs_epi16(u.q[k], load_a(aq + 32 * k)), u.sc[k]));
    // The unpacked quants are value + 2^kShift: subtract 2^kShift * sum_j scale_j * bsum_j.
    const __m256i ioff = _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bsums)), u.sc16);
    return _mm256_sub_epi32(iacc, _mm256_slli_epi32(ioff, kShift));
  }
  static __m256 dot(const Unpacked& u, const KActs& a, __m256 acc) {
    const __m256 isums = planes_f32(isum(u, a.q1, a.bsums1), isum(u, a.q2, a.bsums2));
    return _mm256_fmadd_ps(isums, _mm256_set1_ps(u.d * a.d), acc);
  }
};

struct A2Q6_K : A2Signed16<5> {
  using Block = BlockQ6_K;
  static void unpack(const Block& b, Unpacked& u) {
    const __m256i m4 = _mm256_set1_epi8(0x0f), m2 = _mm256_set1_epi8(3);
    for (int h = 0; h < 2; ++h) {
      // Element 32k + l of the half: ql[(k & 1) * 32 + l] nibble (low for k < 2), qh[l] bits 2k.
      const __m256i ql0 = load32(b.ql + 64 * h);
      const __m256i ql1 = load32(b.ql + 64 * h + 32);
      const __m256i qh = load32(b.qh + 32 * h);
      const __m256i lo4[4] = {_mm256_and_si256(ql0, m4), _mm256_and_si256(ql1, m4),
                              _mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                              _mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4)};
      for (int k = 0; k < 4; ++k) {
        const __m256i hi2 = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * k), m2);
        u.q[4 * h + k] = _mm256_or_si256(lo4[k], _mm256_slli_epi16(hi2, 4));
      }
    }
    set_scales(b.scales, u);
    u.d = _cvtsh_ss(b.d);
  }
};

struct A2Q3_K : A2Signed16<2> {
  using Block = BlockQ3_K;
  static void unpack(const Block& b, Unpacked& u) {
    const __m256i m2 = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
    const __m256i hm = load32(b.hmask);
    for (int h = 0; h < 2; ++h) {
      // Element 128h + 32j + l: bits 2j of qs[32h + l], plus 4 where bit 4h + j of hmask[l] is set.
      const __m256i v = load32(b.qs + 32 * h);
      for (int j = 0; j < 4; ++j) {
        const __m256i high = _mm256_and_si256(_mm256_srli_epi16(hm, 4 * h + j), one);
        u.q[4 * h + j] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 2 * j), m2), _mm256_slli_epi16(high, 2));
      }
    }
    uint32_t w[4];
    q3k_scales_biased(b.scales, w);
    const __m128i sc8 = _mm_sub_epi8(_mm_setr_epi32(static_cast<int>(w[0]), static_cast<int>(w[1]), static_cast<int>(w[2]),
                                                    static_cast<int>(w[3])),
                                     _mm_set1_epi8(32));
    set_scales(_mm256_cvtepi8_epi16(sc8), u);
    u.d = _cvtsh_ss(b.d);
  }
};

}  // namespace
}  // namespace kestrel::cpu::detail

#endif  // __x86_64__
