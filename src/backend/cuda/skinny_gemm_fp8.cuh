// Skinny GEMM over E4M3 weight rows (fp8_ops.h). The design is skinny_gemm.cuh's (16 rows of W per
// block, warps splitting n_in, W straight from global memory into mma A fragments, tokens on the
// N side), with one change: a lane's 16-byte load of W now holds 16 k (codes), which widen into
// two 8-k bf16 fragments, so a warp's k-step is 64 and its x loads are two 16-byte loads per
// token tile. Within a k-step of 64, lane t holds k 16 t .. 16 t + 15 of its two rows; sub-step
// h (0, 1) feeds the mma pair k 16 t + 8 h + {0..7} of both W and x (any permutation of k that A
// and B share gives the same dot product). The per-row scale multiplies the f32 sum once.
#pragma once

#include "backend/cuda/fp8.cuh"
#include "backend/cuda/skinny_gemm.cuh"

namespace kestrel::cuda {


template <int kNT, int kU, bool kSwiGLU>
struct SkinnyFp8Frag {
  uint4 w0[kU], w1[kU];       // rows g and g + 8: 16 codes each
  uint4 x[kNT][kU][2];        // tokens 8 j + g: k 16 t + 8 h .. + 7
  uint4 up[kSwiGLU ? kNT : 1][kSwiGLU ? kU : 1][2];
};

// x [n_tokens, *] bf16 (x_stride apart; [gate | up] rows for kSwiGLU), w [n_out, n_in] codes,
// w_scale [n_out], y [n_tokens, n_out] f32 or bf16. grid: ceil(n_out / 16) blocks of kWarps warps.
template <int kNT, int kU, int kWarps, bool kSwiGLU, bool kF32Out>
__global__ void __launch_bounds__(kWarps * 32, 2)
    skinny_gemm_fp8_kernel(const __nv_bfloat16* __restrict__ x, int64_t x_stride, const uint8_t* __restrict__ w,
                           const float* __restrict__ w_scale, void* __restrict__ y, int n_tokens, int n_in, int n_out) {
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int g = lane / 4, t = lane % 4;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kSkinnyRows;
  const int64_t last = n_out - 1;  // rows past n_out load the last row; their sums are never stored
  const uint8_t* w_row0 = w + (row0 + g < last ? row0 + g : last) * n_in;
  const uint8_t* w_row1 = w + (row0 + g + 8 < last ? row0 + g + 8 : last) * n_in;
  const __nv_bfloat16* x_row[kNT];
  bool x_live[kNT];
#pragma unroll
  for (int j = 0; j < kNT; ++j) {
    const int tok = 8 * j + g;
    x_live[j] = tok < n_tokens;
    x_row[j] = x + static_cast<int64_t>(x_live[j] ? tok : 0) * x_stride;
  }
  constexpr int kStep = 64 * kU;
  const int n_iter_total = (n_in + kStep - 1) / kStep;
  using Frag = SkinnyFp8Frag<kNT, kU, kSwiGLU>;
  const uint4 zero = make_uint4(0, 0, 0, 0);
  auto load_w = [&](int it, Frag& f) {
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int k = it * kStep + u * 64 + t * 16;
      f.w0[u] = k < n_in ? ld_stream16(w_row0 + k) : zero;
      f.w1[u] = k < n_in ? ld_stream16(w_row1 + k) : zero;
    }
  };
  auto load_x = [&](int it, Frag& f) {
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int k = it * kStep + u * 64 + t * 16;
#pragma unroll
      for (int j = 0; j < kNT; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const bool live = k < n_in && x_live[j];
          f.x[j][u][h] = live ? ld_dependent16(x_row[j] + k + 8 * h) : zero;
          if constexpr (kSwiGLU) f.up[j][u][h] = live ? ld_dependent16(x_row[j] + n_in + k + 8 * h) : zero;
        }
    }
  };
  auto activation = [&](const Frag& f, int j, int u, int h) -> uint4 {
    if constexpr (kSwiGLU) {
      float gt[8], up[8], a[8];
      unpack_bf16x8(f.x[j][u][h], gt);
      unpack_bf16x8(f.up[j][u][h], up);
#pragma unroll
      for (int e = 0; e < 8; ++e) a[e] = silu(gt[e]) * up[e];
      return pack_bf16x8(a);
    } else {
      return f.x[j][u][h];
    }
  };

  float acc[kNT][4] = {};
  Frag cur, nxt;
  int it = warp;
  if (it < n_iter_total) load_w(it, cur);
  pdl_wait();  // the weights were written by no kernel; x may come from the previous one
  pdl_launch_next();
  if (it < n_iter_total) load_x(it, cur);
  for (; it < n_iter_total; it += kWarps) {
    if (it + kWarps < n_iter_total) {
      load_w(it + kWarps, nxt);
      load_x(it + kWarps, nxt);
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      // Codes 8 h .. 8 h + 7 of each row as bf16: words 2 h and 2 h + 1 of the 16-byte load.
      const uint32_t r0[4] = {cur.w0[u].x, cur.w0[u].y, cur.w0[u].z, cur.w0[u].w};
      const uint32_t r1[4] = {cur.w1[u].x, cur.w1[u].y, cur.w1[u].z, cur.w1[u].w};
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        uint32_t a0lo, a0hi, a0lo2, a0hi2, a1lo, a1hi, a1lo2, a1hi2;
        e4m3x4_to_bf16x2(r0[2 * h], a0lo, a0hi);       // row g, k 0..3 of the 8
        e4m3x4_to_bf16x2(r0[2 * h + 1], a0lo2, a0hi2);  // row g, k 4..7
        e4m3x4_to_bf16x2(r1[2 * h], a1lo, a1hi);       // row g + 8
        e4m3x4_to_bf16x2(r1[2 * h + 1], a1lo2, a1hi2);
        // As skinny_gemm's fragments of a bf16 uint4 {k01, k23, k45, k67}.
        const uint32_t fa0[4] = {a0lo, a1lo, a0hi, a1hi};
        const uint32_t fa1[4] = {a0lo2, a1lo2, a0hi2, a1hi2};
#pragma unroll
        for (int j = 0; j < kNT; ++j) {
          const uint4 b = activation(cur, j, u, h);
          const uint32_t b0[2] = {b.x, b.y};
          const uint32_t b1[2] = {b.z, b.w};
          mma_bf16_16816(acc[j], fa0, b0);
          mma_bf16_16816(acc[j], fa1, b1);
        }
      }
    }
    cur = nxt;
  }

  __shared__ SkinnyPartials<kNT, kWarps> partial;
  partial.put(warp, lane, acc);
  __syncthreads();
  for (int i = static_cast<int>(threadIdx.x); i < kNT * kWarpSize * 4; i += kWarps * kWarpSize) {
    const int j = i / (kWarpSize * 4), l = (i / 4) % kWarpSize, e = i % 4;
    const int64_t row = row0 + l / 4 + (e >= 2 ? 8 : 0);
    const int tok = 8 * j + 2 * (l % 4) + (e & 1);
    if (row >= n_out || tok >= n_tokens) continue;
    const float s = partial.sum(j, l, e) * w_scale[row];
    if constexpr (kF32Out)
      static_cast<float*>(y)[static_cast<int64_t>(tok) * n_out + row] = s;
    else
      static_cast<__nv_bfloat16*>(y)[static_cast<int64_t>(tok) * n_out + row] = __float2bfloat16_rn(s);
  }
}

}  // namespace kestrel::cuda
