// Fused residual add + RMSNorm (Zhang & Sennrich 2019): one block per row. The vector kernel keeps
// the row in registers (kChunks chunks of 8 per thread), so the residual is read once and written
// once, and the normalised row is written once as bf16.
#pragma once

#include "backend/cuda/device_common.cuh"
#include "backend/cuda/fp8.cuh"
#include "backend/cuda/row_chunks.h"

namespace kestrel::cuda {

// residual [n_tokens, dim] f32 (in/out), add [n_tokens, dim] bf16 or null, weight [dim] bf16,
// out [n_tokens, dim] bf16. grid (n_tokens); block: whole warps with blockDim.x * kChunks * 8 >= dim.
// dim % 8 == 0.
template <int kChunks>
__global__ void add_rms_norm_vec_kernel(float* __restrict__ residual, const __nv_bfloat16* __restrict__ add,
                                        const __nv_bfloat16* __restrict__ weight, __nv_bfloat16* __restrict__ out,
                                        int64_t dim, float eps) {
  KESTREL_PDL_ENTRY();
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  const int64_t n_chunks = dim / 8;
  float4* res = reinterpret_cast<float4*>(residual + row * dim);
  float x[kChunks][8];
  float ss = 0.0f;
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int64_t c = threadIdx.x + static_cast<int64_t>(i) * blockDim.x;
    if (c < n_chunks) {
      const float4 lo = res[2 * c], hi = res[2 * c + 1];
      x[i][0] = lo.x, x[i][1] = lo.y, x[i][2] = lo.z, x[i][3] = lo.w;
      x[i][4] = hi.x, x[i][5] = hi.y, x[i][6] = hi.z, x[i][7] = hi.w;
      if (add != nullptr) {
        float a[8];
        unpack_bf16x8(reinterpret_cast<const uint4*>(add + row * dim)[c], a);
#pragma unroll
        for (int j = 0; j < 8; ++j) x[i][j] += a[j];
        res[2 * c] = make_float4(x[i][0], x[i][1], x[i][2], x[i][3]);
        res[2 * c + 1] = make_float4(x[i][4], x[i][5], x[i][6], x[i][7]);
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) ss += x[i][j] * x[i][j];
    }
  }
  ss = block_reduce_sum(ss, scratch);
  const float inv = rsqrtf(ss / static_cast<float>(dim) + eps);
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int64_t c = threadIdx.x + static_cast<int64_t>(i) * blockDim.x;
    if (c < n_chunks) {
      float w[8], y[8];
      unpack_bf16x8(reinterpret_cast<const uint4*>(weight)[c], w);
#pragma unroll
      for (int j = 0; j < 8; ++j) y[j] = x[i][j] * inv * w[j];
      reinterpret_cast<uint4*>(out + row * dim)[c] = pack_bf16x8(y);
    }
  }
}

// The same, with the normalised row quantized for a W8A8 GEMM instead of written as bf16
// (add_rms_norm_fp8, fp8_ops.h): the row rounded to bf16 as add_rms_norm writes it, then E4M3
// codes q [n_tokens, dim] and scale q_scale [n_tokens] as quantize_rows_fp8 makes them from it.
// With add_x_scale (and add_w_scale, 16-byte aligned) `add` is an unscaled W8A8 product, scaled first as
// scale_fp8_product does: bf16(add[r, c] * (add_x_scale[r] * add_w_scale[c])). The row's
// add_x_scale is read before its q_scale is written, so the two may be one array.
template <int kChunks>
__global__ void __launch_bounds__(kRowChunksMaxThreads) add_rms_norm_fp8_kernel(float* __restrict__ residual, const __nv_bfloat16* __restrict__ add,
                                        const float* add_x_scale, const float* __restrict__ add_w_scale,
                                        const __nv_bfloat16* __restrict__ weight, uint8_t* __restrict__ q,
                                        float* q_scale, int64_t dim, float eps) {
  KESTREL_PDL_ENTRY();
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  const int64_t n_chunks = dim / 8;
  const float axs = add_x_scale != nullptr ? add_x_scale[row] : 1.0f;
  float4* res = reinterpret_cast<float4*>(residual + row * dim);
  // Every chunk's loads first, so that they are all in flight before the first is used.
  float x[kChunks][8];
  uint4 av[kChunks];
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int64_t c = threadIdx.x + static_cast<int64_t>(i) * blockDim.x;
    if (c < n_chunks) {
      if (add != nullptr) av[i] = ld_dependent16(add + row * dim + c * 8);
      const float4 lo = res[2 * c], hi = res[2 * c + 1];
      x[i][0] = lo.x, x[i][1] = lo.y, x[i][2] = lo.z, x[i][3] = lo.w;
      x[i][4] = hi.x, x[i][5] = hi.y, x[i][6] = hi.z, x[i][7] = hi.w;
    }
  }
  float ss = 0.0f;
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int64_t c = threadIdx.x + static_cast<int64_t>(i) * blockDim.x;
    if (c < n_chunks) {
      if (add != nullptr) {
        float a[8];
        unpack_bf16x8(av[i], a);
        if (add_x_scale != nullptr) {
          float ws[8];
          load_f32x8(add_w_scale + c * 8, ws);
#pragma unroll
          for (int j = 0; j < 8; ++j) a[j] = round_to_bf16(a[j] * (axs * ws[j]));
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) x[i][j] += a[j];
        res[2 * c] = make_float4(x[i][0], x[i][1], x[i][2], x[i][3]);
        res[2 * c + 1] = make_float4(x[i][4], x[i][5], x[i][6], x[i][7]);
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) ss += x[i][j] * x[i][j];
    }
  }
  ss = block_reduce_sum(ss, scratch);
  const float inv = rsqrtf(ss / static_cast<float>(dim) + eps);
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int64_t c = threadIdx.x + static_cast<int64_t>(i) * blockDim.x;
    if (c < n_chunks) {
      float w[8];
      unpack_bf16x8(reinterpret_cast<const uint4*>(weight)[c], w);
#pragma unroll
      for (int j = 0; j < 8; ++j) x[i][j] = round_to_bf16(x[i][j] * inv * w[j]);
    }
  }
  quantize_held_row_fp8<kChunks>(x, n_chunks, q + row * dim, q_scale + row, scratch);
}

// Any dim (odd widths): element by element, re-reading the residual row it just wrote.
__global__ void add_rms_norm_scalar_kernel(float* __restrict__ residual, const __nv_bfloat16* __restrict__ add,
                                           const __nv_bfloat16* __restrict__ weight,
                                           __nv_bfloat16* __restrict__ out, int64_t dim, float eps) {
  KESTREL_PDL_ENTRY();
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  float* res = residual + row * dim;
  float ss = 0.0f;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
    float x = res[i];
    if (add != nullptr) {
      x += __bfloat162float(add[row * dim + i]);
      res[i] = x;
    }
    ss += x * x;
  }
  ss = block_reduce_sum(ss, scratch);
  const float inv = rsqrtf(ss / static_cast<float>(dim) + eps);
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x)
    out[row * dim + i] = __float2bfloat16_rn(res[i] * inv * __bfloat162float(weight[i]));
}

// out = residual + add, element by element (grid-stride over n elements); add may be null.
__global__ void add_residual_kernel(const float* __restrict__ residual, const __nv_bfloat16* __restrict__ add,
                                    float* __restrict__ out, int64_t n) {
  KESTREL_PDL_ENTRY();
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = add != nullptr ? residual[i] + __bfloat162float(add[i]) : residual[i];
}

}  // namespace kestrel::cuda
