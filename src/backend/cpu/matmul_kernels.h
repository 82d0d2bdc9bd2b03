// Internal interface between matmul() (threading, scratch) and the per-ISA kernels
// (matmul_scalar.cpp, matmul_avx2.cpp, matmul_avx512.cpp).
//
// Each ISA quantizes the activations into its own layout (the AVX-512 one interleaves blocks so a
// 512-bit register holds four blocks' halves), but every ISA rounds identically (see
// quantize_block_q16 below), so the paths differ only in f32 summation order.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <cstring>

#include "backend/cpu/matmul.h"

namespace kestrel::cpu::detail {

struct MatmulArgs {
  WeightView w;
  size_t w_row_bytes = 0;        // bytes of one weight row
  const float* x = nullptr;      // [n_tokens, n_in] f32 (float weight types read this)
  const uint8_t* act = nullptr;  // quantized x in the kernel's layout (quantized weight types)
  size_t act_stride = 0;         // bytes per token in act, for layouts that keep tokens apart
  int64_t n_tokens = 0;
  float* y = nullptr;            // [n_tokens, n_out]
};

struct MatmulKernels {
  const char* name;
  // Bytes of a call's quantized activations for weights of `type` (0: the kernel reads f32 x),
  // and the distance between consecutive tokens in them (0 if the layout interleaves tokens).
  // The layout may depend on n_tokens (e.g. one arrangement for the GEMV, another for the GEMM).
  size_t (*act_bytes)(GgmlType type, int64_t n_in, int64_t n_tokens);
  size_t (*act_stride)(GgmlType type, int64_t n_in, int64_t n_tokens);
  // Quantizes tokens [t0, t1) of x [n_tokens, n_in] into dst (the call's 64-byte aligned buffer);
  // t0 is a multiple of 16, so threads can split a call's tokens without sharing cache lines.
  // bits8: MatmulWorkspace::activations_8bit (see quantize_block_q16).
  void (*quantize_acts)(GgmlType type, const float* x, int64_t n_in, int64_t n_tokens, int64_t t0, int64_t t1,
                        bool bits8, uint8_t* dst);
  // Per-thread scratch that matmul_rows needs (64-byte aligned).
  size_t (*scratch_bytes)(GgmlType type, int64_t n_in);
  // Computes y[t, r] for r in [r0, r1) and every token. r0 is a multiple of row_tile.
  void (*matmul_rows)(const MatmulArgs& a, int64_t r0, int64_t r1, uint8_t* scratch);
  float (*vec_dot_f32)(const float* a, const float* b, int64_t n);
  // Rows a GEMM tile covers for this call; threads split rows at multiples of it.
  int64_t (*row_tile)(GgmlType type, int64_t n_tokens);
};

// False when AMX is switched off (set_amx_enabled(false)); the AVX-512
// kernels then keep to vpdpbusd even on AMX hardware.
bool amx_allowed();

const MatmulKernels& kernels_scalar();
#if defined(__x86_64__)
const MatmulKernels& kernels_avx2();
const MatmulKernels& kernels_avx512();
#endif

// ---- shared numerics ----

// Activations are rounded to 16 bits per block (32 elements, or a 256-element super-block for
// the K-quants) and stored as two int8 planes, so every integer dot product stays an int8 one
// (vpdpbusd, vpmaddubsw, AMX TDPBUSD) against the weight quants as stored:
//   d = max|x| / kActLevels,  Q = round-half-even(x * (kActLevels / max|x|)),  |Q| <= kActLevels,
//   Q = kActSplit * q1 + q2  with q1 = round(Q / kActSplit), so |q1| <= 127 and |q2| <= 127
//   (q2 never reaches -128, which AVX2's vpsignb trick for Q8_0 could not negate).
// A block's dot product with integer weights u is then d * (kActSplit * sum(u q1) + sum(u q2)):
// two int8 dot products, combined exactly in int32 for 32-blocks (|sum| <= 32 * 255 * 32385 <
// 2^31) and in f32 for the K-quants' super-blocks (whose scaled sums could overflow int32).
// Each element moves by at most d / 2 = max|x| / 64770 (plus f32 rounding of x * (kActLevels /
// max|x|), < 0.01 d), against max|x| / 254 for llama.cpp-style 8-bit activations.
//
// Every ISA must reproduce this rounding bit for bit (cvtps2dq rounds half to even under the
// default MXCSR, as nearbyint does). q1 = round(Q / 255) is computed as nearbyint(f32(Q) *
// (1 / 255.f)), which is the exact rounding: 255 is odd, so Q / 255 is never a half-integer and
// is at least 1 / 510 away from one, far more than the f32 product's error (< 1e-5).
//
// MatmulWorkspace::activations_8bit keeps the same layout and kernels but rounds x to 8 bits:
// Q = kActSplit * round(x * (127 / max|x|)), i.e. q2 = 0 (the llama.cpp error, same speed).
constexpr int kActSplit = 255;
constexpr int kActLevels = 127 * kActSplit;  // 32385
inline float act_inverse_scale(float amax, bool bits8) {
  return amax > 0.0f ? (bits8 ? 127.0f : static_cast<float>(kActLevels)) / amax : 0.0f;
}
inline float act_scale(float amax) { return amax / static_cast<float>(kActLevels); }
constexpr float kInvActSplit = 1.0f / kActSplit;

// Q -> (q1, q2) as above.
inline void act_split(int32_t Q, int8_t* q1, int8_t* q2) {
  const int32_t hi = static_cast<int32_t>(std::nearbyint(static_cast<float>(Q) * kInvActSplit));
  *q1 = static_cast<int8_t>(hi);
  *q2 = static_cast<int8_t>(Q - kActSplit * hi);
}

// Quantizes one block of n elements: planes q1, q2, d, and returns sum(Q) (exact).
inline int32_t quantize_block_q16(const float* x, int n, bool bits8, int8_t* q1, int8_t* q2, float* d_out) {
  float amax = 0.0f;
  for (int i = 0; i < n; ++i) amax = std::fmax(amax, std::fabs(x[i]));
  const float id = act_inverse_scale(amax, bits8);
  int32_t sum = 0;
  for (int i = 0; i < n; ++i) {
    int32_t Q = static_cast<int32_t>(std::nearbyint(x[i] * id));
    if (bits8) Q *= kActSplit;
    act_split(Q, q1 + i, q2 + i);
    sum += Q;
  }
  *d_out = act_scale(amax);
  return sum;
}

// Q4_K packs 8 six-bit scales and 8 six-bit mins into 12 bytes (ggml-common.h, block_q4_K).
inline void q4k_scale_min(const uint8_t* s, int j, int* sc, int* m) {
  if (j < 4) {
    *sc = s[j] & 63;
    *m = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
    *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// All 8 scales and 8 mins of that packing at once, byte j of *sc / *m being sub-block j's, with
// 32-bit word operations (for the SIMD kernels; same values as q4k_scale_min): bytes 0..3 and
// 4..7 hold scales / mins 0..3 in their low 6 bits and the top 2 bits of scales / mins 4..7 in
// their top 2 bits; bytes 8..11 hold the low 4 bits of scale j + 4 (low nibble) and min j + 4
// (high nibble).
inline void q4k_scales_mins(const uint8_t* s, uint64_t* sc, uint64_t* m) {
  uint32_t a[3];
  std::memcpy(a, s, 12);
  const uint32_t sc_hi = (a[2] & 0x0f0f0f0fu) | ((a[0] >> 2) & 0x30303030u);
  const uint32_t m_hi = ((a[2] >> 4) & 0x0f0f0f0fu) | ((a[1] >> 2) & 0x30303030u);
  *sc = (a[0] & 0x3f3f3f3fu) | static_cast<uint64_t>(sc_hi) << 32;
  *m = (a[1] & 0x3f3f3f3fu) | static_cast<uint64_t>(m_hi) << 32;
}

// Q3_K's 16 scales with 32-bit word operations, still offset by 32 (0..63; byte j of w[i] is
// scale 4i + j plus 32; same values as q3k_scales): word i takes its low 4 bits from the low
// nibbles (i < 2) or high nibbles (i >= 2) of word i % 2 of the packing, its high 2 bits from bits
// 2i..2i+1 of each byte of word 2.
inline void q3k_scales_biased(const uint8_t* s, uint32_t w[4]) {
  uint32_t a[3];
  std::memcpy(a, s, 12);
  for (int i = 0; i < 4; ++i)
    w[i] = ((a[i % 2] >> (4 * (i / 2))) & 0x0f0f0f0fu) | (((a[2] >> (2 * i)) & 0x03030303u) << 4);
}

// Unpacks one Q4_K super-block to its 4-bit quants in element order (q[i] in 0..15); element i has
// the scale/min of sub-block i / 32.
void q4k_unpack(const BlockQ4_K& b, uint8_t q[QK_K]);
// Unpacks one Q6_K super-block to its quants in element order, already centred (q[i] in -32..31);
// element i has the scale b.scales[i / 16].
void q6k_unpack(const BlockQ6_K& b, int8_t q[QK_K]);
// Q5_0 / Q5_1 quants of one block in element order (q[i] in 0..31), from qh and the nibbles qs.
void q5_unpack(const uint8_t qh[4], const uint8_t qs[16], uint8_t q[32]);
// Q5_K quants in element order (q[i] in 0..31); element i has the scale / min of sub-block i / 32
// (q4k_scale_min).
void q5k_unpack(const BlockQ5_K& b, uint8_t q[QK_K]);
// Q3_K quants in element order, already centred (q[i] in -4..3), and the 16 scales (-32..31) of
// the 16-element sub-blocks.
void q3k_unpack(const BlockQ3_K& b, int8_t q[QK_K]);
void q3k_scales(const uint8_t s[K_SCALE_SIZE], int8_t sc[QK_K / 16]);
// Q2_K quants in element order (q[i] in 0..3); element i has the scale b.scales[i / 16] & 15 and
// the min b.scales[i / 16] >> 4.
void q2k_unpack(const BlockQ2_K& b, uint8_t q[QK_K]);

inline size_t align64(size_t n) { return (n + 63) & ~size_t{63}; }

// A decode step streams every weight from memory once. The hardware prefetcher alone keeps too
// few lines in flight for that (measured: ~8 GB/s per core instead of ~17 for a plain stream), so
// row loops fetch the row ~4 KiB ahead of the one they start.
constexpr int64_t kPrefetchBytes = 4096;
inline void prefetch_ahead(const uint8_t* w, size_t row_bytes, int64_t r, int64_t r_end) {
  const int64_t ahead = std::max<int64_t>(1, kPrefetchBytes / static_cast<int64_t>(row_bytes));
  if (r + ahead >= r_end) return;
  const uint8_t* p = w + (r + ahead) * static_cast<int64_t>(row_bytes);
  for (size_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(p + off, 0, 3);
}

// Tokens per pass over a GEMM's rows: every row tile meets all the tokens of a pass, so their
// activations (1.3 KiB per token at 576 inputs, 3.3 KiB at 1,536 in the 32-block layouts) must
// stay in L2 from one row tile to the next. A 2,048-token prefill run as one pass read them from
// L3 and ran its GEMMs at about half the speed per token of a 128-token one (AVX-512 VNNI,
// SmolLM2); the rows are unpacked again for every pass (a few percent of a pass's products).
constexpr int64_t kGemmTokenBlock = 128;

// fn(std::integral_constant<int, T>{}, t) for tiles of T = 4 tokens from t0, then the remaining
// 1-3: the token loop of the GEMM kernels, whose tile functions take T as a template argument.
template <class Fn>
inline void for_token_tiles(int64_t t0, int64_t t1, const Fn& fn) {
  int64_t t = t0;
  for (; t + 4 <= t1; t += 4) fn(std::integral_constant<int, 4>{}, t);
  switch (t1 - t) {
    case 3: fn(std::integral_constant<int, 3>{}, t); break;
    case 2: fn(std::integral_constant<int, 2>{}, t); break;
    case 1: fn(std::integral_constant<int, 1>{}, t); break;
    default: break;
  }
}

// For kernels whose activations are one fixed-size record per token: the three MatmulKernels
// functions from the record size and a one-token quantizer.
template <size_t (*kRowBytes)(GgmlType, int64_t),
          void (*kQuantize)(GgmlType, const float*, int64_t, int64_t, bool, uint8_t*)>
struct PerTokenActs {
  static size_t bytes(GgmlType type, int64_t n_in, int64_t n_tokens) {
    return kRowBytes(type, n_in) * static_cast<size_t>(n_tokens);
  }
  static size_t stride(GgmlType type, int64_t n_in, int64_t) { return kRowBytes(type, n_in); }
  static void quantize(GgmlType type, const float* x, int64_t n_in, int64_t n_tokens, int64_t t0, int64_t t1,
                       bool bits8, uint8_t* dst) {
    const size_t stride = kRowBytes(type, n_in);
    for (int64_t t = t0; t < t1; ++t) kQuantize(type, x + t * n_in, n_in, n_tokens, bits8, dst + t * stride);
  }
};

// Natural-order activation layouts (scalar and AVX2 kernels; AVX-512 uses ActLayoutK for the
// K-quants and its own interleaved layout for 32-blocks). Offsets in bytes from the token's start.
//   ActLayout32: int8 q1[n_in] | int8 q2[n_in] | f32 d[nb] | f32 s[nb], s zero-padded to a
//                multiple of 16 (s = d * sum(Q) of the block; the padding lets SIMD code read s
//                in chunks). AVX2 keeps int16 Q in the planes' 2 n_in bytes instead, per block
//                its even elements, then its odd ones (matmul_avx2.cpp).
//   ActLayoutK:  int8 q1[n_in] | int8 q2[n_in] | f32 d[nsb] | int16 bsums1[n_in / 16] |
//                int16 bsums2[n_in / 16]   (bsums: sums of 16 consecutive q1 / q2)
struct ActLayout32 {
  int64_t nb;
  size_t q2_off, d_off, s_off, bytes;
  explicit ActLayout32(int64_t n_in)
      : nb(n_in / 32), q2_off(align64(static_cast<size_t>(n_in))), d_off(2 * q2_off),
        s_off(d_off + align64(static_cast<size_t>(nb) * 4)), bytes(s_off + align64(static_cast<size_t>(nb) * 4)) {}
};
struct ActLayoutK {
  int64_t nsb;
  size_t q2_off, d_off, bsums_off, bsums2_off, bytes;
  explicit ActLayoutK(int64_t n_in)
      : nsb(n_in / QK_K), q2_off(align64(static_cast<size_t>(n_in))), d_off(2 * q2_off),
        bsums_off(d_off + align64(static_cast<size_t>(nsb) * 4)),
        bsums2_off(bsums_off + align64(static_cast<size_t>(n_in / 16) * 2)),
        bytes(bsums2_off + align64(static_cast<size_t>(n_in / 16) * 2)) {}

  // Writable views of the planes of one row's buffer laid out as above.
  struct Planes {
    int8_t* q1;
    int8_t* q2;
    float* d;
    int16_t* bsums1;
    int16_t* bsums2;
  };
  Planes planes(uint8_t* dst) const {
    return {reinterpret_cast<int8_t*>(dst), reinterpret_cast<int8_t*>(dst + q2_off),
            reinterpret_cast<float*>(dst + d_off), reinterpret_cast<int16_t*>(dst + bsums_off),
            reinterpret_cast<int16_t*>(dst + bsums2_off)};
  }
};

// Types on 256-element super-blocks, whose activations use ActLayoutK.
inline bool is_k_quant(GgmlType t) {
  return t == GgmlType::Q2_K || t == GgmlType::Q3_K || t == GgmlType::Q4_K || t == GgmlType::Q5_K ||
         t == GgmlType::Q6_K;
}
inline bool is_float_type(GgmlType t) {
  return t == GgmlType::F32 || t == GgmlType::F16 || t == GgmlType::BF16;
}

}  // namespace kestrel::cpu::detail
