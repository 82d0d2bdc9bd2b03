// AVX-512 (F/BW/VL/DQ/VNNI) kernels.
//
// 32-element block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) run on vpdpbusd (u8 x s8 -> s32). Every
// weight is turned into an unsigned quant u with w = d * u + c per block (Q4_0: c = -8d, Q4_1 /
// Q5_1: c = m, Q5_0: c = -16d, Q8_0: u = q + 128, c = -128d), so a block's dot product with x (x ~ dx * Q, Q the 16-bit quants
// 255 * q1 + q2 of quantize_block_q16) is
//   d * dx * sum(u * Q) + c * s,      s = dx * sum(Q), computed when x is quantized,
// where sum(u * Q) = 255 * sum(u * q1) + sum(u * q2): two vpdpbusd per weight register, one for
// each activation plane, combined exactly in int32 before the conversion to f32.
//
// Sixteen blocks form a "chunk" and 32-bit lane j of a 512-bit register belongs to block j of the
// chunk: register k (k < 8) holds bytes 4k..4k+3 of every block, so eight vpdpbusd per plane
// leave each block's exact integer sum in its own lane and one conversion, one multiply
// (dw * dx) and two FMAs apply sixteen blocks' scales. The GEMM unpacks a tile of weight rows
// into that transposed layout once per pass of tokens (zmm gathers, or permutes for Q4_1); the
// GEMV, and the few-token kernel for the gathered formats, instead load 4 contiguous blocks at a
// time (2 vpdpbusd per plane per 4 blocks) and transposes the integer sums into block lanes
// (groups_to_lanes): integers are exact, so both give the same lanes. matmul_amx.cpp computes
// the same lanes with AMX tiles.
//
// Activation layout for 32-blocks, one token (nch = ceil(nb / 16) chunks):
//   int8 q[nch][2][8][64] chunk c, plane p (q1, q2), register k, lane j: elements 4k..4k+3 of
//                         block 16c + j (a partial last chunk, and every chunk for the GEMV, is
//                         "grouped" instead: see quantize_act32)
//   f32  dx[nch][16]      lane j: scale of block 16c + j
//   f32  s[nch][16]       lane j: dx * sum(Q) of block 16c + j
// Lanes past nb are zero, so the last chunk needs no special case on the activation side.
//
// The arithmetic of one output is fixed: acc = 0; for each chunk,
//   acc = fma(f32(isum), dw * dx, acc); acc = fma(c, s, acc)
// lane by lane (isum, dw, dx, c, s: the chunk's 16 blocks), then reduce16 sums the lanes. The
// GEMV and the GEMM tiles run exactly this, so a token's output is bitwise the same whatever else
// is in the batch and however the rows are split over threads.
//
// The K-quants (Q2_K..Q6_K) use vpmaddubsw + vpmaddwd (the quant x scale products must stay in
// 32 bits) on activations in natural order (the scalar layout); F32 / F16 / BF16 use f32 FMA.
#if defined(__x86_64__)

// First: it sets up <immintrin.h> (see there).
#include "backend/cpu/simd_avx512.h"

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "backend/cpu/matmul_avx512_internal.h"
#include "backend/cpu/matmul_kernels.h"
#include "backend/cpu/quant_formats_avx512.h"

namespace kestrel::cpu::detail {
namespace {

// ---------------------------------------------------------------------------------------------
// Activations for 32-blocks (layout: Layout16 in quant_formats_avx512.h)

// grouped == false (GEMM): the transposed chunk layout described at the top, except for a
// partial last chunk. Grouped chunks (all of them for the GEMV) hold four groups of four blocks,
// group g at 128g: a_{4g+j}[0:16] at 16j and a_{4g+j}[16:32] at 64 + 16j, the order of four
// contiguous weight blocks after nibble unpacking; vpdpbusd on that costs 2 instructions per 4
// blocks instead of 8 per (mostly empty) transposed chunk. dx and s are the same in both.
void quantize_act32(const float* x, int64_t n_in, bool grouped, bool bits8, uint8_t* dst) {
  const Layout16 L(n_in);
  auto* dx = reinterpret_cast<float*>(dst + L.dx_off);
  auto* s = reinterpret_cast<float*>(dst + L.s_off);
  // Lanes of missing blocks in the last chunk must read as zero.
  std::memset(dst + (L.nch - 1) * kActChunkBytes, 0, kActChunkBytes);
  std::memset(dx + (L.nch - 1) * 16, 0, 64);
  std::memset(s + (L.nch - 1) * 16, 0, 64);
  for (int64_t b = 0; b < L.nb; ++b) {
    alignas(32) int8_t q[2][32];
    quantize_block32(x + 32 * b, bits8, q[0], q[1], dx[b], s[b]);
    uint8_t* chunk = dst + (b / 16) * kActChunkBytes;
    for (int p = 0; p < 2; ++p) {
      uint8_t* plane = chunk + p * kActPlane2;
      if (grouped || is_tail_chunk(L, b / 16)) {
        uint8_t* g = plane + ((b % 16) / 4) * 128 + 16 * (b % 4);
        std::memcpy(g, q[p], 16);
        std::memcpy(g + 64, q[p] + 16, 16);
      } else {  // the block's 8 dwords go to lane b % 16 of the chunk's 8 registers
        auto* lane = reinterpret_cast<uint32_t*>(plane) + b % 16;
        for (int k = 0; k < 8; ++k) std::memcpy(lane + 16 * k, q[p] + 4 * k, 4);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// 32-block GEMV (one token)

// One grouped chunk of a weight row (nblk <= 16 blocks at p) against grouped activations at ag:
// the exact per-block sums in lanes, and the raw scale dwords.
template <class Fmt>
inline __m512i grouped_isum(const uint8_t* p, int64_t nblk, const uint8_t* ag, __m512i& sc) {
  __m512i isum[4];
  sc = _mm512_setzero_si512();
  for (int i = 0; i < 4; ++i) {
    const int n = static_cast<int>(std::clamp<int64_t>(nblk - 4 * i, 0, 4));
    if (n == 0) {
      isum[i] = _mm512_setzero_si512();
      continue;
    }
    const Group g = Fmt::load_group(p + 4 * i * Fmt::kBlockBytes, n);
    isum[i] = group_isum(g.lo, g.hi, ag + 128 * i);
    sc = _mm512_mask_broadcast_i32x4(sc, static_cast<__mmask16>(0xf << (4 * i)), g.sc);
  }
  return groups_to_lanes(isum);
}

template <class Fmt>
void gemv32(const MatmulArgs& a, int64_t r0, int64_t r1) {
  const Layout16 L(a.w.n_in);
  const auto* dx = reinterpret_cast<const float*>(a.act + L.dx_off);
  const auto* s = reinterpret_cast<const float*>(a.act + L.s_off);
  OutputCollector out;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = a.w.data + r * a.w_row_bytes;
    prefetch_ahead(a.w.data, a.w_row_bytes, r, r1);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t c = 0; c < L.nch; ++c) {
      __m512i sc;
      const __m512i isum =
          grouped_isum<Fmt>(row + 16 * c * Fmt::kBlockBytes, std::min<int64_t>(16, L.nb - 16 * c), a.act + kActChunkBytes * c, sc);
      __m512 dw, cw;
      Fmt::scales(sc, dw, cw);
      acc = chunk_update(isum, dw, _mm512_load_ps(dx + 16 * c), cw, _mm512_load_ps(s + 16 * c), acc);
    }
    out.add(acc, a.y + r);
  }
  out.flush();
}

// A few tokens (several sequences decoding, a verify step of 1 + k tokens): the GEMV's grouped
// arithmetic for each token, weights loaded once per row and chunk for up to 4 tokens at a time.
// The GEMM below unpacks every weight row into the transposed layout first; where that takes
// gathers (every format but Q4_1, whose 20-byte blocks transpose with permutes), the unpacking
// costs more than it saves until about 5 tokens share it (measured on the SmolLM2 shapes, Q8_0
// 576 -> 49152: 2 tokens 4.0 against 4.7-5.2 ms, 4 tokens 6.1-6.3 against 6.4-6.6 ms, one thread).
// Each token's output is bitwise gemv32's (the same per-chunk steps in the same order).
int64_t grouped_max_tokens(GgmlType type) { return type == GgmlType::Q4_1 ? 1 : 4; }

template <class Fmt, int T>
void gemv32_tokens(const MatmulArgs& a, int64_t r0, int64_t r1, int64_t t0) {
  const Layout16 L(a.w.n_in);
  const int64_t n_out = a.w.n_out;
  const uint8_t* act = a.act + t0 * a.act_stride;
  OutputCollector out[T];
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = a.w.data + r * a.w_row_bytes;
    prefetch_ahead(a.w.data, a.w_row_bytes, r, r1);
    __m512 acc[T];
    for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t c = 0; c < L.nch; ++c) {
      const int64_t nblk = std::min<int64_t>(16, L.nb - 16 * c);
      const uint8_t* p = row + 16 * c * Fmt::kBlockBytes;
      Group g[4];
      int n_groups = 0;
      __m512i sc = _mm512_setzero_si512();
      for (int i = 0; i < 4 && 4 * i < nblk; ++i, ++n_groups) {
        g[i] = Fmt::load_group(p + 4 * i * Fmt::kBlockBytes, static_cast<int>(std::min<int64_t>(4, nblk - 4 * i)));
        sc = _mm512_mask_broadcast_i32x4(sc, static_cast<__mmask16>(0xf << (4 * i)), g[i].sc);
      }
      __m512 dw, cw;
      Fmt::scales(sc, dw, cw);
      for (int t = 0; t < T; ++t) {
        const uint8_t* at = act + t * a.act_stride;
        const uint8_t* ag = at + kActChunkBytes * c;
        __m512i isum[4];
        for (int i = 0; i < 4; ++i)
          isum[i] = i < n_groups ? group_isum(g[i].lo, g[i].hi, ag + 128 * i) : _mm512_setzero_si512();
        acc[t] = chunk_update(groups_to_lanes(isum), dw, _mm512_load_ps(at + L.dx_off + 64 * c), cw,
                              _mm512_load_ps(at + L.s_off + 64 * c), acc[t]);
      }
    }
    for (int t = 0; t < T; ++t) out[t].add(acc[t], a.y + (t0 + t) * n_out + r);
  }
  for (int t = 0; t < T; ++t) out[t].flush();
}

template <class Fmt>
void gemv32_few(const MatmulArgs& a, int64_t r0, int64_t r1) {
  int64_t t = 0;
  for (; a.n_tokens - t >= 4; t += 4) gemv32_tokens<Fmt, 4>(a, r0, r1, t);
  switch (a.n_tokens - t) {
    case 3: gemv32_tokens<Fmt, 3>(a, r0, r1, t); break;
    case 2: gemv32_tokens<Fmt, 2>(a, r0, r1, t); break;
    case 1: gemv32_tokens<Fmt, 1>(a, r0, r1, t); break;
    default: break;
  }
}

// ---------------------------------------------------------------------------------------------
// 32-block GEMM: a tile of 4 weight rows is unpacked once into scratch (per row and chunk: q[8],
// dw, c = 640 bytes; a partial last chunk holds its groups' lo / hi quants instead of q) and
// multiplied with the tokens 4 at a time, 16 accumulators in registers.

constexpr size_t kChunkBytes = 640;

template <class Fmt>
void unpack_rows32(const MatmulArgs& a, const Layout16& L, int64_t r0, uint8_t* dst) {
  Chunk ch;
  for (int i = 0; i < 4; ++i) {
    uint8_t* u = dst + i * L.nch * kChunkBytes;
    if (r0 + i >= a.w.n_out) {  // padding row: zero scales make its (discarded) outputs zero
      std::memset(u, 0, L.nch * kChunkBytes);
      continue;
    }
    const uint8_t* row = a.w.data + (r0 + i) * a.w_row_bytes;
    // With a few tokens the GEMM streams the weights from memory as the GEMV does.
    prefetch_ahead(a.w.data, a.w_row_bytes, r0 + i, a.w.n_out);
    for (int64_t c = 0; c < L.nch; ++c) {
      const int nblk = static_cast<int>(std::min<int64_t>(16, L.nb - 16 * c));
      const uint8_t* p = row + 16 * c * Fmt::kBlockBytes;
      uint8_t* uc = u + c * kChunkBytes;
      if (is_tail_chunk(L, c)) {  // the tiles read only its first ceil(nblk / 4) groups
        ch.sc = _mm512_setzero_si512();
        for (int i = 0; 4 * i < nblk; ++i) {
          const Group g = Fmt::load_group(p + 4 * i * Fmt::kBlockBytes, std::min(4, nblk - 4 * i));
          _mm512_store_si512(uc + 128 * i, g.lo);
          _mm512_store_si512(uc + 128 * i + 64, g.hi);
          ch.sc = _mm512_mask_broadcast_i32x4(ch.sc, static_cast<__mmask16>(0xf << (4 * i)), g.sc);
        }
      } else {
        Fmt::load_chunk(p, nblk, ch);
        for (int k = 0; k < 8; ++k) _mm512_store_si512(uc + 64 * k, ch.q[k]);
      }
      __m512 dw, cw;
      Fmt::scales(ch.sc, dw, cw);
      _mm512_store_ps(uc + 512, dw);
      _mm512_store_ps(uc + 576, cw);
    }
  }
}

template <int T>
void tile32(const Layout16& L, const uint8_t* wt, const uint8_t* act, size_t act_stride, int n_rows,
            float* y, int64_t ldy) {
  __m512 acc[4][T];
  for (int r = 0; r < 4; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  const int64_t n_full = L.nb / 16;
  for (int64_t c = 0; c < n_full; ++c) {
    for (int r = 0; r < 4; ++r) {
      const uint8_t* uc = wt + (r * L.nch + c) * kChunkBytes;
      __m512i q[8];
      for (int k = 0; k < 8; ++k) q[k] = _mm512_load_si512(uc + 64 * k);
      const __m512 dw = _mm512_load_ps(uc + 512), cw = _mm512_load_ps(uc + 576);
      for (int t = 0; t < T; ++t) {
        const uint8_t* at = act + t * act_stride;
        acc[r][t] = chunk_update(chunk_isum(q, at + kActChunkBytes * c), dw, _mm512_load_ps(at + L.dx_off + 64 * c), cw,
                                 _mm512_load_ps(at + L.s_off + 64 * c), acc[r][t]);
      }
    }
  }
  if (n_full < L.nch && L.nb - 16 * n_full <= 4) {  // grouped tail chunk of one group
    // One transpose turns the 4 tokens' partial sums into [token][block] lanes; each token then
    // takes its 4 lanes. (576 inputs: 16 + 2 blocks.)
    const int64_t c = n_full;
    for (int r = 0; r < 4; ++r) {
      const uint8_t* uc = wt + (r * L.nch + c) * kChunkBytes;
      const __m512i lo = _mm512_load_si512(uc), hi = _mm512_load_si512(uc + 64);
      const __m512 dw = _mm512_load_ps(uc + 512), cw = _mm512_load_ps(uc + 576);
      __m512i g[4];
      for (int t = 0; t < 4; ++t) {
        g[t] = _mm512_setzero_si512();
        if (t >= T) continue;
        g[t] = group_isum(lo, hi, act + t * act_stride + kActChunkBytes * c);
      }
      const __m512i by_token = groups_to_lanes(g);
      for (int t = 0; t < T; ++t) {
        const uint8_t* at = act + t * act_stride;
        const __m512i isum = _mm512_maskz_permutexvar_epi32(
            0x000f, _mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), _mm512_set1_epi32(4 * t)),
            by_token);
        acc[r][t] = chunk_update(isum, dw, _mm512_load_ps(at + L.dx_off + 64 * c), cw,
                                 _mm512_load_ps(at + L.s_off + 64 * c), acc[r][t]);
      }
    }
  } else if (n_full < L.nch) {  // grouped tail chunk
    const int64_t c = n_full;
    const int n_groups = static_cast<int>((L.nb - 16 * c + 3) / 4);
    for (int r = 0; r < 4; ++r) {
      const uint8_t* uc = wt + (r * L.nch + c) * kChunkBytes;
      const __m512 dw = _mm512_load_ps(uc + 512), cw = _mm512_load_ps(uc + 576);
      for (int t = 0; t < T; ++t) {
        const uint8_t* at = act + t * act_stride;
        __m512i isum[4];
        for (int i = 0; i < 4; ++i) {
          isum[i] = _mm512_setzero_si512();
          if (i >= n_groups) continue;
          isum[i] = group_isum(_mm512_load_si512(uc + 128 * i), _mm512_load_si512(uc + 128 * i + 64),
                               at + kActChunkBytes * c + 128 * i);
        }
        acc[r][t] = chunk_update(groups_to_lanes(isum), dw, _mm512_load_ps(at + L.dx_off + 64 * c), cw,
                                 _mm512_load_ps(at + L.s_off + 64 * c), acc[r][t]);
      }
    }
  }
  __m512 v[16];
  for (int t = 0; t < 4; ++t)
    for (int r = 0; r < 4; ++r) v[4 * t + r] = t < T ? acc[r][t] : _mm512_setzero_ps();
  store_tile(reduce16(v), T, n_rows, y, ldy);
}

template <class Fmt>
void gemm32(const MatmulArgs& a, int64_t r0, int64_t r1, uint8_t* scratch) {
  const Layout16 L(a.w.n_in);
  const int64_t ldy = a.w.n_out;
  for (int64_t t0 = 0; t0 < a.n_tokens; t0 += kGemmTokenBlock) {
    for (int64_t rt = r0; rt < r1; rt += 4) {
      unpack_rows32<Fmt>(a, L, rt, scratch);
      const int n_rows = static_cast<int>(std::min<int64_t>(4, r1 - rt));
      for_token_tiles(t0, std::min(a.n_tokens, t0 + kGemmTokenBlock), [&](auto T, int64_t t) {
        tile32<decltype(T)::value>(L, scratch, a.act + t * a.act_stride, a.act_stride, n_rows, a.y + t * ldy + rt, ldy);
      });
    }
  }
}

// The sums of one group (block c's partial sums spread over 128-bit lane c) in lanes 0..3, zero
// elsewhere: groups_to_lanes for a chunk of a single group, in half the instructions.
inline __m512i group_to_lanes(__m512i g) {
  g = _mm512_add_epi32(g, _mm512_shuffle_epi32(g, _MM_PERM_BADC));
  g = _mm512_add_epi32(g, _mm512_shuffle_epi32(g, _MM_PERM_CDAB));
  return _mm512_maskz_permutexvar_epi32(0x000f, _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), g);
}

// Q5_0 GEMV with AVX512-VBMI (Zen 4, Ice Lake and later) for rows of whole groups (nb % 4 == 0:
// Gemma 3's 640-wide Q5_0 matrices, 20 blocks). gemv32's Q5_0 path runs ~25 instructions per 4
// blocks and is bound by them, not by memory (as fast from L2 as from DRAM, ~12 GB/s per core
// against ~16 for Q8_0). Here one vpermt2w puts each block's qh beside its d so that vpmultishiftqb
// moves the 5th bit of every element straight to bit 4 of its byte (no trip through mask registers),
// the scales of a chunk come from those registers in 3 permutes, and a chunk of a single group
// sums its lanes in place of the 4 x 4 transpose. The integer lane sums and the f32 steps are
// gemv32's, so outputs are bitwise the same.
namespace q5v {

struct G {
  __m512i lo, hi, h;  // h: qword 2j + e holds block j's qh (bits 0..31) and d (bits 32..47)
};

__attribute__((target("avx512vbmi"))) inline G load(const uint8_t* p) {
  const __m512i v0 = _mm512_loadu_si512(p), v1 = _mm512_maskz_loadu_epi8(0xffffff, p + 64);
  // Block j is 11 words from word 11j: d, 2 words of qh, 8 words of nibbles.
  alignas(64) static constexpr int16_t kQsWords[32] = {3,  4,  5,  6,  7,  8,  9,  10, 14, 15, 16,
                                                       17, 18, 19, 20, 21, 25, 26, 27, 28, 29, 30,
                                                       31, 32, 36, 37, 38, 39, 40, 41, 42, 43};
  alignas(64) static constexpr int16_t kHWords[32] = {1,  2,  0,  0,  1,  2,  0,  0,  12, 13, 11,
                                                      11, 12, 13, 11, 11, 23, 24, 22, 22, 23, 24,
                                                      22, 22, 34, 35, 33, 33, 34, 35, 33, 33};
  // Byte b of qword 2j + e is element 8e + b (lo) or 16 + 8e + b (hi): the 8 bits from bit
  // element - 4 (mod 64) of the qword put the element's qh bit at bit 4.
  alignas(64) static constexpr uint8_t kShiftLo[64] = {
      60, 61, 62, 63, 0,  1,  2,  3,  4,  5,  6,  7,  8,  9,  10, 11, 60, 61, 62, 63, 0,  1,
      2,  3,  4,  5,  6,  7,  8,  9,  10, 11, 60, 61, 62, 63, 0,  1,  2,  3,  4,  5,  6,  7,
      8,  9,  10, 11, 60, 61, 62, 63, 0,  1,  2,  3,  4,  5,  6,  7,  8,  9,  10, 11};
  alignas(64) static constexpr uint8_t kShiftHi[64] = {
      12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 12, 13, 14, 15, 16, 17,
      18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23,
      24, 25, 26, 27, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27};
  const __m512i qs = _mm512_permutex2var_epi16(v0, _mm512_load_si512(kQsWords), v1);
  const __m512i h = _mm512_permutex2var_epi16(v0, _mm512_load_si512(kHWords), v1);
  const __m512i m4 = _mm512_set1_epi8(0x0f), b5 = _mm512_set1_epi8(0x10);
  const __m512i h_lo = _mm512_and_si512(_mm512_multishift_epi64_epi8(_mm512_load_si512(kShiftLo), h), b5);
  const __m512i h_hi = _mm512_and_si512(_mm512_multishift_epi64_epi8(_mm512_load_si512(kShiftHi), h), b5);
  // (x & m4) | bits
  return {_mm512_ternarylogic_epi32(h_lo, qs, m4, 0xf8),
          _mm512_ternarylogic_epi32(h_hi, _mm512_srli_epi16(qs, 4), m4, 0xf8), h};
}

// The d of block 4i + j (low half of dword 4j + 1 of h[i]) -> lane 4i + j, as gemv32's scale dwords.
inline __m512i chunk_scales(const __m512i h[4]) {
  const __m512i pick = _mm512_setr_epi32(1, 5, 9, 13, 17, 21, 25, 29, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m256i d01 = _mm512_castsi512_si256(_mm512_permutex2var_epi32(h[0], pick, h[1]));
  const __m512i d23 = _mm512_permutex2var_epi32(h[2], pick, h[3]);
  return _mm512_inserti64x4(_mm512_castsi256_si512(d01), _mm512_castsi512_si256(d23), 1);
}

__attribute__((target("avx512vbmi"))) void gemv(const MatmulArgs& a, int64_t r0, int64_t r1) {
  const Layout16 L(a.w.n_in);
  const auto* dx = reinterpret_cast<const float*>(a.act + L.dx_off);
  const auto* s = reinterpret_cast<const float*>(a.act + L.s_off);
  const int64_t n_full = L.nb / 16;
  const int tail_groups = static_cast<int>((L.nb % 16) / 4);
  const size_t rb = a.w_row_bytes;
  const int64_t ahead = std::max<int64_t>(1, kPrefetchBytes / static_cast<int64_t>(rb));
  constexpr int kB = sizeof(BlockQ5_0);
  OutputCollector out;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = a.w.data + r * static_cast<int64_t>(rb);
    if (r + ahead < r1) {
      const uint8_t* pf = row + ahead * static_cast<int64_t>(rb);
      for (size_t off = 0; off < rb; off += 64) __builtin_prefetch(pf + off, 0, 3);
    }
    __m512 acc = _mm512_setzero_ps();
    for (int64_t c = 0; c < n_full; ++c) {
      const uint8_t* ac = a.act + kActChunkBytes * c;
      __m512i isum[4], h[4];
      for (int i = 0; i < 4; ++i) {
        const G g = load(row + (16 * c + 4 * i) * kB);
        isum[i] = group_isum(g.lo, g.hi, ac + 128 * i);
        h[i] = g.h;
      }
      __m512 dw, cw;
      FmtQ5_0::scales(chunk_scales(h), dw, cw);
      acc = chunk_update(groups_to_lanes(isum), dw, _mm512_load_ps(dx + 16 * c), cw, _mm512_load_ps(s + 16 * c), acc);
    }
    if (tail_groups > 0) {
      const int64_t c = n_full;
      const uint8_t* ac = a.act + kActChunkBytes * c;
      __m512i isum, sc;
      if (tail_groups == 1) {
        const G g = load(row + 16 * c * kB);
        isum = group_to_lanes(group_isum(g.lo, g.hi, ac));
        sc = _mm512_maskz_permutexvar_epi32(0x000f, _mm512_setr_epi32(1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), g.h);
      } else {
        __m512i is[4], h[4];
        for (int i = 0; i < 4; ++i) {
          is[i] = h[i] = _mm512_setzero_si512();
          if (i >= tail_groups) continue;
          const G g = load(row + (16 * c + 4 * i) * kB);
          is[i] = group_isum(g.lo, g.hi, ac + 128 * i);
          h[i] = g.h;
        }
        isum = groups_to_lanes(is);
        sc = chunk_scales(h);
      }
      __m512 dw, cw;
      FmtQ5_0::scales(sc, dw, cw);
      acc = chunk_update(isum, dw, _mm512_load_ps(dx + 16 * c), cw, _mm512_load_ps(s + 16 * c), acc);
    }
    out.add(acc, a.y + r);
  }
  out.flush();
}

}  // namespace q5v

bool has_vbmi() {
  static const bool v = __builtin_cpu_supports("avx512vbmi");
  return v;
}

template <class Fmt>
void matmul32(const MatmulArgs& a, int64_t r0, int64_t r1, uint8_t* scratch) {
  if (a.n_tokens == 1 && std::is_same_v<Fmt, FmtQ5_0> && (a.w.n_in / 32) % 4 == 0 && has_vbmi()) q5v::gemv(a, r0, r1);
  else if (a.n_tokens == 1) gemv32<Fmt>(a, r0, r1);
  else if (a.n_tokens <= grouped_max_tokens(a.w.type.storage)) gemv32_few<Fmt>(a, r0, r1);
  else gemm32<Fmt>(a, r0, r1, scratch);
}

size_t act_row_bytes(GgmlType type, int64_t n_in) {
  if (is_float_type(type)) return 0;
  if (is_k_quant(type)) return ActLayoutK(n_in).bytes;
  return Layout16(n_in).bytes;
}

void quantize_act(GgmlType type, const float* x, int64_t n_in, int64_t n_tokens, bool bits8, uint8_t* dst) {
  if (is_k_quant(type)) avx512_quantize_act_k(x, n_in, bits8, dst);
  else quantize_act32(x, n_in, n_tokens <= grouped_max_tokens(type), bits8, dst);
}

using Acts = PerTokenActs<act_row_bytes, quantize_act>;

// A type without AVX-512 kernels of its own would run the AVX2 ones (every AVX-512 CPU has AVX2),
// with the AVX2 activation layout: the whole call goes through kernels_avx2() for it. Today every
// type matmul_supports() has its own.
bool avx512_native(GgmlType type) {
  switch (type) {
    case GgmlType::Q4_0:
    case GgmlType::Q4_1:
    case GgmlType::Q5_0:
    case GgmlType::Q5_1:
    case GgmlType::Q8_0:
    case GgmlType::Q2_K:
    case GgmlType::Q3_K:
    case GgmlType::Q4_K:
    case GgmlType::Q5_K:
    case GgmlType::Q6_K:
    case GgmlType::F32:
    case GgmlType::F16:
    case GgmlType::BF16:
      return true;
    default:
      return false;
  }
}

// A 16-token AMX tile costs about the same however many of its tokens are real; it beats the
// vpdpbusd GEMM from about 8 (measured: 576 -> 1536 Q4_1, 8 tokens 102 us vs 120 us, 4 tokens
// 81 us vs 79 us).
constexpr int64_t kAmxMinTokens = 8;

bool use_amx(GgmlType type, int64_t n_tokens) {
  const bool block32 = type == GgmlType::Q4_0 || type == GgmlType::Q4_1 || type == GgmlType::Q5_0 ||
                       type == GgmlType::Q5_1 || type == GgmlType::Q8_0;
  return block32 && n_tokens >= kAmxMinTokens && amx_allowed() && amx_usable();
}

size_t act_bytes(GgmlType type, int64_t n_in, int64_t n_tokens) {
  if (!avx512_native(type)) return kernels_avx2().act_bytes(type, n_in, n_tokens);
  return use_amx(type, n_tokens) ? amx_act_bytes(n_in, n_tokens) : Acts::bytes(type, n_in, n_tokens);
}

size_t act_stride(GgmlType type, int64_t n_in, int64_t n_tokens) {
  if (!avx512_native(type)) return kernels_avx2().act_stride(type, n_in, n_tokens);
  return use_amx(type, n_tokens) ? 0 : Acts::stride(type, n_in, n_tokens);
}

void quantize_acts(GgmlType type, const float* x, int64_t n_in, int64_t n_tokens, int64_t t0, int64_t t1,
                   bool bits8, uint8_t* dst) {
  if (!avx512_native(type)) return kernels_avx2().quantize_acts(type, x, n_in, n_tokens, t0, t1, bits8, dst);
  if (use_amx(type, n_tokens)) amx_quantize_acts(x, n_in, n_tokens, t0, t1, bits8, dst);
  else Acts::quantize(type, x, n_in, n_tokens, t0, t1, bits8, dst);
}

size_t scratch_bytes(GgmlType type, int64_t n_in) {
  if (!avx512_native(type)) return kernels_avx2().scratch_bytes(type, n_in);
  if (is_float_type(type) || is_k_quant(type)) return 0;
  const size_t vnni = 4 * static_cast<size_t>(Layout16(n_in).nch) * kChunkBytes;
  return use_amx(type, kAmxMinTokens) ? std::max(vnni, amx_scratch_bytes(n_in)) : vnni;
}

int64_t row_tile(GgmlType type, int64_t n_tokens) {
  if (!avx512_native(type)) return kernels_avx2().row_tile(type, n_tokens);
  return use_amx(type, n_tokens) ? 16 : 4;
}

void matmul_rows(const MatmulArgs& a, int64_t r0, int64_t r1, uint8_t* scratch) {
  if (!avx512_native(a.w.type.storage)) return kernels_avx2().matmul_rows(a, r0, r1, scratch);
  if (use_amx(a.w.type.storage, a.n_tokens)) return amx_matmul_rows(a, r0, r1, scratch);
  switch (a.w.type.storage) {
    case GgmlType::Q4_0: matmul32<FmtQ4_0>(a, r0, r1, scratch); break;
    case GgmlType::Q4_1: matmul32<FmtQ4_1>(a, r0, r1, scratch); break;
    case GgmlType::Q5_0: matmul32<FmtQ5_0>(a, r0, r1, scratch); break;
    case GgmlType::Q5_1: matmul32<FmtQ5_1>(a, r0, r1, scratch); break;
    case GgmlType::Q8_0: matmul32<FmtQ8_0>(a, r0, r1, scratch); break;
    default: avx512_matmul_other(a, r0, r1); break;
  }
}

float vec_dot(const float* a, const float* b, int64_t n) {
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  int64_t i = 0;
  for (; i + 64 <= n; i += 64)
    for (int k = 0; k < 4; ++k)
      acc[k] = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16 * k), _mm512_loadu_ps(b + i + 16 * k), acc[k]);
  for (; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? 0xffff : static_cast<__mmask16>((1u << (n - i)) - 1);
    acc[0] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), acc[0]);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
}

}  // namespace

const MatmulKernels& kernels_avx512() {
  static const MatmulKernels k{"avx512", act_bytes, act_stride, quantize_acts, scratch_bytes, matmul_rows,
                               vec_dot, row_tile};
  return k;
}

}  // namespace kestrel::cpu::detail

#endif  // __x86_64__
