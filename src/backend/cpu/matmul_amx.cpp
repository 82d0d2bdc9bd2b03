// AMX-INT8 GEMM for 32-element block weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), used for prefill on CPUs with
// AMX (Sapphire Rapids and later) once the OS has granted the tile data permission.
//
// One TDPBUSD multiplies a 16-row x 32-byte weight tile (one block of 16 rows, u8 quants as in
// the AVX-512 kernels) by an 8 x 64-byte activation tile (the same block of 16 tokens, four
// consecutive int8 per token per row, the layout TDPBUSD wants) into 16 x 16 exact int32 block
// sums; a second TDPBUSD does the same for the second activation plane (quantize_block_q16), and
// AVX-512 combines the two (255 * S1 + S2, exact) and applies the scales. The arithmetic is the AVX-512 kernels' canonical one
// (quant_formats_avx512.h: per 16-block chunk, lane j = block j,
//   acc_j = fma(f32(isum), dw * dx, acc_j); acc_j = fma(c, s, acc_j); then the reduce16 tree),
// only with registers holding 16 tokens of one lane instead of 16 lanes of one token, so outputs
// are bitwise those of the GEMV: batch invariance holds across the AMX / AVX-512 switch.
//
// Activation layout of a call (token groups of 16, the last one zero-padded):
//   per group: int8 tiles[nb][2][8][64] | f32 dx[nb][16] | f32 s[nb][16]     (nb * 1152 bytes)
// (tiles[b][p]: block b, plane p).
#if defined(__x86_64__)

// First: it sets up <immintrin.h> (see simd_avx512.h).
#include "backend/cpu/quant_formats_avx512.h"

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "backend/cpu/matmul_avx512_internal.h"

namespace kestrel::cpu::detail {
namespace {

constexpr int64_t kGroupBlockBytes = 1152;  // one block of 16 tokens: 2 x 512 quant bytes, dx, s

struct AmxLayout {
  int64_t nb, n_groups;
  size_t group_bytes, dx_off, s_off;
  AmxLayout(int64_t n_in, int64_t n_tokens)
      : nb(n_in / 32), n_groups((n_tokens + 15) / 16), group_bytes(static_cast<size_t>(nb) * kGroupBlockBytes),
        dx_off(static_cast<size_t>(nb) * 1024), s_off(static_cast<size_t>(nb) * 1088) {}
};

// Unpacked weights of 16 rows: u8 quants [16][nbp][32] (nbp = nb rounded up to a whole chunk of
// 16), then f32 dw and c [nbp][16] (block-major, so scaling one block reads one line of each).
struct AmxUnpacked {
  int64_t nbp;
  size_t row_stride, dw_off, c_off, bytes;
  explicit AmxUnpacked(int64_t nb)
      : nbp((nb + 15) / 16 * 16), row_stride(static_cast<size_t>(nbp) * 32), dw_off(16 * row_stride),
        c_off(dw_off + static_cast<size_t>(16 * nbp) * 4), bytes(c_off + static_cast<size_t>(16 * nbp) * 4) {}
};

// Palette 1: tmm0 / tmm1 and tmm6 / tmm7 hold C (16 x 16 int32) of planes 1 and 2 for two blocks,
// tmm2 / tmm3 their A (16 rows x 32 bytes), tmm4 / tmm5 B (8 rows x 64 bytes) of planes 1 and 2.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 32, 32, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 8, 8, 16, 16};
};

bool request_amx() {
#if defined(SYS_arch_prctl)
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool amx_tile = d & (1u << 24), amx_int8 = d & (1u << 25);
  if (!amx_tile || !amx_int8) return false;
  if (!(cpu_features().avx512f && cpu_features().avx512bw && cpu_features().avx512vnni)) return false;
  // Linux keeps the 8 KiB tile state off until a process asks (ARCH_REQ_XCOMP_PERM for
  // XFEATURE_XTILEDATA); the grant covers every thread of the process.
  constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

template <class Fmt>
void unpack_rows(const MatmulArgs& a, int64_t nb, const AmxUnpacked& U, int64_t r0, int n_rows, uint8_t* dst) {
  auto* dw = reinterpret_cast<float*>(dst + U.dw_off);
  auto* cw = reinterpret_cast<float*>(dst + U.c_off);
  if (n_rows < 16) {  // padding rows take part in the tiles: zero quants and scales
    std::memset(dst + n_rows * U.row_stride, 0, (16 - n_rows) * U.row_stride);
    std::memset(dw, 0, static_cast<size_t>(16 * U.nbp) * 4);
    std::memset(cw, 0, static_cast<size_t>(16 * U.nbp) * 4);
  }
  const __m512i by_block = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                              _mm512_set1_epi32(16));
  // Grouped lo / hi quants of 4 blocks -> 32 bytes per block in element order.
  const __m512i first = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
  const __m512i second = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
  for (int i = 0; i < n_rows; ++i) {
    const uint8_t* row = a.w.data + (r0 + i) * a.w_row_bytes;
    uint8_t* q = dst + i * U.row_stride;
    for (int64_t c = 0; 16 * c < nb; ++c) {
      __m512i sc = _mm512_setzero_si512();
      for (int g = 0; g < 4 && 16 * c + 4 * g < nb; ++g) {
        const int64_t b = 16 * c + 4 * g;
        const Group grp = Fmt::load_group(row + b * Fmt::kBlockBytes, static_cast<int>(std::min<int64_t>(4, nb - b)));
        _mm512_store_si512(q + 32 * b, _mm512_permutex2var_epi64(grp.lo, first, grp.hi));
        _mm512_store_si512(q + 32 * b + 64, _mm512_permutex2var_epi64(grp.lo, second, grp.hi));
        sc = _mm512_mask_broadcast_i32x4(sc, static_cast<__mmask16>(0xf << (4 * g)), grp.sc);
      }
      __m512 d16, c16;
      Fmt::scales(sc, d16, c16);
      _mm512_i32scatter_ps(dw + 256 * c + i, by_block, d16, 4);
      _mm512_i32scatter_ps(cw + 256 * c + i, by_block, c16, 4);
    }
  }
}

// Scales one block's 16 x 16 sums of both planes (row-major int32: plane 1 at sums, plane 2 at
// sums + 256) into the lane accumulators F[r] (lanes = tokens).
inline void scale_block(const int32_t* sums, const float* dw, const float* cw, int64_t b, __m512 dx,
                        __m512 s, __m512 F[16]) {
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) {
    const __m512i isum = combine_planes(_mm512_load_si512(sums + 16 * r), _mm512_load_si512(sums + 256 + 16 * r));
    F[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(_mm512_set1_ps(dw[16 * b + r]), dx), F[r]);
    F[r] = _mm512_fmadd_ps(_mm512_set1_ps(cw[16 * b + r]), s, F[r]);
  }
}

// Block sums of one or two blocks (b0, and b1 if has1) against both activation planes, stored at
// dst0 / dst1 (plane 1, then plane 2 at +256). Block b0 uses C tiles tmm0 / tmm1 and A tmm2,
// block b1 tmm6 / tmm7 and tmm3; both load their planes into B tiles tmm4 / tmm5. The stores come
// after both blocks' multiplies, so the two blocks' TDPBUSDs overlap. (GCC's tile intrinsics
// paste the register number into the instruction text, so it must be a literal.)
inline void block_sums(const uint8_t* wt, size_t w_stride, const uint8_t* act, int64_t b0, int64_t b1, bool has1,
                       int32_t* dst0, int32_t* dst1) {
  _tile_loadd(2, wt + 32 * b0, w_stride);
  _tile_loadd(4, act + 1024 * b0, 64);
  _tile_loadd(5, act + 1024 * b0 + 512, 64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_dpbusd(0, 2, 4);
  _tile_dpbusd(1, 2, 5);
  if (has1) {
    _tile_loadd(3, wt + 32 * b1, w_stride);
    _tile_loadd(4, act + 1024 * b1, 64);
    _tile_loadd(5, act + 1024 * b1 + 512, 64);
    _tile_zero(6);
    _tile_zero(7);
    _tile_dpbusd(6, 3, 4);
    _tile_dpbusd(7, 3, 5);
  }
  _tile_stored(0, dst0, 64);
  _tile_stored(1, dst0 + 256, 64);
  if (has1) {
    _tile_stored(6, dst1, 64);
    _tile_stored(7, dst1 + 256, 64);
  }
}

// 16 rows x 16 tokens.
// lanes: [16 lanes][16 rows][16 tokens] f32; ring: 2 * 512 * ceil(nb / 16) int32 (the block sums
// of two lanes, both planes).
void tile16(const AmxLayout& L, const AmxUnpacked& U, const uint8_t* wt, const uint8_t* act, int n_tok, int n_rows,
            float* y, int64_t ldy, float* lanes, int32_t* ring) {
  const auto* dw = reinterpret_cast<const float*>(wt + U.dw_off);
  const auto* cw = reinterpret_cast<const float*>(wt + U.c_off);
  const auto* dx = reinterpret_cast<const float*>(act + L.dx_off);
  const auto* s = reinterpret_cast<const float*>(act + L.s_off);
  // Blocks go lane by lane (lane l: blocks l, l + 16, ... in chunk order), so a lane's 16 row
  // accumulators stay in registers until it is done. The tile work of lane l + 1 (multiply, store
  // the sums) is issued before lane l's sums are scaled, so the two overlap; and no tile
  // instruction sits inside the scaling loop (GCC's tile intrinsics are asm statements that
  // clobber memory and would push the accumulators out of registers).
  const int64_t nb = L.nb;
  const int64_t n_ch = (nb + 15) / 16;
  int32_t* sums[2] = {ring, ring + 512 * n_ch};  // [n_ch][2][256] for two lanes
  auto issue_lane = [&](int64_t l, int32_t* dst) {
    for (int64_t c = 0; 16 * c + l < nb; c += 2)
      block_sums(wt, U.row_stride, act, 16 * c + l, 16 * (c + 1) + l, 16 * (c + 1) + l < nb, dst + 512 * c,
                 dst + 512 * (c + 1));
  };
  const int64_t n_lanes = std::min<int64_t>(16, nb);
  issue_lane(0, sums[0]);
  for (int64_t l = 0; l < 16; ++l) {
    if (l + 1 < n_lanes) issue_lane(l + 1, sums[(l + 1) % 2]);
    __m512 F[16];
    for (int r = 0; r < 16; ++r) F[r] = _mm512_setzero_ps();
    for (int64_t b = l; b < nb; b += 16)
      scale_block(sums[l % 2] + 512 * (b / 16), dw, cw, b, _mm512_load_ps(dx + 16 * b), _mm512_load_ps(s + 16 * b), F);
    for (int r = 0; r < 16; ++r) _mm512_store_ps(lanes + 256 * l + 16 * r, F[r]);
  }
  // The reduce16 tree over lanes: ((l0 + l2) + (l1 + l3)) per quad, then (q0 + q1) + (q2 + q3).
  alignas(64) float out[16][16];  // [row][token]
  for (int r = 0; r < 16; ++r) {
    auto lane = [&](int l) { return _mm512_load_ps(lanes + 256 * l + 16 * r); };
    __m512 q[4];
    for (int k = 0; k < 4; ++k)
      q[k] = _mm512_add_ps(_mm512_add_ps(lane(4 * k), lane(4 * k + 2)), _mm512_add_ps(lane(4 * k + 1), lane(4 * k + 3)));
    _mm512_store_ps(out[r], _mm512_add_ps(_mm512_add_ps(q[0], q[1]), _mm512_add_ps(q[2], q[3])));
  }
  const __m512i column = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(16));
  for (int t = 0; t < n_tok; ++t)
    _mm512_mask_storeu_ps(y + t * ldy, lane_mask(n_rows), _mm512_i32gather_ps(column, &out[0][t], 4));
}

template <class Fmt>
void gemm(const MatmulArgs& a, int64_t r0, int64_t r1, uint8_t* scratch) {
  const AmxLayout L(a.w.n_in, a.n_tokens);
  const AmxUnpacked U(L.nb);
  auto* lanes = reinterpret_cast<float*>(scratch + align64(U.bytes));
  auto* ring = reinterpret_cast<int32_t*>(scratch + align64(U.bytes) + 16 * 16 * 16 * sizeof(float));
  static const TileConfig config;
  _tile_loadconfig(&config);
  // Token groups in chunks of about 256 KiB of activations, so a chunk stays in L2 while every
  // row stripe passes over it (a long prompt's activations would otherwise stream from memory
  // once per 16 rows). A stripe is unpacked once per chunk; each output is computed the same way
  // whatever the chunking, so results do not depend on the batch.
  const int64_t chunk = std::max<int64_t>(1, (int64_t{256} << 10) / static_cast<int64_t>(L.group_bytes));
  for (int64_t g0 = 0; g0 < L.n_groups; g0 += chunk) {
    const int64_t g1 = std::min<int64_t>(L.n_groups, g0 + chunk);
    for (int64_t r = r0; r < r1; r += 16) {
      const int n_rows = static_cast<int>(std::min<int64_t>(16, r1 - r));
      unpack_rows<Fmt>(a, L.nb, U, r, n_rows, scratch);
      for (int64_t g = g0; g < g1; ++g) {
        const int n_tok = static_cast<int>(std::min<int64_t>(16, a.n_tokens - 16 * g));
        tile16(L, U, scratch, a.act + g * L.group_bytes, n_tok, n_rows, a.y + 16 * g * a.w.n_out + r, a.w.n_out,
               lanes, ring);
      }
    }
  }
  // Drop the tile state so context switches do not have to save 8 KiB per thread.
  _tile_release();
}

}  // namespace

bool amx_usable() {
  static const bool usable = request_amx();
  return usable;
}

size_t amx_act_bytes(int64_t n_in, int64_t n_tokens) {
  const AmxLayout L(n_in, n_tokens);
  return static_cast<size_t>(L.n_groups) * L.group_bytes;
}

void amx_quantize_acts(const float* x, int64_t n_in, int64_t n_tokens, int64_t t0, int64_t t1, bool bits8,
                       uint8_t* dst) {
  const AmxLayout L(n_in, n_tokens);
  for (int64_t t = t0; t < t1; ++t) {
    uint8_t* g = dst + (t / 16) * L.group_bytes;
    auto* dx = reinterpret_cast<float*>(g + L.dx_off) + t % 16;
    auto* s = reinterpret_cast<float*>(g + L.s_off) + t % 16;
    uint8_t* col = g + 4 * (t % 16);
    for (int64_t b = 0; b < L.nb; ++b) {
      alignas(32) int8_t q[2][32];
      quantize_block32(x + t * n_in + 32 * b, bits8, q[0], q[1], dx[16 * b], s[16 * b]);
      for (int p = 0; p < 2; ++p)
        for (int k = 0; k < 8; ++k) std::memcpy(col + 1024 * b + 512 * p + 64 * k, q[p] + 4 * k, 4);
    }
  }
  if (t1 == n_tokens && n_tokens % 16 != 0) {  // zero the padding tokens of the last group
    uint8_t* g = dst + (n_tokens / 16) * L.group_bytes;
    const int64_t first = n_tokens % 16;
    for (int64_t b = 0; b < L.nb; ++b) {
      for (int k = 0; k < 16; ++k) std::memset(g + 1024 * b + 64 * k + 4 * first, 0, 4 * (16 - first));
      std::memset(reinterpret_cast<float*>(g + L.dx_off) + 16 * b + first, 0, 4 * (16 - first));
      std::memset(reinterpret_cast<float*>(g + L.s_off) + 16 * b + first, 0, 4 * (16 - first));
    }
  }
}

size_t amx_scratch_bytes(int64_t n_in) {
  const int64_t n_ch = (n_in / 32 + 15) / 16;
  return align64(AmxUnpacked(n_in / 32).bytes) + 16 * 16 * 16 * sizeof(float) + 2 * 512 * n_ch * sizeof(int32_t);
}

void amx_matmul_rows(const MatmulArgs& a, int64_t r0, int64_t r1, uint8_t* scratch) {
  switch (a.w.type.storage) {
    case GgmlType::Q4_0: gemm<FmtQ4_0>(a, r0, r1, scratch); break;
    case GgmlType::Q4_1: gemm<FmtQ4_1>(a, r0, r1, scratch); break;
    case GgmlType::Q5_0: gemm<FmtQ5_0>(a, r0, r1, scratch); break;
    case GgmlType::Q5_1: gemm<FmtQ5_1>(a, r0, r1, scratch); break;
    case GgmlType::Q8_0: gemm<FmtQ8_0>(a, r0, r1, scratch); break;
    default: break;
  }
}

}  // namespace kestrel::cpu::detail

#endif  // __x86_64__
