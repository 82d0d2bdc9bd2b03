// Per-head GEMMs of multi-head latent attention (mla_ops.h, mla_head_gemm): y_h = x_h . w_h^T for
// every head h, one launch for all heads.
//
// A block computes a 64-token x 64-output tile of one head: 4 warps along the tokens, each 16
// tokens x 64 outputs (8 mma.sync m16n8k16 accumulators), over the input in 64-wide steps that
// cp.async double-buffers in shared memory (x tile and w tile, rows of 64 bf16 with their 16-byte
// chunks XOR-swizzled by row % 8, so the ldmatrix reads of 8 rows hit 8 bank groups). Inputs past
// n_in, tokens past n_tokens and outputs past n_out are zero-filled in shared memory; the output
// is stored from the accumulators as bf16 pairs. The blocks of the first output tile also copy
// the query's RoPE part, rotated, beside the output (rope_dim > 0).
//
// Cost: the weights of all heads are read once per 64 tokens; at decode sizes (a few tokens) the
// GEMMs are memory-bound on them (DeepSeek-V2-Lite: W_UK^T and W_UV, 2 MiB each per layer), and
// up to 64 tokens take the decode form below.
#pragma once

#include "backend/cuda/device_common.cuh"
#include "backend/cuda/mla_ops.h"

namespace kestrel::cuda {

constexpr int kHgThreads = 128;
constexpr int kHgRows = 64;   // tokens per block (16 per warp)
constexpr int kHgCols = 64;   // outputs per block
constexpr int kHgK = 64;      // inputs per shared-memory step

// Element offset of chunk c (8 bf16) of row `row` in a [rows, 64] tile.
__device__ __forceinline__ int hg_swz(int row, int chunk) { return row * kHgK + ((chunk ^ (row & 7)) << 3); }

constexpr size_t mla_head_gemm_smem_bytes() { return 2 * static_cast<size_t>(kHgRows + kHgCols) * kHgK * 2; }

// Loads the x and w tiles of input step k0 into one stage (cp.async, committed by the caller).
__device__ __forceinline__ void hg_load_stage(__nv_bfloat16* sx, __nv_bfloat16* sw, const MlaHeadGemmArgs& a, int h,
                                              int64_t t0, int o0, int k0) {
  constexpr int kChunks = kHgK / 8;
  for (int i = threadIdx.x; i < (kHgRows + kHgCols) * kChunks; i += kHgThreads) {
    const int row = i / kChunks, c = i % kChunks;
    const int k = k0 + c * 8;
    if (row < kHgRows) {
      const int64_t t = t0 + row;
      const bool valid = t < a.n_tokens && k < a.n_in;
      const __nv_bfloat16* src = valid ? a.x + t * a.x_stride + h * a.x_head_stride + k : a.x;
      cp_async16(sx + hg_swz(row, c), src, valid);
    } else {
      const int o = o0 + row - kHgRows;
      const bool valid = o < a.n_out && k < a.n_in;
      const __nv_bfloat16* src = valid ? a.w + (static_cast<int64_t>(h) * a.n_out + o) * a.n_in + k : a.w;
      cp_async16(sw + hg_swz(row - kHgRows, c), src, valid);
    }
  }
}

// The query's RoPE part of the block's tokens and head: y_h[t, n_out + e] from x_h[t, n_in + e].
__device__ __forceinline__ void hg_rope(const MlaHeadGemmArgs& a, int h, int64_t t0, int rows) {
  const int half = a.rope_dim / 2;
  for (int i = threadIdx.x; i < rows * half; i += kHgThreads) {
    const int64_t t = t0 + i / half;
    if (t >= a.n_tokens) break;
    const int p = i % half;
    const int e0 = a.rotate_half ? p : 2 * p, e1 = a.rotate_half ? p + half : 2 * p + 1;
    const __nv_bfloat16* x = a.x + t * a.x_stride + h * a.x_head_stride + a.n_in;
    __nv_bfloat16* y = a.y + t * a.y_stride + h * a.y_head_stride + a.n_out;
    float c, s, y0, y1;
    rope_cos_sin(a.positions[t], a.position_scale, a.inv_freq[p], c, s);
    rope_rotate(__bfloat162float(x[e0]), __bfloat162float(x[e1]), c, s, y0, y1);
    y[e0] = __float2bfloat16_rn(y0);
    y[e1] = __float2bfloat16_rn(y1);
  }
}

// grid (ceil(n_out / 64), n_head, ceil(n_tokens / 64)), kHgThreads threads,
// mla_head_gemm_smem_bytes() of dynamic shared memory.
__global__ void __launch_bounds__(kHgThreads) mla_head_gemm_kernel(MlaHeadGemmArgs a) {
  KESTREL_PDL_ENTRY();
  KESTREL_DYNAMIC_SMEM(smem);
  auto* sx = reinterpret_cast<__nv_bfloat16*>(smem);  // [2][kHgRows][kHgK]
  auto* sw = sx + 2 * kHgRows * kHgK;                  // [2][kHgCols][kHgK]
  const int h = blockIdx.y;
  const int o0 = blockIdx.x * kHgCols;
  const int64_t t0 = static_cast<int64_t>(blockIdx.z) * kHgRows;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;

  const int n_steps = (a.n_in + kHgK - 1) / kHgK;
  hg_load_stage(sx, sw, a, h, t0, o0, 0);
  cp_async_commit();
  if (a.rope_dim > 0 && blockIdx.x == 0) hg_rope(a, h, t0, kHgRows);

  float acc[kHgCols / 8][4];
#pragma unroll
  for (int nt = 0; nt < kHgCols / 8; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
  for (int s = 0; s < n_steps; ++s) {
    const int buf = s & 1;
    if (s + 1 < n_steps) {
      hg_load_stage(sx + (buf ^ 1) * kHgRows * kHgK, sw + (buf ^ 1) * kHgCols * kHgK, a, h, t0, o0, (s + 1) * kHgK);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const __nv_bfloat16* x = sx + buf * kHgRows * kHgK;
    const __nv_bfloat16* w = sw + buf * kHgCols * kHgK;
#pragma unroll
    for (int kk = 0; kk < kHgK / 16; kk += 2) {
      uint32_t xa[4], xb[4];
      const int xrow = warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
      ldmatrix_x4(xa, x + hg_swz(xrow, kk * 2 + (lane >> 4)));
      ldmatrix_x4(xb, x + hg_swz(xrow, (kk + 1) * 2 + (lane >> 4)));
#pragma unroll
      for (int nt = 0; nt < kHgCols / 8; ++nt) {
        uint32_t b[4];
        ldmatrix_x4(b, w + hg_swz(nt * 8 + (lane & 7), kk * 2 + (lane >> 3)));
        const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
        mma_bf16_16816(acc[nt], xa, b0);
        mma_bf16_16816(acc[nt], xb, b1);
      }
    }
    __syncthreads();  // the stage is refilled next
  }

  const int g = lane / 4, c2 = (lane % 4) * 2;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t t = t0 + warp * 16 + g + 8 * r;
    if (t >= a.n_tokens) continue;
    __nv_bfloat16* y = a.y + t * a.y_stride + h * a.y_head_stride;
#pragma unroll
    for (int nt = 0; nt < kHgCols / 8; ++nt) {
      const int o = o0 + nt * 8 + c2;
      if (o < a.n_out) *reinterpret_cast<uint32_t*>(y + o) = pack_bf16x2(acc[nt][2 * r], acc[nt][2 * r + 1]);
    }
  }
}

// The decode form (at most kHgSkinnyMaxTokens tokens): a block computes 16 outputs of one head for
// kHgSkinnyTokens tokens (grid z: the token groups, each rereading the head's rows from L2), the input dims shared out over the 4 warps (k16 steps w, w + 4, ...) and the warps'
// partial sums added through shared memory; the head's 16 weight rows and the tokens' inputs are
// loaded whole, once (rows padded to an odd number of 16-byte chunks). So the weights are spread
// over n_head x n_out / 16 blocks (DeepSeek-V2-Lite's W_UV: 128 blocks of 16 KB; the tiled kernel
// would use 32 blocks of 64 KB, each a chain of dependent loads).
constexpr int kHgSkinnyTokens = 16;      // tokens per block
constexpr int kHgSkinnyMaxTokens = 64;   // beyond: the tiled kernel, which reads the weights once per 64
constexpr int kHgSkinnyCols = 16;
constexpr int kHgSkinnyMaxIn = 1024;

__host__ __device__ constexpr int hg_skinny_stride(int n_in) { return (n_in + 15) / 16 * 16 + 8; }
constexpr size_t mla_head_gemm_skinny_smem_bytes(int n_in) {
  return static_cast<size_t>(kHgSkinnyTokens + kHgSkinnyCols) * hg_skinny_stride(n_in) * 2 +
         static_cast<size_t>(kHgThreads / kWarpSize) * kHgSkinnyTokens * kHgSkinnyCols * 4;
}

// grid (ceil(n_out / 16), n_head, ceil(n_tokens / 16)), kHgThreads threads,
// mla_head_gemm_skinny_smem_bytes(n_in).
__global__ void __launch_bounds__(kHgThreads) mla_head_gemm_skinny_kernel(MlaHeadGemmArgs a) {
  KESTREL_PDL_ENTRY();
  KESTREL_DYNAMIC_SMEM(smem);
  const int stride = hg_skinny_stride(a.n_in), chunks = stride / 8 - 1;  // data (and zero) chunks per row
  auto* sx = reinterpret_cast<__nv_bfloat16*>(smem);  // [kHgSkinnyTokens][stride]
  auto* sw = sx + kHgSkinnyTokens * stride;            // [kHgSkinnyCols][stride]
  auto* red = reinterpret_cast<float*>(sw + kHgSkinnyCols * stride);  // [warps][tokens][cols]
  const int h = blockIdx.y, o0 = blockIdx.x * kHgSkinnyCols;
  const int64_t t0 = static_cast<int64_t>(blockIdx.z) * kHgSkinnyTokens;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  for (int i = threadIdx.x; i < (kHgSkinnyTokens + kHgSkinnyCols) * chunks; i += kHgThreads) {
    const int row = i / chunks, c = i % chunks, k = c * 8;
    if (row < kHgSkinnyTokens) {
      const bool valid = t0 + row < a.n_tokens && k < a.n_in;
      cp_async16(sx + row * stride + k, valid ? a.x + (t0 + row) * a.x_stride + h * a.x_head_stride + k : a.x, valid);
    } else {
      const int o = o0 + row - kHgSkinnyTokens;
      const bool valid = o < a.n_out && k < a.n_in;
      cp_async16(sw + (row - kHgSkinnyTokens) * stride + k,
                 valid ? a.w + (static_cast<int64_t>(h) * a.n_out + o) * a.n_in + k : a.w, valid);
    }
  }
  cp_async_commit();
  if (a.rope_dim > 0 && blockIdx.x == 0) hg_rope(a, h, t0, kHgSkinnyTokens);
  cp_async_wait<0>();
  __syncthreads();

  float acc[2][4] = {};
  const int k_steps = chunks / 2;
  for (int kk = warp; kk < k_steps; kk += kHgThreads / kWarpSize) {
    uint32_t xa[4], b[4];
    ldmatrix_x4(xa, sx + ((lane & 7) + ((lane >> 3) & 1) * 8) * stride + (kk * 2 + (lane >> 4)) * 8);
    ldmatrix_x4(b, sw + ((lane >> 4) * 8 + (lane & 7)) * stride + (kk * 2 + ((lane >> 3) & 1)) * 8);
    const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
    mma_bf16_16816(acc[0], xa, b0);
    mma_bf16_16816(acc[1], xa, b1);
  }
  const int g = lane / 4, c2 = (lane % 4) * 2;
  float* mine = red + warp * kHgSkinnyTokens * kHgSkinnyCols;
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    mine[g * kHgSkinnyCols + nt * 8 + c2] = acc[nt][0];
    mine[g * kHgSkinnyCols + nt * 8 + c2 + 1] = acc[nt][1];
    mine[(g + 8) * kHgSkinnyCols + nt * 8 + c2] = acc[nt][2];
    mine[(g + 8) * kHgSkinnyCols + nt * 8 + c2 + 1] = acc[nt][3];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kHgSkinnyTokens * kHgSkinnyCols / 2; i += kHgThreads) {
    const int t = i / (kHgSkinnyCols / 2), col = (i % (kHgSkinnyCols / 2)) * 2, o = o0 + col;
    if (t0 + t >= a.n_tokens || o >= a.n_out) continue;
    float y0 = 0.0f, y1 = 0.0f;
#pragma unroll
    for (int w = 0; w < kHgThreads / kWarpSize; ++w) {
      y0 += red[(w * kHgSkinnyTokens + t) * kHgSkinnyCols + col];
      y1 += red[(w * kHgSkinnyTokens + t) * kHgSkinnyCols + col + 1];
    }
    *reinterpret_cast<uint32_t*>(a.y + (t0 + t) * a.y_stride + h * a.y_head_stride + o) = pack_bf16x2(y0, y1);
  }
}

}  // namespace kestrel::cuda
