// AVX-512 (F/BW/VL/DQ/VNNI) kernels.
//
// 32-element block types (Q4_0, Q4_1, Q8_0) run on vpdpbusd (u8 x s8 -> s32). Every weight is
// turned into an unsigned quant u with w = d * u + c per block (Q4_0: c = -8d, Q4_1: c = m,
// Q8_0: u = q + 128, c = -128d), so a block's dot product with x (x ~ dx * a, a int8) is
//   d * dx * sum(u * a) + c * s,      s = dx * sum(a), computed when x is quantized.
// Four blocks form a "group": one 512-bit register holds the first 16 quants of each (128-bit lane
// j = block j) and a second one the last 16, so two vpdpbusd leave each block's integer sum spread
// over one 128-bit lane, and one conversion + one FMA applies four blocks' scales. The activations
// are stored in that interleaved order, so weights need no shuffles beyond nibble unpacking.
//
// Activation layout for 32-blocks, one token (ng = ceil(nb / 4) groups, nch = ceil(nb / 16)):
//   int8 qs[ng][128]   group g: a_{4g+j}[0:16] at 16j, a_{4g+j}[16:32] at 64 + 16j
//   f32  da[ng][16]    lanes 4j..4j+3 = dx of block 4g+j
//   f32  s[nch][16]    s of each block, zero past nb
// Blocks past nb are zero, so the last group needs no special case on the activation side.
//
// Per output the arithmetic is one fixed sequence: for each 16-block chunk, for each group
//   acc = fma(f32(isum), dw * dx, acc), then acc = fma(c, s, acc) for the chunk; then the lanes are
// summed by reduce16. The GEMV and the GEMM tile run exactly this sequence, so a token's output is
// bitwise the same whatever else is in the batch and however rows are split over threads.
//
// Q4_K / Q6_K use vpmaddubsw + vpmaddwd (the quant x scale products must stay in 32 bits) on
// activations in natural order (the scalar layout); F32 / F16 / BF16 use f32 FMA.
#if defined(__x86_64__)

// First: it sets up <immintrin.h> (see there).
#include "backend/cpu/simd_avx512.h"

#include <algorithm>
#include <cstring>

#include "backend/cpu/matmul_avx512_internal.h"
#include "backend/cpu/matmul_kernels.h"

namespace kestrel::cpu::detail {
namespace {

// ---------------------------------------------------------------------------------------------
// Activations for 32-blocks

struct Layout32 {
  int64_t nb, ng, nch;
  size_t da_off, s_off, bytes;
  explicit Layout32(int64_t n_in)
      : nb(n_in / 32), ng((nb + 3) / 4), nch((nb + 15) / 16),
        da_off(static_cast<size_t>(ng) * 128), s_off(da_off + static_cast<size_t>(ng) * 64),
        bytes(s_off + static_cast<size_t>(nch) * 64) {}
};

void quantize_act32(const float* x, int64_t n_in, uint8_t* dst) {
  const Layout32 L(n_in);
  auto* qs = reinterpret_cast<int8_t*>(dst);
  auto* da = reinterpret_cast<float*>(dst + L.da_off);
  auto* s = reinterpret_cast<float*>(dst + L.s_off);
  const __m512 sign_off = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  for (int64_t b = 0; b < L.nb; ++b) {
    const __m512 x0 = _mm512_loadu_ps(x + 32 * b), x1 = _mm512_loadu_ps(x + 32 * b + 16);
    const float amax = _mm512_reduce_max_ps(
        _mm512_max_ps(_mm512_and_ps(x0, sign_off), _mm512_and_ps(x1, sign_off)));
    const __m512 id = _mm512_set1_ps(q8_inverse_scale(amax));
    const float d = q8_scale(amax);
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, id));
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, id));
    int8_t* gq = qs + (b / 4) * 128 + 16 * (b % 4);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(gq), _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(gq + 64), _mm512_cvtepi32_epi8(q1));
    const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    _mm_storeu_ps(da + (b / 4) * 16 + 4 * (b % 4), _mm_set1_ps(d));
    s[b] = d * static_cast<float>(sum);
  }
  for (int64_t b = L.nb; b < 4 * L.ng; ++b) {
    int8_t* gq = qs + (b / 4) * 128 + 16 * (b % 4);
    std::memset(gq, 0, 16);
    std::memset(gq + 64, 0, 16);
    _mm_storeu_ps(da + (b / 4) * 16 + 4 * (b % 4), _mm_setzero_ps());
  }
  for (int64_t b = L.nb; b < 16 * L.nch; ++b) s[b] = 0.0f;
}

// ---------------------------------------------------------------------------------------------
// Weight groups: four consecutive blocks of one row -> lo / hi unsigned quants in the interleaved
// order, dw (lanes 4j..4j+3 = d of block j) and c (lane j = the block's offset term).

struct Group {
  __m512i lo, hi;
  __m512 dw;
  __m128 c;
};

inline __m512 spread4(__m128 d4) {  // [d0 d1 d2 d3] -> each repeated over its 128-bit lane
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                               _mm512_castps128_ps512(d4));
}

struct FmtQ4_0 {
  static constexpr int kBlockBytes = sizeof(BlockQ4_0);
  // nblk < 4 only for a row's last group; masked loads then keep the reads inside the row.
  static Group load(const uint8_t* p, int nblk) {
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
    alignas(64) static constexpr int16_t kDWords[32] = {0, 9, 18, 27};
    const __m512i qs = _mm512_permutex2var_epi16(v0, _mm512_load_si512(kQsWords), v1);
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    const __m512i dv = _mm512_permutexvar_epi16(_mm512_load_si512(kDWords), v0);
    const __m128 d4 = _mm_cvtph_ps(_mm512_castsi512_si128(dv));
    return {_mm512_and_si512(qs, m4), _mm512_and_si512(_mm512_srli_epi16(qs, 4), m4), spread4(d4),
            _mm_mul_ps(d4, _mm_set1_ps(-8.0f))};
  }
};

struct FmtQ4_1 {
  static constexpr int kBlockBytes = sizeof(BlockQ4_1);
  static Group load(const uint8_t* p, int nblk) {
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
    const __m512i qs = _mm512_permutex2var_epi32(v0, idx, v1);
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    const __m512i dmv = _mm512_permutexvar_epi32(
        _mm512_setr_epi32(0, 5, 10, 15, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), v0);
    const __m256 dm = _mm256_cvtph_ps(_mm512_castsi512_si128(dmv));  // d0 m0 d1 m1 d2 m2 d3 m3
    const __m512 dw = _mm512_permutexvar_ps(
        _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6), _mm512_castps256_ps512(dm));
    const __m128 c =
        _mm256_castps256_ps128(_mm256_permutevar8x32_ps(dm, _mm256_setr_epi32(1, 3, 5, 7, 1, 3, 5, 7)));
    return {_mm512_and_si512(qs, m4), _mm512_and_si512(_mm512_srli_epi16(qs, 4), m4), dw, c};
  }
};

struct FmtQ8_0 {
  static constexpr int kBlockBytes = sizeof(BlockQ8_0);
  static Group load(const uint8_t* p, int nblk) {
    auto ld = [&](int j, int off) {
      return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + kBlockBytes * j + 2 + off));
    };
    __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
    __m128i dh;
    if (nblk == 4) {
      lo = _mm512_inserti32x4(_mm512_castsi128_si512(ld(0, 0)), ld(1, 0), 1);
      lo = _mm512_inserti32x4(_mm512_inserti32x4(lo, ld(2, 0), 2), ld(3, 0), 3);
      hi = _mm512_inserti32x4(_mm512_castsi128_si512(ld(0, 16)), ld(1, 16), 1);
      hi = _mm512_inserti32x4(_mm512_inserti32x4(hi, ld(2, 16), 2), ld(3, 16), 3);
      // d of block j is word 17j of the group: words 0 and 17 from the first 64 bytes, 34 and 51
      // from the next 64.
      alignas(64) static constexpr int16_t kDWords[32] = {0, 17, 34, 51};
      const __m512i v0 = _mm512_loadu_si512(p), v1 = _mm512_loadu_si512(p + 64);
      dh = _mm512_castsi512_si128(_mm512_permutex2var_epi16(v0, _mm512_load_si512(kDWords), v1));
    } else {
      alignas(16) uint16_t d[8] = {};
      alignas(64) uint8_t l[64] = {}, h[64] = {};
      for (int j = 0; j < nblk; ++j) {
        std::memcpy(&d[j], p + kBlockBytes * j, 2);
        std::memcpy(l + 16 * j, p + kBlockBytes * j + 2, 16);
        std::memcpy(h + 16 * j, p + kBlockBytes * j + 18, 16);
      }
      // Missing blocks stay zero: after the +128 below their lanes meet zero activations and d = 0.
      lo = _mm512_load_si512(l);
      hi = _mm512_load_si512(h);
      dh = _mm_load_si128(reinterpret_cast<const __m128i*>(d));
    }
    const __m128 d4 = _mm_cvtph_ps(dh);
    const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
    return {_mm512_xor_si512(lo, bias), _mm512_xor_si512(hi, bias), spread4(d4),
            _mm_mul_ps(d4, _mm_set1_ps(-128.0f))};
  }
};

// ---------------------------------------------------------------------------------------------
// 32-block GEMV (one token)

template <class Fmt>
void gemv32(const MatmulArgs& a, int64_t r0, int64_t r1) {
  const Layout32 L(a.w.n_in);
  const auto* aq = a.act;
  const auto* ada = reinterpret_cast<const float*>(a.act + L.da_off);
  const auto* as = reinterpret_cast<const float*>(a.act + L.s_off);
  OutputCollector out;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = a.w.data + r * a.w_row_bytes;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t ch = 0; ch < L.nch; ++ch) {
      __m512 c16 = _mm512_setzero_ps();
      const int64_t g_end = std::min(L.ng, 4 * ch + 4);
      for (int64_t g = 4 * ch; g < g_end; ++g) {
        const int nblk = static_cast<int>(std::min<int64_t>(4, L.nb - 4 * g));
        const Group w = Fmt::load(row + 4 * g * Fmt::kBlockBytes, nblk);
        __m512i isum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w.lo, _mm512_load_si512(aq + 128 * g));
        isum = _mm512_dpbusd_epi32(isum, w.hi, _mm512_load_si512(aq + 128 * g + 64));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(w.dw, _mm512_load_ps(ada + 16 * g)),
                              acc);
        c16 = _mm512_mask_broadcast_f32x4(c16, static_cast<__mmask16>(0xf << (4 * (g - 4 * ch))), w.c);
      }
      acc = _mm512_fmadd_ps(c16, _mm512_load_ps(as + 16 * ch), acc);
    }
    out.add(acc, a.y + r);
  }
  out.flush();
}

// ---------------------------------------------------------------------------------------------
// 32-block GEMM: a tile of 4 weight rows is unpacked once into scratch (per row: lo/hi quants
// [ng][128], dw [ng][16], c [nch][16]) and multiplied with the tokens 4 at a time, 16 accumulators
// in registers.

struct Unpacked32 {
  size_t dw_off, c_off, row_bytes;
  explicit Unpacked32(const Layout32& L)
      : dw_off(static_cast<size_t>(L.ng) * 128), c_off(dw_off + static_cast<size_t>(L.ng) * 64),
        row_bytes(c_off + static_cast<size_t>(L.nch) * 64) {}
};

template <class Fmt>
void unpack_rows32(const MatmulArgs& a, const Layout32& L, const Unpacked32& U, int64_t r0, uint8_t* dst) {
  for (int i = 0; i < 4; ++i) {
    uint8_t* u = dst + i * U.row_bytes;
    auto* c = reinterpret_cast<float*>(u + U.c_off);
    std::memset(c, 0, static_cast<size_t>(L.nch) * 64);
    if (r0 + i >= a.w.n_out) {  // padding row: zero scales make its (discarded) outputs zero
      std::memset(u, 0, U.c_off);
      continue;
    }
    const uint8_t* row = a.w.data + (r0 + i) * a.w_row_bytes;
    for (int64_t g = 0; g < L.ng; ++g) {
      const int nblk = static_cast<int>(std::min<int64_t>(4, L.nb - 4 * g));
      const Group w = Fmt::load(row + 4 * g * Fmt::kBlockBytes, nblk);
      _mm512_store_si512(u + 128 * g, w.lo);
      _mm512_store_si512(u + 128 * g + 64, w.hi);
      _mm512_store_ps(u + U.dw_off + 64 * g, w.dw);
      _mm_storeu_ps(c + 4 * g, w.c);
    }
  }
}

template <int T>
void tile32(const Layout32& L, const Unpacked32& U, const uint8_t* wt, const uint8_t* act,
            size_t act_stride, int n_rows, float* y, int64_t ldy) {
  __m512 acc[4][T];
  for (int r = 0; r < 4; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t ch = 0; ch < L.nch; ++ch) {
    const int64_t g_end = std::min(L.ng, 4 * ch + 4);
    for (int64_t g = 4 * ch; g < g_end; ++g) {
      for (int r = 0; r < 4; ++r) {
        const uint8_t* u = wt + r * U.row_bytes;
        const __m512i lo = _mm512_load_si512(u + 128 * g), hi = _mm512_load_si512(u + 128 * g + 64);
        const __m512 dw = _mm512_load_ps(u + U.dw_off + 64 * g);
        for (int t = 0; t < T; ++t) {
          const uint8_t* at = act + t * act_stride;
          __m512i isum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_load_si512(at + 128 * g));
          isum = _mm512_dpbusd_epi32(isum, hi, _mm512_load_si512(at + 128 * g + 64));
          const __m512 dx = _mm512_load_ps(at + L.da_off + 64 * g);
          acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(dw, dx), acc[r][t]);
        }
      }
    }
    for (int r = 0; r < 4; ++r) {
      const __m512 c = _mm512_load_ps(wt + r * U.row_bytes + U.c_off + 64 * ch);
      for (int t = 0; t < T; ++t)
        acc[r][t] = _mm512_fmadd_ps(c, _mm512_load_ps(act + t * act_stride + L.s_off + 64 * ch), acc[r][t]);
    }
  }
  __m512 v[16];
  for (int t = 0; t < 4; ++t)
    for (int r = 0; r < 4; ++r) v[4 * t + r] = t < T ? acc[r][t] : _mm512_setzero_ps();
  store_tile(reduce16(v), T, n_rows, y, ldy);
}

template <class Fmt>
void gemm32(const MatmulArgs& a, int64_t r0, int64_t r1, uint8_t* scratch) {
  const Layout32 L(a.w.n_in);
  const Unpacked32 U(L);
  const int64_t ldy = a.w.n_out;
  for (int64_t rt = r0; rt < r1; rt += 4) {
    unpack_rows32<Fmt>(a, L, U, rt, scratch);
    const int n_rows = static_cast<int>(std::min<int64_t>(4, r1 - rt));
    int64_t t = 0;
    for (; t + 4 <= a.n_tokens; t += 4)
      tile32<4>(L, U, scratch, a.act + t * a.act_stride, a.act_stride, n_rows, a.y + t * ldy + rt, ldy);
    const uint8_t* at = a.act + t * a.act_stride;
    float* yt = a.y + t * ldy + rt;
    switch (a.n_tokens - t) {
      case 3: tile32<3>(L, U, scratch, at, a.act_stride, n_rows, yt, ldy); break;
      case 2: tile32<2>(L, U, scratch, at, a.act_stride, n_rows, yt, ldy); break;
      case 1: tile32<1>(L, U, scratch, at, a.act_stride, n_rows, yt, ldy); break;
      default: break;
    }
  }
}

template <class Fmt>
void matmul32(const MatmulArgs& a, int64_t r0, int64_t r1, uint8_t* scratch) {
  if (a.n_tokens == 1) gemv32<Fmt>(a, r0, r1);
  else gemm32<Fmt>(a, r0, r1, scratch);
}

size_t act_row_bytes(GgmlType type, int64_t n_in) {
  if (is_float_type(type)) return 0;
  if (is_k_quant(type)) return ActLayoutK(n_in).bytes;
  return Layout32(n_in).bytes;
}

void quantize_act(GgmlType type, const float* x, int64_t n_in, uint8_t* dst) {
  if (is_k_quant(type)) avx512_quantize_act_k(x, n_in, dst);
  else quantize_act32(x, n_in, dst);
}

size_t scratch_bytes(GgmlType type, int64_t n_in) {
  if (is_float_type(type) || is_k_quant(type)) return 0;
  const Layout32 L(n_in);
  return 4 * Unpacked32(L).row_bytes;
}

void matmul_rows(const MatmulArgs& a, int64_t r0, int64_t r1, uint8_t* scratch) {
  switch (a.w.type) {
    case GgmlType::Q4_0: matmul32<FmtQ4_0>(a, r0, r1, scratch); break;
    case GgmlType::Q4_1: matmul32<FmtQ4_1>(a, r0, r1, scratch); break;
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
  static const MatmulKernels k{"avx512", act_row_bytes, quantize_act, scratch_bytes, matmul_rows,
                               vec_dot, 4};
  return k;
}

}  // namespace kestrel::cpu::detail

#endif  // __x86_64__
