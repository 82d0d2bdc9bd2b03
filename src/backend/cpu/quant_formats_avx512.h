// 32-element block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) for the AVX-512 kernels: the activation chunk
// layout and quantizer, the weight loaders and the per-chunk arithmetic that every AVX-512 / AMX path shares
// (matmul_avx512.cpp describes the scheme). Include only from *_avx512.cpp / *_amx.cpp; all
// definitions have internal linkage (see simd_avx512.h).
#pragma once

#if defined(__x86_64__)
#include "backend/cpu/simd_avx512.h"

#include <algorithm>
#include <cstddef>
#include <cstring>

#include "backend/cpu/matmul_kernels.h"

namespace kestrel::cpu::detail {
namespace {

// ---------------------------------------------------------------------------------------------
// Activations for 32-blocks

// Per chunk of 16 blocks: 512 bytes of plane q1, then 512 of plane q2 (same arrangement), so
// one token's activations are [nch][2][512] int8 | f32 dx[nch][16] | f32 s[nch][16].
constexpr int64_t kActChunkBytes = 1024;
constexpr int64_t kActPlane2 = 512;  // offset of q2 in a chunk

struct Layout16 {
  int64_t nb, nch;
  size_t dx_off, s_off, bytes;
  explicit Layout16(int64_t n_in)
      : nb(n_in / 32), nch((nb + 15) / 16), dx_off(static_cast<size_t>(nch * kActChunkBytes)),
        s_off(dx_off + static_cast<size_t>(nch) * 64), bytes(s_off + static_cast<size_t>(nch) * 64) {}
};

inline bool is_tail_chunk(const Layout16& L, int64_t c) { return c == L.nch - 1 && L.nb % 16 != 0; }

// 255 * hi + lo per int32 lane: the exact sum over both planes (see quantize_block_q16).
inline __m512i combine_planes(__m512i hi, __m512i lo) {
  return _mm512_add_epi32(_mm512_sub_epi32(_mm512_slli_epi32(hi, 8), hi), lo);
}

// Quantizes 16 elements with inverse scale id (the shared rounding, quantize_block_q16): Q, and
// the planes q1, q2 as 16 bytes each.
inline __m512i quantize16(const float* x, __m512 id, bool bits8, int8_t* q1, int8_t* q2) {
  __m512i Q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x), id));
  if (bits8) Q = combine_planes(Q, _mm512_setzero_si512());
  const __m512i hi = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_cvtepi32_ps(Q), _mm512_set1_ps(kInvActSplit)));
  const __m512i lo = _mm512_sub_epi32(Q, combine_planes(hi, _mm512_setzero_si512()));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q1), _mm512_cvtepi32_epi8(hi));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q2), _mm512_cvtepi32_epi8(lo));
  return Q;
}

// Quantizes one 32-element block: the planes as 32 bytes each in element order, d, and
// s = d * sum(Q).
inline void quantize_block32(const float* x, bool bits8, int8_t q1[32], int8_t q2[32], float& d, float& s) {
  const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  const float amax = _mm512_reduce_max_ps(
      _mm512_max_ps(_mm512_and_ps(_mm512_loadu_ps(x), abs_mask), _mm512_and_ps(_mm512_loadu_ps(x + 16), abs_mask)));
  const __m512 id = _mm512_set1_ps(act_inverse_scale(amax, bits8));
  const __m512i Q0 = quantize16(x, id, bits8, q1, q2);
  const __m512i Q1 = quantize16(x + 16, id, bits8, q1 + 16, q2 + 16);
  d = act_scale(amax);
  s = d * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(Q0, Q1)));
}

// ---------------------------------------------------------------------------------------------
// Weights. Each format provides:
//   load_chunk(p, nblk, Chunk&): up to 16 blocks -> transposed unsigned quants q[8] (GEMM) and
//     the raw scale dwords sc (lane j: block j's d in the low half; Q4_1: m in the high half),
//     by zmm gathers (Q4_1's full chunks by permutes); lanes past nblk are zero (masked gathers
//     stay inside the row).
//   load_group(p, nblk, Group&): up to 4 contiguous blocks -> lo / hi unsigned quants in the
//     grouped order (GEMV) and the 4 scale dwords; masked loads keep a short group in the row.
//   scales(sc, dw, c): dw and c (the offset term) per lane as f32.

struct Chunk {
  __m512i q[8];
  __m512i sc;
};

struct Group {
  __m512i lo, hi;
  __m128i sc;
};

inline __m512i block_offsets(int block_bytes) {
  return _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                            _mm512_set1_epi32(block_bytes));
}

inline __m512i gather(__mmask16 m, __m512i idx, const uint8_t* p) {
  return _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, idx, p, 1);
}

// The fp16 in the low (hi = false) or high half of each dword, as f32.
inline __m512 half_to_f32(__m512i v, bool hi) {
  return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(hi ? _mm512_srli_epi32(v, 16) : v));
}

// Q4_0 / Q4_1 nibbles: element e < 16 is the low nibble of byte e, e >= 16 the high nibble of
// byte e - 16, so dword k of the 16 quant bytes gives registers k (low) and k + 4 (high).
inline void split_nibbles(const __m512i raw[4], __m512i q[8]) {
  const __m512i m4 = _mm512_set1_epi8(0x0f);
  for (int k = 0; k < 4; ++k) {
    q[k] = _mm512_and_si512(raw[k], m4);
    q[k + 4] = _mm512_and_si512(_mm512_srli_epi16(raw[k], 4), m4);
  }
}

inline Group nibble_group(__m512i qs, __m128i sc) {
  const __m512i m4 = _mm512_set1_epi8(0x0f);
  return {_mm512_and_si512(qs, m4), _mm512_and_si512(_mm512_srli_epi16(qs, 4), m4), sc};
}

struct FmtQ4_0 {
  static constexpr int kBlockBytes = sizeof(BlockQ4_0);
  static void load_chunk(const uint8_t* p, int nblk, Chunk& ch) {
    const __mmask16 m = lane_mask(nblk);
    const __m512i idx = block_offsets(kBlockBytes);
    __m512i raw[4];
    for (int k = 0; k < 4; ++k) raw[k] = gather(m, idx, p + 2 + 4 * k);
    split_nibbles(raw, ch.q);
    ch.sc = gather(m, idx, p);
  }
  static Group load_group(const uint8_t* p, int nblk) {
    __m512i v0, v1;
    if (nblk == 4) {
      v0 = _mm512_loadu_si512(p);
      v1 = _mm512_maskz_loadu_epi8(0xff, p + 64);
    } else {
      v0 = _mm512_maskz_loadu_epi8(byte_mask(kBlockBytes * nblk), p);
      v1 = _mm512_setzero_si512();
    }
    // Block j is 9 words from word 9j: d, then 8 words of nibbles.
    alignas(64) static constexpr int16_t kQsWords[32] = {1,  2,  3,  4,  5,  6,  7,  8,  10, 11, 12,
                                                         13, 14, 15, 16, 17, 19, 20, 21, 22, 23, 24,
                                                         25, 26, 28, 29, 30, 31, 32, 33, 34, 35};
    alignas(64) static constexpr int16_t kDWords[32] = {0, 0, 9, 9, 18, 18, 27, 27};
    return nibble_group(_mm512_permutex2var_epi16(v0, _mm512_load_si512(kQsWords), v1),
                        _mm512_castsi512_si128(_mm512_permutexvar_epi16(_mm512_load_si512(kDWords), v0)));
  }
  static void scales(__m512i sc, __m512& dw, __m512& c) {
    dw = half_to_f32(sc, false);
    c = _mm512_mul_ps(dw, _mm512_set1_ps(-8.0f));
  }
};

// Dword 5j + k of 16 consecutive 20-byte (5-dword) blocks in lane j, from the 80 dwords in
// v[0..5): one full chunk of Q4_1 transposed with three permutes and two blends instead of a
// 16-lane gather (which costs a load per lane).
template <int k>
inline __m512i dword_of_5(const __m512i v[5]) {
  const __m512i idx = _mm512_add_epi32(_mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                          _mm512_set1_epi32(5)),
                                       _mm512_set1_epi32(k));
  constexpr auto lanes_from = [](int lo) {
    unsigned m = 0;
    for (int j = 0; j < 16; ++j) m |= (5 * j + k >= lo ? 1u : 0u) << j;
    return static_cast<__mmask16>(m);
  };
  // Both permutes read the index's low 5 bits and vpermd its low 4, so one index serves all three.
  const __m512i p01 = _mm512_permutex2var_epi32(v[0], idx, v[1]);
  const __m512i p23 = _mm512_permutex2var_epi32(v[2], idx, v[3]);
  const __m512i p4 = _mm512_permutexvar_epi32(idx, v[4]);
  return _mm512_mask_blend_epi32(lanes_from(64), _mm512_mask_blend_epi32(lanes_from(32), p01, p23), p4);
}

struct FmtQ4_1 {
  static constexpr int kBlockBytes = sizeof(BlockQ4_1);
  static void load_chunk(const uint8_t* p, int nblk, Chunk& ch) {
    if (nblk == 16) {
      __m512i v[5], raw[4];
      for (int i = 0; i < 5; ++i) v[i] = _mm512_loadu_si512(p + 64 * i);
      raw[0] = dword_of_5<1>(v);
      raw[1] = dword_of_5<2>(v);
      raw[2] = dword_of_5<3>(v);
      raw[3] = dword_of_5<4>(v);
      split_nibbles(raw, ch.q);
      ch.sc = dword_of_5<0>(v);
      return;
    }
    const __mmask16 m = lane_mask(nblk);
    const __m512i idx = block_offsets(kBlockBytes);
    __m512i raw[4];
    for (int k = 0; k < 4; ++k) raw[k] = gather(m, idx, p + 4 + 4 * k);
    split_nibbles(raw, ch.q);
    ch.sc = gather(m, idx, p);
  }
  static Group load_group(const uint8_t* p, int nblk) {
    __m512i v0, v1;
    if (nblk == 4) {
      v0 = _mm512_loadu_si512(p);
      v1 = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 64)));
    } else {
      v0 = _mm512_maskz_loadu_epi8(byte_mask(kBlockBytes * nblk), p);
      v1 = _mm512_setzero_si512();
    }
    // Block j is 5 dwords from dword 5j: (d, m), then 4 dwords of nibbles.
    const __m512i idx = _mm512_setr_epi32(1, 2, 3, 4, 6, 7, 8, 9, 11, 12, 13, 14, 16, 17, 18, 19);
    const __m512i dm = _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 5, 10, 15, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), v0);
    return nibble_group(_mm512_permutex2var_epi32(v0, idx, v1), _mm512_castsi512_si128(dm));
  }
  static void scales(__m512i sc, __m512& dw, __m512& c) {
    dw = half_to_f32(sc, false);
    c = half_to_f32(sc, true);
  }
};

// Q5_0 / Q5_1 5th bits (bit i of a block's little-endian 32-bit qh: element i) as 0x10 in the
// quant bytes. Transposed chunk: qh holds each block's qh in its lane, register k of q holds
// elements 4k..4k+3 (split_nibbles), so byte b of lane j gets bit 4k + b of qh_j.
inline void add_fifth_bits(__m512i qh, __m512i q[8]) {
  const __m512i nibble = _mm512_set1_epi32(0x0f), select = _mm512_set1_epi32(0x08040201);
  const __m512i b5 = _mm512_set1_epi8(0x10);
  for (int k = 0; k < 8; ++k) {
    __m512i t = _mm512_and_si512(_mm512_srli_epi32(qh, 4 * k), nibble);  // the 4 bits in every byte
    t = _mm512_or_si512(t, _mm512_slli_epi32(t, 8));
    t = _mm512_or_si512(t, _mm512_slli_epi32(t, 16));
    q[k] = _mm512_or_si512(q[k], _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(t, select), b5));
  }
}

// Grouped: lo / hi hold elements 0..15 / 16..31 of block j at bytes 16j.., so their 64 bits are the
// low / high 16 bits of the four qh (dwords of qh4) side by side.
inline Group add_fifth_bits(Group g, __m128i qh4) {
  const __m128i halves = _mm_shuffle_epi8(qh4, _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15));
  const __m512i b5 = _mm512_set1_epi8(0x10);
  g.lo = _mm512_or_si512(g.lo, _mm512_maskz_mov_epi8(static_cast<__mmask64>(_mm_cvtsi128_si64(halves)), b5));
  g.hi = _mm512_or_si512(g.hi, _mm512_maskz_mov_epi8(static_cast<__mmask64>(_mm_extract_epi64(halves, 1)), b5));
  return g;
}

// Up to 128 bytes from p, zero past n: two registers.
inline void load_upto128(const uint8_t* p, int n, __m512i& v0, __m512i& v1) {
  v0 = _mm512_maskz_loadu_epi8(byte_mask(n), p);
  v1 = n > 64 ? _mm512_maskz_loadu_epi8(byte_mask(n - 64), p + 64) : _mm512_setzero_si512();
}

struct FmtQ5_0 {
  static constexpr int kBlockBytes = sizeof(BlockQ5_0);
  static void load_chunk(const uint8_t* p, int nblk, Chunk& ch) {
    const __mmask16 m = lane_mask(nblk);
    const __m512i idx = block_offsets(kBlockBytes);
    __m512i raw[4];
    for (int k = 0; k < 4; ++k) raw[k] = gather(m, idx, p + offsetof(BlockQ5_0, qs) + 4 * k);
    split_nibbles(raw, ch.q);
    add_fifth_bits(gather(m, idx, p + offsetof(BlockQ5_0, qh)), ch.q);
    ch.sc = gather(m, idx, p);  // d in the low half (the high half, qh, is ignored)
  }
  static Group load_group(const uint8_t* p, int nblk) {
    __m512i v0, v1;
    load_upto128(p, kBlockBytes * nblk, v0, v1);
    // Block j is 11 words from word 11j: d, 2 words of qh, 8 words of nibbles.
    alignas(64) static constexpr int16_t kQsWords[32] = {3,  4,  5,  6,  7,  8,  9,  10, 14, 15, 16,
                                                         17, 18, 19, 20, 21, 25, 26, 27, 28, 29, 30,
                                                         31, 32, 36, 37, 38, 39, 40, 41, 42, 43};
    alignas(64) static constexpr int16_t kDQhWords[32] = {0, 0, 11, 11, 22, 22, 33, 33, 1, 2, 12, 13, 23, 24, 34, 35};
    const __m512i dqh = _mm512_permutex2var_epi16(v0, _mm512_load_si512(kDQhWords), v1);
    const Group g = nibble_group(_mm512_permutex2var_epi16(v0, _mm512_load_si512(kQsWords), v1), _mm512_castsi512_si128(dqh));
    return add_fifth_bits(g, _mm512_extracti32x4_epi32(dqh, 1));
  }
  static void scales(__m512i sc, __m512& dw, __m512& c) {
    dw = half_to_f32(sc, false);
    c = _mm512_mul_ps(dw, _mm512_set1_ps(-16.0f));
  }
};

struct FmtQ5_1 {
  static constexpr int kBlockBytes = sizeof(BlockQ5_1);
  static void load_chunk(const uint8_t* p, int nblk, Chunk& ch) {
    const __mmask16 m = lane_mask(nblk);
    const __m512i idx = block_offsets(kBlockBytes);
    __m512i raw[4];
    for (int k = 0; k < 4; ++k) raw[k] = gather(m, idx, p + offsetof(BlockQ5_1, qs) + 4 * k);
    split_nibbles(raw, ch.q);
    add_fifth_bits(gather(m, idx, p + offsetof(BlockQ5_1, qh)), ch.q);
    ch.sc = gather(m, idx, p);
  }
  static Group load_group(const uint8_t* p, int nblk) {
    __m512i v0, v1;
    load_upto128(p, kBlockBytes * nblk, v0, v1);
    // Block j is 6 dwords from dword 6j: (d, m), qh, then 4 dwords of nibbles.
    const __m512i qs = _mm512_setr_epi32(2, 3, 4, 5, 8, 9, 10, 11, 14, 15, 16, 17, 20, 21, 22, 23);
    const __m512i dm_qh = _mm512_permutex2var_epi32(v0, _mm512_setr_epi32(0, 6, 12, 18, 1, 7, 13, 19, 0, 0, 0, 0, 0, 0, 0, 0), v1);
    const Group g = nibble_group(_mm512_permutex2var_epi32(v0, qs, v1), _mm512_castsi512_si128(dm_qh));
    return add_fifth_bits(g, _mm512_extracti32x4_epi32(dm_qh, 1));
  }
  static void scales(__m512i sc, __m512& dw, __m512& c) {
    dw = half_to_f32(sc, false);
    c = half_to_f32(sc, true);
  }
};

struct FmtQ8_0 {
  static constexpr int kBlockBytes = sizeof(BlockQ8_0);
  static void load_chunk(const uint8_t* p, int nblk, Chunk& ch) {
    const __mmask16 m = lane_mask(nblk);
    const __m512i idx = block_offsets(kBlockBytes);
    const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
    for (int k = 0; k < 8; ++k) ch.q[k] = _mm512_xor_si512(gather(m, idx, p + 2 + 4 * k), bias);
    ch.sc = gather(m, idx, p);
  }
  static Group load_group(const uint8_t* p, int nblk) {
    auto ld = [&](int j, int off) {
      return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + kBlockBytes * j + 2 + off));
    };
    __m512i lo, hi;
    __m128i sc;
    if (nblk == 4) {
      lo = _mm512_inserti32x4(_mm512_castsi128_si512(ld(0, 0)), ld(1, 0), 1);
      lo = _mm512_inserti32x4(_mm512_inserti32x4(lo, ld(2, 0), 2), ld(3, 0), 3);
      hi = _mm512_inserti32x4(_mm512_castsi128_si512(ld(0, 16)), ld(1, 16), 1);
      hi = _mm512_inserti32x4(_mm512_inserti32x4(hi, ld(2, 16), 2), ld(3, 16), 3);
      // d of block j is word 17j: words 0 and 17 in the first 64 bytes, 34 and 51 in the next.
      alignas(64) static constexpr int16_t kDWords[32] = {0, 0, 17, 17, 34, 34, 51, 51};
      const __m512i v0 = _mm512_loadu_si512(p), v1 = _mm512_loadu_si512(p + 64);
      sc = _mm512_castsi512_si128(_mm512_permutex2var_epi16(v0, _mm512_load_si512(kDWords), v1));
    } else {
      alignas(16) uint32_t d[4] = {};
      alignas(64) uint8_t l[64] = {}, h[64] = {};
      for (int j = 0; j < nblk; ++j) {
        std::memcpy(&d[j], p + kBlockBytes * j, 2);
        std::memcpy(l + 16 * j, p + kBlockBytes * j + 2, 16);
        std::memcpy(h + 16 * j, p + kBlockBytes * j + 18, 16);
      }
      // Missing blocks stay zero: after the +128 below their lanes meet zero activations, d = 0.
      lo = _mm512_load_si512(l);
      hi = _mm512_load_si512(h);
      sc = _mm_load_si128(reinterpret_cast<const __m128i*>(d));
    }
    const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
    return {_mm512_xor_si512(lo, bias), _mm512_xor_si512(hi, bias), sc};
  }
  static void scales(__m512i sc, __m512& dw, __m512& c) {
    dw = half_to_f32(sc, false);
    c = _mm512_mul_ps(dw, _mm512_set1_ps(-128.0f));
  }
};

// sum over the 8 registers of vpdpbusd(q[k], a[k]) for both planes of a transposed chunk at a,
// combined (exact integers, so the split into chains does not change the result).
inline __m512i chunk_isum(const __m512i q[8], const uint8_t* a) {
  __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
  __m512i t0 = _mm512_setzero_si512(), t1 = _mm512_setzero_si512();
  for (int k = 0; k < 8; k += 2) {
    s0 = _mm512_dpbusd_epi32(s0, q[k], _mm512_load_si512(a + 64 * k));
    s1 = _mm512_dpbusd_epi32(s1, q[k + 1], _mm512_load_si512(a + 64 * k + 64));
    t0 = _mm512_dpbusd_epi32(t0, q[k], _mm512_load_si512(a + kActPlane2 + 64 * k));
    t1 = _mm512_dpbusd_epi32(t1, q[k + 1], _mm512_load_si512(a + kActPlane2 + 64 * k + 64));
  }
  return combine_planes(_mm512_add_epi32(s0, s1), _mm512_add_epi32(t0, t1));
}

// One group (lo / hi weight quants of up to 4 blocks) against grouped activations at a (both
// planes): the combined partial sums, block 4i + c in 128-bit lane c. Plane 2's vpdpbusd
// accumulate onto 255 * (plane 1's sums), which saves the separate combine.
inline __m512i group_isum(__m512i lo, __m512i hi, const uint8_t* a) {
  __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_load_si512(a));
  p = _mm512_dpbusd_epi32(p, hi, _mm512_load_si512(a + 64));
  p = _mm512_sub_epi32(_mm512_slli_epi32(p, 8), p);
  p = _mm512_dpbusd_epi32(p, lo, _mm512_load_si512(a + kActPlane2));
  return _mm512_dpbusd_epi32(p, hi, _mm512_load_si512(a + kActPlane2 + 64));
}

// Four grouped partial sums (128-bit lane c of g[i]: block 4i + c, spread over 4 dwords) -> one
// register with block j's exact sum in lane j.
inline __m512i groups_to_lanes(const __m512i g[4]) {
  const __m512i t01 = _mm512_add_epi32(_mm512_unpacklo_epi32(g[0], g[1]), _mm512_unpackhi_epi32(g[0], g[1]));
  const __m512i t23 = _mm512_add_epi32(_mm512_unpacklo_epi32(g[2], g[3]), _mm512_unpackhi_epi32(g[2], g[3]));
  // Lane 4c + i now holds the sum of block 4i + c; transpose the 4 x 4.
  const __m512i u = _mm512_add_epi32(_mm512_unpacklo_epi64(t01, t23), _mm512_unpackhi_epi64(t01, t23));
  return _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), u);
}

// The per-chunk update every path must share (see the top of the file).
inline __m512 chunk_update(__m512i isum, __m512 dw, __m512 dx, __m512 c, __m512 s, __m512 acc) {
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(dw, dx), acc);
  return _mm512_fmadd_ps(c, s, acc);
}

}  // namespace
}  // namespace kestrel::cpu::detail

#endif  // __x86_64__
