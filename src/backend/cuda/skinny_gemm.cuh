// Skinny GEMM for decode steps: y[n_tokens, n_out] = a(x)[n_tokens, n_in] . W^T with few tokens
// (n_tokens <= kSkinnyMaxTokens), where the time is the one pass over W and cuBLASLt's tiles,
// built for many tokens, leave bandwidth unused.
//
// Design (a GEMV on the tensor cores):
// - A block owns 16 rows of W (the M side of mma.sync m16n8k16) and its warps split n_in between
//   them; the tokens are the N side, in kNT tiles of 8.
// - W goes from global memory straight into mma A fragments, with no shared memory: lane (g, t)
//   (g = lane / 4, t = lane % 4) loads 16 bytes, 8 consecutive k, of rows g and g + 8 per k-step of
//   32, and the B fragments (tokens) are loaded with the same k permutation. A dot product does not
//   care about the order of its k, so the k slots a lane feeds to the mma can be any permutation
//   that A and B share: physical k 8t + {0,1,2,3} are the first mma's logical k {2t, 2t+1, 2t+8,
//   2t+9}, 8t + {4..7} the second mma's. So each lane issues only 16-byte loads, a group of 4 lanes
//   reads 64 x kU contiguous bytes of a row, and kU k-steps of loads are in flight per warp, double
//   buffered across iterations.
// - W is read with ld.global.nc.L1::no_allocate (read once: keep L1 for x); x is re-read by every
//   block from L2 (it is at most a few hundred KB).
// - The warps' partial sums meet in shared memory; f32 until the single rounding of the output.
// - SwiGLU input (kSwiGLU): x holds [gate | up] rows and the block forms silu(gate) * up, rounded
//   to bf16 exactly as silu_mul does, while loading: the down projection needs no separate
//   activation kernel and the result is bit-identical to silu_mul followed by this GEMM.
// Source: the fragment layouts are PTX ISA 8.x, "Matrix fragments for mma.m16n8k16"; the design
// follows the well-known split-K GEMV pattern for memory-bound decode.
#pragma once

#include "backend/cuda/device_common.cuh"
#include "backend/cuda/silu_mul.cuh"

namespace kestrel::cuda {

constexpr int kSkinnyRows = 16;  // rows of W per block

// The loads of one k-step group (kU k-steps of 32) of one warp, as loaded: for kSwiGLU, x holds
// the gate and up holds the up half; silu is applied at use, so no load waits on another.
template <int kNT, int kU, bool kSwiGLU>
struct SkinnyFrag {
  uint4 w0[kU], w1[kU];          // rows g and g + 8
  uint4 x[kNT][kU];              // tokens 8 j + g
  uint4 up[kSwiGLU ? kNT : 1][kSwiGLU ? kU : 1];
};

// One warp's part of a skinny block: the dot products of the lane's rows of W (w_row0: row g,
// w_row1: row g + 8 of the block's 16) with the kNT token tiles (x_row[j]: token 8 j + g's row, read
// only when x_live[j]) over the k-steps warp, warp + kWarps, ... of n_in, accumulated into acc in
// the mma C layout (acc[j][e]: row g + 8 (e >= 2), token 8 j + 2 t + (e & 1)). In kSwiGLU mode
// x_row[j] is [gate | up], each n_in wide. kPdlInside: the first weight loads are issued, then
// griddepcontrol.wait, then the first x loads (the caller has not waited yet); otherwise the caller
// has already waited.
template <int kNT, int kU, int kWarps, bool kSwiGLU, bool kPdlInside>
__device__ __forceinline__ void skinny_warp_sums(const __nv_bfloat16* w_row0, const __nv_bfloat16* w_row1,
                                                 const __nv_bfloat16* const (&x_row)[kNT], const bool (&x_live)[kNT],
                                                 int n_in, int warp, float (&acc)[kNT][4]) {
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int t = lane % 4;
  constexpr int kStep = 32 * kU;  // k per warp iteration
  const int n_iter_total = (n_in + kStep - 1) / kStep;
  using Frag = SkinnyFrag<kNT, kU, kSwiGLU>;
  const uint4 zero = make_uint4(0, 0, 0, 0);

  auto load_w = [&](int it, Frag& f) {
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int k = it * kStep + u * 32 + t * 8;
      f.w0[u] = k < n_in ? ld_stream16(w_row0 + k) : zero;
      f.w1[u] = k < n_in ? ld_stream16(w_row1 + k) : zero;
    }
  };
  auto load_x = [&](int it, Frag& f) {
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int k = it * kStep + u * 32 + t * 8;
#pragma unroll
      for (int j = 0; j < kNT; ++j) {
        const bool live = k < n_in && x_live[j];
        f.x[j][u] = live ? ld_dependent16(x_row[j] + k) : zero;
        if constexpr (kSwiGLU) f.up[j][u] = live ? ld_dependent16(x_row[j] + n_in + k) : zero;
      }
    }
  };
  // The B fragment data of token tile j, k-step u: x, or silu(gate) * up rounded to bf16 as
  // silu_mul rounds it (zeros stay zeros: silu(0) * 0 = 0).
  auto activation = [&](const Frag& f, int j, int u) -> uint4 {
    if constexpr (kSwiGLU) {
      float gt[8], up[8], a[8];
      unpack_bf16x8(f.x[j][u], gt);
      unpack_bf16x8(f.up[j][u], up);
#pragma unroll
      for (int e = 0; e < 8; ++e) a[e] = silu(gt[e]) * up[e];
      return pack_bf16x8(a);
    } else {
      return f.x[j][u];
    }
  };

  Frag cur, nxt;
  int it = warp;
  if (it < n_iter_total) load_w(it, cur);
  if constexpr (kPdlInside) {
    pdl_wait();
    pdl_launch_next();
  }
  if (it < n_iter_total) load_x(it, cur);
  for (; it < n_iter_total; it += kWarps) {
    if (it + kWarps < n_iter_total) {
      load_w(it + kWarps, nxt);
      load_x(it + kWarps, nxt);
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const uint32_t a0[4] = {cur.w0[u].x, cur.w1[u].x, cur.w0[u].y, cur.w1[u].y};
      const uint32_t a1[4] = {cur.w0[u].z, cur.w1[u].z, cur.w0[u].w, cur.w1[u].w};
#pragma unroll
      for (int j = 0; j < kNT; ++j) {
        const uint4 b = activation(cur, j, u);
        const uint32_t b0[2] = {b.x, b.y};
        const uint32_t b1[2] = {b.z, b.w};
        mma_bf16_16816(acc[j], a0, b0);
        mma_bf16_16816(acc[j], a1, b1);
      }
    }
    cur = nxt;
  }
}

// The warps' partial sums of a skinny block, summed in warp order (a fixed order) by the caller.
template <int kNT, int kWarps>
struct SkinnyPartials {
  float v[kWarps][kNT][kWarpSize][4];
  // A warp's accumulators (skinny_warp_sums' acc) into its slot; a barrier must follow before sum().
  __device__ __forceinline__ void put(int warp, int lane, const float (&acc)[kNT][4]) {
#pragma unroll
    for (int j = 0; j < kNT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) v[warp][j][lane][e] = acc[j][e];
  }
  __device__ __forceinline__ float sum(int j, int l, int e) const {
    float s = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) s += v[w][j][l][e];
    return s;
  }
};

// x: [n_tokens, *] rows x_stride elements apart (16-byte aligned). In kSwiGLU mode row t's gate is
// x[t, 0 .. n_in) and its up x[t, n_in .. 2 n_in). w [n_out, n_in]; y [n_tokens, n_out], f32 when
// kF32Out else bf16. n_in % 8 == 0. grid: ceil(n_out / 16) blocks of kWarps warps.
// PDL: the first weight tiles are requested before griddepcontrol.wait (weights are written by no
// kernel), so they stream while the previous kernel drains; x is read after it, with coherent loads
// (ld_dependent16).
template <int kNT, int kU, int kWarps, bool kSwiGLU, bool kF32Out>
__global__ void __launch_bounds__(kWarps * 32)
    skinny_gemm_kernel(const __nv_bfloat16* __restrict__ x, int64_t x_stride, const __nv_bfloat16* __restrict__ w,
                       void* __restrict__ y, int n_tokens, int n_in, int n_out) {
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int g = lane / 4;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kSkinnyRows;
  // Rows past n_out load the last row; their sums are never stored.
  const int64_t last = n_out - 1;
  const __nv_bfloat16* w_row0 = w + (row0 + g < last ? row0 + g : last) * n_in;
  const __nv_bfloat16* w_row1 = w + (row0 + g + 8 < last ? row0 + g + 8 : last) * n_in;
  const __nv_bfloat16* x_row[kNT];
  bool x_live[kNT];
#pragma unroll
  for (int j = 0; j < kNT; ++j) {
    const int tok = 8 * j + g;
    x_live[j] = tok < n_tokens;
    x_row[j] = x + static_cast<int64_t>(x_live[j] ? tok : 0) * x_stride;
  }
  float acc[kNT][4] = {};
  skinny_warp_sums<kNT, kU, kWarps, kSwiGLU, true>(w_row0, w_row1, x_row, x_live, n_in, warp, acc);

  // acc[j][e]: row g + 8 (e >= 2), token 8 j + 2 t + (e & 1). Sum over the warps.
  __shared__ SkinnyPartials<kNT, kWarps> partial;
  partial.put(warp, lane, acc);
  __syncthreads();
  for (int i = static_cast<int>(threadIdx.x); i < kNT * kWarpSize * 4; i += kWarps * kWarpSize) {
    const int j = i / (kWarpSize * 4), l = (i / 4) % kWarpSize, e = i % 4;
    const float s = partial.sum(j, l, e);
    const int64_t row = row0 + l / 4 + (e >= 2 ? 8 : 0);
    const int tok = 8 * j + 2 * (l % 4) + (e & 1);
    if (row >= n_out || tok >= n_tokens) continue;
    if constexpr (kF32Out)
      static_cast<float*>(y)[static_cast<int64_t>(tok) * n_out + row] = s;
    else
      static_cast<__nv_bfloat16*>(y)[static_cast<int64_t>(tok) * n_out + row] = __float2bfloat16_rn(s);
  }
}

}  // namespace kestrel::cuda
