// SwiGLU and GeGLU activations (Shazeer 2020) over the fused gate|up GEMM output:
// out = silu(gate) * up, or gelu_tanh(gate) * up.
#pragma once

#include "backend/cuda/device_common.cuh"
#include "backend/cuda/fp8.cuh"
#include "backend/cuda/row_chunks.h"

namespace kestrel::cuda {

// silu(g) = g / (1 + e^-g), with the fast exponential and division (__fdividef: g times the
// approximate reciprocal, 2 ulp), since the IEEE division is most of the arithmetic of the
// streaming GEMV's SwiGLU prologue (56 per thread at n_ff 14336). Limits hold: for g below about
// -87, 1 + e^-g is 2^126 or more (or +inf) and the result is 0 (or -0); for large g it is g.
__device__ __forceinline__ float silu(float g) { return __fdividef(g, 1.0f + __expf(-g)); }

// GELU's tanh approximation (Hendrycks & Gimpel 2016; transformers' gelu_pytorch_tanh):
// 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), in f32 with the accurate tanhf (the CPU
// backend's formula).
__device__ __forceinline__ float gelu_tanh(float g) {
  return 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
}

// gate_up [n_tokens, 2 * n_ff] bf16 (gate then up), out [n_tokens, n_ff] bf16: act(gate) * up with
// act = gelu_tanh (kGelu: GeGLU) or silu (SwiGLU).
// grid (ceil(n_items / blockDim.x), min(n_tokens, 65535)) where an item is 8 elements (kVec,
// n_ff % 8 == 0) or one; rows beyond gridDim.y are covered by striding.
template <bool kVec, bool kGelu = false>
__global__ void silu_mul_kernel(const __nv_bfloat16* __restrict__ gate_up, __nv_bfloat16* __restrict__ out,
                                int64_t n_tokens, int64_t n_ff) {
  KESTREL_PDL_ENTRY();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t t = blockIdx.y; t < n_tokens; t += gridDim.y) {
    const __nv_bfloat16* gate = gate_up + t * 2 * n_ff;
    const __nv_bfloat16* up = gate + n_ff;
    if constexpr (kVec) {
      if (i >= n_ff / 8) return;
      float g[8], u[8], y[8];
      unpack_bf16x8(reinterpret_cast<const uint4*>(gate)[i], g);
      unpack_bf16x8(reinterpret_cast<const uint4*>(up)[i], u);
#pragma unroll
      for (int j = 0; j < 8; ++j) y[j] = (kGelu ? gelu_tanh(g[j]) : silu(g[j])) * u[j];
      reinterpret_cast<uint4*>(out + t * n_ff)[i] = pack_bf16x8(y);
    } else {
      if (i >= n_ff) return;
      const float g = __bfloat162float(gate[i]);
      out[t * n_ff + i] = __float2bfloat16_rn((kGelu ? gelu_tanh(g) : silu(g)) * __bfloat162float(up[i]));
    }
  }
}

// SwiGLU with its output quantized for a W8A8 GEMM (silu_mul_fp8, fp8_ops.h): one block per row,
// the row's silu(gate) * up rounded to bf16 as silu_mul writes it, then E4M3 codes q [n_tokens,
// n_ff] and scale q_scale [n_tokens] as quantize_rows_fp8 makes them from it. With gu_x_scale (and
// gu_w_scale [2 n_ff], 16-byte aligned) gate_up is an unscaled W8A8 product, scaled first as scale_fp8_product does.
// The row's gu_x_scale is read before its q_scale is written, so the two may be one array.
// grid (n_tokens); block: whole warps with blockDim.x * kChunks * 8 >= n_ff; n_ff % 8 == 0.
template <int kChunks>
__global__ void __launch_bounds__(kRowChunksMaxThreads) silu_mul_fp8_kernel(const __nv_bfloat16* __restrict__ gate_up, const float* gu_x_scale,
                                    const float* __restrict__ gu_w_scale, uint8_t* __restrict__ q, float* q_scale,
                                    int64_t n_ff) {
  KESTREL_PDL_ENTRY();
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  const int64_t n_chunks = n_ff / 8;
  const float xs = gu_x_scale != nullptr ? gu_x_scale[row] : 1.0f;
  const __nv_bfloat16* gate = gate_up + row * 2 * n_ff;
  // Every chunk's loads first, so that they are all in flight before the first is used.
  uint4 gv[kChunks], uv[kChunks];
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int64_t c = threadIdx.x + static_cast<int64_t>(i) * blockDim.x;
    if (c < n_chunks) {
      gv[i] = ld_dependent16(gate + c * 8);
      uv[i] = ld_dependent16(gate + n_ff + c * 8);
    }
  }
  float y[kChunks][8];
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int64_t c = threadIdx.x + static_cast<int64_t>(i) * blockDim.x;
    if (c < n_chunks) {
      float g[8], u[8];
      unpack_bf16x8(gv[i], g);
      unpack_bf16x8(uv[i], u);
      if (gu_x_scale != nullptr) {
        float gs[8], us[8];
        load_f32x8(gu_w_scale + c * 8, gs);
        load_f32x8(gu_w_scale + n_ff + c * 8, us);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          g[j] = round_to_bf16(g[j] * (xs * gs[j]));
          u[j] = round_to_bf16(u[j] * (xs * us[j]));
        }
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) y[i][j] = round_to_bf16(silu(g[j]) * u[j]);
    }
  }
  quantize_held_row_fp8<kChunks>(y, n_chunks, q + row * n_ff, q_scale + row, scratch);
}

}  // namespace kestrel::cuda
