// The grouped GEMM of a mixture-of-experts layer: every expert's rows in one launch (moe_gemm in
// moe_ops.h).
//
// Design:
// - Block (i, j) takes row tile i (kBT rows of one expert, tile_expert[i]; -1: exit before any
//   load) and weight-row tile j: 128 rows of the expert's matrix. The weights are the mma A side
//   (16 rows per m-tile, two m-tiles per warp, four warps), the tile's rows the B side (kBT / 8
//   n-tiles), so a decode step's few rows per expert cost no padding of the weight side: a tile of
//   8 rows is one n-tile, and each weight byte is read once per row tile.
// - K is walked in steps of 64 through a kStages-deep cp.async ring in shared memory (16-byte
//   copies; chunks past n_in, weight rows past n_out and padding rows zero-filled), rows of 128
//   bytes with their 16-byte chunks XOR-swizzled by (row % 8), so the ldmatrix reads of 8 rows hit
//   8 different bank groups (as paged_attention.cuh's tiles).
// - SwiGLU (gate|up): a warp's two m-tiles are 16 gate rows and the 16 up rows of the same
//   columns, so each lane holds gate and up of the same (row, column) and forms silu(g) * u in f32;
//   a block covers 64 columns. Down: a warp's m-tiles are 32 consecutive rows; 128 columns.
// - Rows are independent: a row's sums run over k in one fixed order whatever else is in its tile,
//   so a token's result does not depend on the batch around it.
// - Small row tiles (decode: a few rows per expert) take moe_skinny_kernel instead: the skinny GEMM's
//   block (skinny_gemm.cuh: 16 weight rows straight from global memory into mma A fragments, the
//   warps splitting k, partial sums met in shared memory) on one expert's matrix, so that a
//   decode step's few experts are spread over many small blocks (DeepSeek-V2-Lite at batch 1: 1056
//   blocks for gate|up instead of 132) with many loads in flight per SM. SwiGLU pairs 8 gate rows
//   with the 8 up rows of the same columns (rows g and g + 8 of the block), so silu(g) * u is formed
//   from the f32 sums as in the tiled kernel. Two blocks per SM (__launch_bounds__: 128 registers,
//   a few bytes spilled): with 139 registers one block fitted and gate|up took 30 us, not 22 us.
// Source: fragment layouts of PTX ISA 8.x ("Matrix fragments for mma.m16n8k16", "ldmatrix").
#pragma once

#include "backend/cuda/device_common.cuh"
#include "backend/cuda/moe_ops.h"
#include "backend/cuda/silu_mul.cuh"
#include "backend/cuda/skinny_gemm.cuh"

namespace kestrel::cuda {

constexpr int kMoeGemmWarps = 4;
constexpr int kMoeGemmThreads = kMoeGemmWarps * kWarpSize;
constexpr int kMoeGemmBK = 64;                          // k per stage
constexpr int kMoeGemmStages = 4;
constexpr int kMoeGemmWRows = kMoeGemmWarps * 32;       // weight rows per block (2 m-tiles per warp)
template <bool kSwiGLU>
constexpr int kMoeGemmCols = kSwiGLU ? kMoeGemmWRows / 2 : kMoeGemmWRows;  // output columns per block

template <int kBT>
constexpr size_t moe_gemm_smem_bytes() {
  return static_cast<size_t>(kMoeGemmStages) * (kMoeGemmWRows + kBT) * kMoeGemmBK * 2 + kBT * sizeof(int32_t);
}

struct MoeGemmParams {
  const __nv_bfloat16* x;
  const __nv_bfloat16* w;
  __nv_bfloat16* y;
  const int32_t* tile_expert;
  const int32_t* perm;
  int64_t w_expert_elems;  // elements of one expert's matrix
  int32_t n_in, n_out, top_k;
};

// Element offset of 16-byte chunk c of row `row` in a [rows, 64] tile.
__device__ __forceinline__ int moe_swz(int row, int c) { return row * kMoeGemmBK + ((c ^ (row & 7)) << 3); }

// grid (max_tiles, ceil(n_out / kMoeGemmCols<kSwiGLU>)), block kMoeGemmThreads, dynamic shared
// memory moe_gemm_smem_bytes<kBT>().
template <int kBT, bool kSwiGLU>
__global__ void __launch_bounds__(kMoeGemmThreads) moe_gemm_kernel(MoeGemmParams a) {
  static_assert(kBT == 8 || kBT % 16 == 0, "row tiles of 8 or a multiple of 16");
  constexpr int kNT = kBT / 8;
  KESTREL_DYNAMIC_SMEM(smem);
  KESTREL_PDL_ENTRY();
  const int tile = static_cast<int>(blockIdx.x);
  const int expert = a.tile_expert[tile];
  if (expert < 0) return;
  auto* sw = reinterpret_cast<__nv_bfloat16*>(smem);
  __nv_bfloat16* sx = sw + kMoeGemmStages * kMoeGemmWRows * kMoeGemmBK;
  auto* srow = reinterpret_cast<int32_t*>(sx + kMoeGemmStages * kBT * kMoeGemmBK);
  const int tid = static_cast<int>(threadIdx.x), warp = tid / kWarpSize, lane = tid % kWarpSize;
  for (int i = tid; i < kBT; i += kMoeGemmThreads) srow[i] = a.perm[static_cast<int64_t>(tile) * kBT + i];
  __syncthreads();

  const int n_in = a.n_in, n_out = a.n_out;
  const int col0 = static_cast<int>(blockIdx.y) * kMoeGemmCols<kSwiGLU>;
  const __nv_bfloat16* w = a.w + static_cast<int64_t>(expert) * a.w_expert_elems;
  const int nk = (n_in + kMoeGemmBK - 1) / kMoeGemmBK;

  auto load_stage = [&](int slot, int kt) {
    __nv_bfloat16* dw = sw + slot * kMoeGemmWRows * kMoeGemmBK;
    __nv_bfloat16* dx = sx + slot * kBT * kMoeGemmBK;
    const int k0 = kt * kMoeGemmBK;
    for (int i = tid; i < kMoeGemmWRows * 8; i += kMoeGemmThreads) {
      const int s = i / 8, c = i % 8, k = k0 + c * 8;
      int col;
      int64_t row;
      if constexpr (kSwiGLU) {  // row s: warp s / 32's m-tile (s / 16) % 2 (gate, up), row s % 16
        col = col0 + (s / 32) * 16 + s % 16;
        row = (s / 16) % 2 == 0 ? col : static_cast<int64_t>(n_out) + col;
      } else {
        col = col0 + s;
        row = col;
      }
      const bool valid = col < n_out && k < n_in;
      cp_async16(dw + moe_swz(s, c), valid ? w + row * n_in + k : a.w, valid);
    }
    for (int i = tid; i < kBT * 8; i += kMoeGemmThreads) {
      const int s = i / 8, c = i % 8, k = k0 + c * 8;
      const int32_t r = srow[s];
      const bool valid = r >= 0 && k < n_in;
      const int64_t src_row = kSwiGLU ? r / a.top_k : static_cast<int64_t>(tile) * kBT + s;
      cp_async16(dx + moe_swz(s, c), valid ? a.x + src_row * n_in + k : a.x, valid);
    }
  };

  float acc[2][kNT][4] = {};
#pragma unroll
  for (int s = 0; s < kMoeGemmStages - 1; ++s) {
    if (s < nk) load_stage(s, s);
    cp_async_commit();
  }
  const int a_row = (lane & 7) + ((lane >> 3) & 1) * 8;  // ldmatrix row of this lane in an m-tile
  for (int kt = 0; kt < nk; ++kt) {
    cp_async_wait<kMoeGemmStages - 2>();
    __syncthreads();  // stage kt landed for every thread; stage kt - 1 is no longer read
    const int next = kt + kMoeGemmStages - 1;
    if (next < nk) load_stage(next % kMoeGemmStages, next);
    cp_async_commit();
    const __nv_bfloat16* cw = sw + (kt % kMoeGemmStages) * kMoeGemmWRows * kMoeGemmBK;
    const __nv_bfloat16* cx = sx + (kt % kMoeGemmStages) * kBT * kMoeGemmBK;
#pragma unroll
    for (int kk2 = 0; kk2 < kMoeGemmBK / 32; ++kk2) {
      // B fragments of two k-steps (2 kk2, 2 kk2 + 1) for every n-tile.
      uint32_t b[kNT][2][2];
      if constexpr (kNT == 1) {
        uint32_t r4[4];
        ldmatrix_x4(r4, cx + moe_swz(lane & 7, kk2 * 4 + (lane >> 3)));
        b[0][0][0] = r4[0], b[0][0][1] = r4[1], b[0][1][0] = r4[2], b[0][1][1] = r4[3];
      } else {
#pragma unroll
        for (int nt = 0; nt < kNT; nt += 2)
#pragma unroll
          for (int ks = 0; ks < 2; ++ks) {
            uint32_t r4[4];
            ldmatrix_x4(r4, cx + moe_swz((nt + (lane >> 4)) * 8 + (lane & 7), (kk2 * 2 + ks) * 2 + ((lane >> 3) & 1)));
            b[nt][ks][0] = r4[0], b[nt][ks][1] = r4[1], b[nt + 1][ks][0] = r4[2], b[nt + 1][ks][1] = r4[3];
          }
      }
#pragma unroll
      for (int ks = 0; ks < 2; ++ks) {
        const int kk = kk2 * 2 + ks;
        uint32_t af[2][4];
#pragma unroll
        for (int mi = 0; mi < 2; ++mi) ldmatrix_x4(af[mi], cw + moe_swz(warp * 32 + mi * 16 + a_row, kk * 2 + (lane >> 4)));
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
          for (int mi = 0; mi < 2; ++mi) mma_bf16_16816(acc[mi][nt], af[mi], b[nt][ks]);
      }
    }
  }
  cp_async_wait<0>();

  // acc[mi][nt][e]: weight row g + 8 (e >= 2) of m-tile mi, tile row 8 nt + 2 t + (e & 1).
  const int g = lane / 4, t4 = lane % 4;
#pragma unroll
  for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int s = 8 * nt + 2 * t4 + (e & 1);
      const int32_t r = srow[s];
      if (r < 0) continue;
      if constexpr (kSwiGLU) {
        const int col = col0 + warp * 16 + g + (e >= 2 ? 8 : 0);
        if (col >= n_out) continue;
        const int64_t p = static_cast<int64_t>(tile) * kBT + s;
        a.y[p * n_out + col] = __float2bfloat16_rn(silu(acc[0][nt][e]) * acc[1][nt][e]);
      } else {
#pragma unroll
        for (int mi = 0; mi < 2; ++mi) {
          const int col = col0 + warp * 32 + mi * 16 + g + (e >= 2 ? 8 : 0);
          if (col < n_out) a.y[static_cast<int64_t>(r) * n_out + col] = __float2bfloat16_rn(acc[mi][nt][e]);
        }
      }
    }
}

// Row tiles of kNT * 8 rows, skinny blocks. grid (max_tiles, ceil(n_out / 8)) for SwiGLU (8
// output columns: gate rows g, up rows g + 8), (max_tiles, ceil(n_out / 16)) for down; block
// kWarps warps.
template <int kNT, int kU, int kWarps, bool kSwiGLU>
__global__ void __launch_bounds__(kWarps * 32, 2) moe_skinny_kernel(MoeGemmParams a) {
  constexpr int kBT = 8 * kNT;
  KESTREL_PDL_ENTRY();  // tile_expert, perm and x are the previous kernels' outputs
  const int tile = static_cast<int>(blockIdx.x);
  const int expert = a.tile_expert[tile];
  if (expert < 0) return;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize, lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int g = lane / 4;
  const int n_in = a.n_in, n_out = a.n_out;
  const __nv_bfloat16* w = a.w + static_cast<int64_t>(expert) * a.w_expert_elems;
  // Rows past n_out load the last row; their sums are never stored.
  const int64_t last = n_out - 1;
  const __nv_bfloat16 *w_row0, *w_row1;
  if constexpr (kSwiGLU) {
    const int64_t col = static_cast<int64_t>(blockIdx.y) * 8 + g;
    w_row0 = w + (col < last ? col : last) * n_in;
    w_row1 = w + (n_out + (col < last ? col : last)) * n_in;
  } else {
    const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kSkinnyRows + g;
    w_row0 = w + (row0 < last ? row0 : last) * n_in;
    w_row1 = w + (row0 + 8 < last ? row0 + 8 : last) * n_in;
  }
  const int32_t* perm = a.perm + static_cast<int64_t>(tile) * kBT;
  const __nv_bfloat16* x_row[kNT];
  bool x_live[kNT];
#pragma unroll
  for (int j = 0; j < kNT; ++j) {
    const int s = 8 * j + g;
    const int32_t r = perm[s];
    x_live[j] = r >= 0;
    const int64_t src = kSwiGLU ? r / a.top_k : static_cast<int64_t>(tile) * kBT + s;
    x_row[j] = a.x + (x_live[j] ? src : 0) * n_in;
  }
  float acc[kNT][4] = {};
  skinny_warp_sums<kNT, kU, kWarps, false, false>(w_row0, w_row1, x_row, x_live, n_in, warp, acc);

  // acc[j][e]: weight row g + 8 (e >= 2) of the block, tile row 8 j + 2 t + (e & 1).
  __shared__ SkinnyPartials<kNT, kWarps> partial;
  partial.put(warp, lane, acc);
  __syncthreads();
  for (int i = static_cast<int>(threadIdx.x); i < kNT * kWarpSize * 4; i += kWarps * kWarpSize) {
    const int j = i / (kWarpSize * 4), l = (i / 4) % kWarpSize, e = i % 4;
    const int s = 8 * j + 2 * (l % 4) + (e & 1);
    const int32_t r = perm[s];
    if (r < 0) continue;
    if constexpr (kSwiGLU) {
      const int64_t col = static_cast<int64_t>(blockIdx.y) * 8 + l / 4;
      if (e >= 2 || col >= n_out) continue;
      const int64_t p = static_cast<int64_t>(tile) * kBT + s;
      a.y[p * n_out + col] = __float2bfloat16_rn(silu(partial.sum(j, l, e)) * partial.sum(j, l, e + 2));
    } else {
      const int64_t row = static_cast<int64_t>(blockIdx.y) * kSkinnyRows + l / 4 + (e >= 2 ? 8 : 0);
      if (row < n_out) a.y[static_cast<int64_t>(r) * n_out + row] = __float2bfloat16_rn(partial.sum(j, l, e));
    }
  }
}

}  // namespace kestrel::cuda
