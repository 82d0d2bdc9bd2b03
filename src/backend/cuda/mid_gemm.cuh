// GEMM for decode batches of 9 to 64 tokens: y[n_tokens, n_out] = a(x)[n_tokens, n_in] . W^T, where
// the time should be one pass over W at the memory's rate, and cuBLASLt's tiles (built for many
// tokens) leave 25-50% of it unused on the smaller projections (qkv, o, down of an 8B model at 64
// tokens: 2.0-3.0 TB/s of the H200's 4.25; docs/performance.md, issue 4).
//
// Design (skinny_gemm.cuh's GEMV, with the tokens in shared memory):
// - A block owns 16 x kGroups rows of W and one split of n_in (grid.y: split-K over blocks); its
//   kGroups x kSlices warps are a row group each (the M side of mma.sync m16n8k16) times a slice
//   of each k-chunk. The tokens are the N side, kNT tiles of 8.
// - W goes from global memory straight into mma A fragments with 16-byte loads, one chunk ahead
//   (the k permutation of skinny_gemm.cuh: lane (g, t) loads k 8t .. 8t + 7 of rows g and g + 8 per
//   k-step of 32; B uses the same permutation, so the dot products are unchanged).
// - The tokens' k-chunk (kNT x 8 rows x kChunk k) goes through registers into one of two
//   shared-memory buffers (rows padded, see kMidXStride) while the other is read; x is read from L2 once per block instead of once per 16 rows. In
//   SwiGLU mode (x holds [gate | up] rows) the staging forms silu(gate) * up rounded to bf16 as
//   silu_mul does, so the down projection needs no activation kernel.
// - The slices' partial sums meet in shared memory; a block without split-K writes y, else it
//   writes f32 partial sums that mid_gemm_reduce_kernel adds up (in a fixed order: deterministic).
// Source: fragment layouts, PTX ISA 8.x "Matrix fragments for mma.m16n8k16"; split-K GEMM as in
// CUTLASS's documentation of the technique.
#pragma once

#include "backend/cuda/device_common.cuh"
#include "backend/cuda/silu_mul.cuh"
#include "backend/cuda/skinny_gemm.cuh"

namespace kestrel::cuda {

constexpr int kMidThreads = 256;  // 8 warps
constexpr int kMidChunk = 128;    // k per chunk (kSlices x 32 x kU)
// Elements between token rows of a staged chunk: 32 more than a chunk, so that rows g and g + 1
// start 16 banks apart and the 8 lanes of a 16-byte load phase (2 rows x 4 pieces) hit distinct banks.
constexpr int kMidXStride = kMidChunk + 32;

// Dynamic shared memory of mid_gemm_kernel: two staged chunks of kNT x 8 token rows (also holding,
// at the end, the warps' partial sums: 8 warps x kNT x 32 lanes x 4 f32).
template <int kNT>
constexpr size_t mid_gemm_smem_bytes() {
  return 2 * static_cast<size_t>(kNT) * 8 * kMidXStride * 2;
}
static_assert(2 * 8 * kMidXStride * 2 >= 8 * 32 * 4 * 4, "the staging buffers hold the partial sums (per token tile)");

// x: [n_tokens, *] rows x_stride elements apart (16-byte aligned; in kSwiGLU mode row t's gate is
// x[t, 0 .. n_in) and its up x[t, n_in .. 2 n_in)); w [n_out, n_in]; n_in % 8 == 0; k_split: the
// n_in of each grid.y split, a multiple of kMidChunk. grid.y == 1: y [n_tokens, n_out], f32 when
// kF32Out else bf16; else partial [grid.y, n_tokens, n_out] f32. grid (ceil(n_out / (16 kGroups)),
// splits), kMidThreads threads, mid_gemm_smem_bytes<kNT>(). PDL: the first weight chunk is
// requested before griddepcontrol.wait (weights are written by no kernel).
template <int kNT, int kGroups, bool kSwiGLU, bool kF32Out>
__global__ void __launch_bounds__(kMidThreads, 2)
    mid_gemm_kernel(const __nv_bfloat16* __restrict__ x, int64_t x_stride, const __nv_bfloat16* __restrict__ w,
                    void* __restrict__ y, float* __restrict__ partial, int n_tokens, int n_in, int n_out,
                    int k_split) {
  constexpr int kWarps = kMidThreads / kWarpSize, kSlices = kWarps / kGroups, kU = kMidChunk / (32 * kSlices);
  static_assert(kGroups * kSlices == kWarps && kSlices * 32 * kU == kMidChunk, "warps tile the chunk");
  constexpr int kRows = kNT * 8;                              // token rows staged
  constexpr int kXPer = kRows * (kMidChunk / 8) / kMidThreads;  // 16-byte pieces per thread
  static_assert(kRows * (kMidChunk / 8) % kMidThreads == 0, "whole staging rounds");
  const int tid = static_cast<int>(threadIdx.x), warp = tid / kWarpSize, lane = tid % kWarpSize;
  const int group = warp % kGroups, slice = warp / kGroups;
  const int g = lane / 4, t = lane % 4;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * 16 * kGroups + group * 16;
  const int64_t last = n_out - 1;  // rows past n_out load the last row; their sums are never stored
  const __nv_bfloat16* w_row0 = w + (row0 + g < last ? row0 + g : last) * n_in;
  const __nv_bfloat16* w_row1 = w + (row0 + g + 8 < last ? row0 + g + 8 : last) * n_in;
  const int k_begin = static_cast<int>(blockIdx.y) * k_split;
  const int k_end = min(n_in, k_begin + k_split);
  const int n_chunks = (k_end - k_begin + kMidChunk - 1) / kMidChunk;
  const uint4 zero = make_uint4(0, 0, 0, 0);

  KESTREL_DYNAMIC_SMEM(smem);
  auto* xs = reinterpret_cast<__nv_bfloat16*>(smem);  // [2][kRows][kMidXStride]

  uint4 w0[kU], w1[kU], nw0[kU], nw1[kU];  // this chunk's and the next one's A data
  auto load_w = [&](int c, uint4 (&r0)[kU], uint4 (&r1)[kU]) {
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int k = k_begin + c * kMidChunk + (slice * kU + u) * 32 + t * 8;
      r0[u] = k < k_end ? ld_stream16(w_row0 + k) : zero;
      r1[u] = k < k_end ? ld_stream16(w_row1 + k) : zero;
    }
  };
  uint4 xr[kXPer], ur[kSwiGLU ? kXPer : 1];
  auto load_x = [&](int c) {
#pragma unroll
    for (int i = 0; i < kXPer; ++i) {
      const int idx = tid + i * kMidThreads;
      const int row = idx / (kMidChunk / 8), piece = idx % (kMidChunk / 8);
      const int k = k_begin + c * kMidChunk + piece * 8;
      const bool live = row < n_tokens && k < k_end;
      const __nv_bfloat16* src = x + static_cast<int64_t>(live ? row : 0) * x_stride + (live ? k : 0);
      xr[i] = live ? *reinterpret_cast<const uint4*>(src) : zero;
      if constexpr (kSwiGLU) ur[i] = live ? *reinterpret_cast<const uint4*>(src + n_in) : zero;
    }
  };
  auto store_x = [&](int buf) {
#pragma unroll
    for (int i = 0; i < kXPer; ++i) {
      const int idx = tid + i * kMidThreads;
      const int row = idx / (kMidChunk / 8), piece = idx % (kMidChunk / 8);
      uint4 v = xr[i];
      if constexpr (kSwiGLU) {  // silu(gate) * up, rounded as silu_mul rounds (zeros stay zeros)
        float gt[8], up[8], a[8];
        unpack_bf16x8(xr[i], gt);
        unpack_bf16x8(ur[i], up);
#pragma unroll
        for (int e = 0; e < 8; ++e) a[e] = silu(gt[e]) * up[e];
        v = pack_bf16x8(a);
      }
      *reinterpret_cast<uint4*>(xs + (buf * kRows + row) * kMidXStride + piece * 8) = v;
    }
  };

  float acc[kNT][4] = {};
  if (n_chunks > 0) load_w(0, w0, w1);
  pdl_wait();
  pdl_launch_next();
  if (n_chunks > 0) {
    load_x(0);
    store_x(0);
  }
  __syncthreads();
  for (int c = 0; c < n_chunks; ++c) {
    const int cur = c & 1;
    if (c + 1 < n_chunks) {
      load_w(c + 1, nw0, nw1);
      load_x(c + 1);
    }
    const __nv_bfloat16* xb = xs + cur * kRows * kMidXStride;
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const uint32_t a0[4] = {w0[u].x, w1[u].x, w0[u].y, w1[u].y};
      const uint32_t a1[4] = {w0[u].z, w1[u].z, w0[u].w, w1[u].w};
      const int kk = (slice * kU + u) * 32 + t * 8;
#pragma unroll
      for (int j = 0; j < kNT; ++j) {
        const uint4 b = *reinterpret_cast<const uint4*>(xb + (8 * j + g) * kMidXStride + kk);
        const uint32_t b0[2] = {b.x, b.y};
        const uint32_t b1[2] = {b.z, b.w};
        mma_bf16_16816(acc[j], a0, b0);
        mma_bf16_16816(acc[j], a1, b1);
      }
    }
    if (c + 1 < n_chunks) store_x(cur ^ 1);  // that buffer was last read before the previous barrier
    __syncthreads();
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      w0[u] = nw0[u];
      w1[u] = nw1[u];
    }
  }

  // acc[j][e]: row row0 + g (+ 8 for e >= 2), token 8 j + 2 t + (e & 1). Sum over the slices.
  auto* part = reinterpret_cast<float*>(smem);  // [kWarps][kNT][32][4]
#pragma unroll
  for (int j = 0; j < kNT; ++j)
    *reinterpret_cast<float4*>(part + ((warp * kNT + j) * kWarpSize + lane) * 4) =
        make_float4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]);
  __syncthreads();
  for (int i = tid; i < kGroups * kNT * kWarpSize * 4; i += kMidThreads) {
    const int grp = i / (kNT * kWarpSize * 4), j = (i / (kWarpSize * 4)) % kNT, l = (i / 4) % kWarpSize, e = i % 4;
    float s = 0.0f;
#pragma unroll
    for (int v = 0; v < kSlices; ++v) s += part[(((v * kGroups + grp) * kNT + j) * kWarpSize + l) * 4 + e];
    const int64_t row = static_cast<int64_t>(blockIdx.x) * 16 * kGroups + grp * 16 + l / 4 + (e >= 2 ? 8 : 0);
    const int tok = 8 * j + 2 * (l % 4) + (e & 1);
    if (row >= n_out || tok >= n_tokens) continue;
    const int64_t at = static_cast<int64_t>(tok) * n_out + row;
    if (gridDim.y > 1) {
      partial[static_cast<int64_t>(blockIdx.y) * n_tokens * n_out + at] = s;
    } else if constexpr (kF32Out) {
      static_cast<float*>(y)[at] = s;
    } else {
      static_cast<__nv_bfloat16*>(y)[at] = __float2bfloat16_rn(s);
    }
  }
}

// y[i] = sum over the splits of partial[s, i], s = 0, 1, ... in order; n = n_tokens x n_out.
// grid ceil(n / 256), 256 threads.
template <bool kF32Out>
__global__ void __launch_bounds__(256)
    mid_gemm_reduce_kernel(const float* __restrict__ partial, void* __restrict__ y, int splits, int64_t n) {
  KESTREL_PDL_ENTRY();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * 256 + threadIdx.x;
  if (i >= n) return;
  float s = 0.0f;
  for (int k = 0; k < splits; ++k) s += partial[k * n + i];
  if constexpr (kF32Out)
    static_cast<float*>(y)[i] = s;
  else
    static_cast<__nv_bfloat16*>(y)[i] = __float2bfloat16_rn(s);
}

}  // namespace kestrel::cuda
