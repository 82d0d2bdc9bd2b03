// Row-wise FP8 E4M3 quantization kernel (fp8_ops.h, quantize_rows_fp8): one block per row finds
// the row's largest |x|, then writes q = e4m3(x / scale) with scale = amax / 448. And the outer
// scaling of an unscaled W8A8 product (scale_fp8_product).
#pragma once

#include "backend/cuda/fp8.cuh"

namespace kestrel::cuda {


constexpr int kQuantThreads = 256;

__device__ __forceinline__ float block_reduce_max(float v, float* scratch) {
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < kQuantThreads / kWarpSize ? scratch[lane] : 0.0f;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// x [rows, *] bf16 rows x_stride apart; q [rows, cols] codes; scale [rows]. cols % 8 == 0.
__global__ void __launch_bounds__(kQuantThreads)
    quantize_rows_fp8_kernel(const __nv_bfloat16* __restrict__ x, int64_t x_stride, int64_t cols,
                             uint8_t* __restrict__ q, float* __restrict__ scale) {
  KESTREL_PDL_ENTRY();
  __shared__ float scratch[kWarpSize];
  const int64_t row = blockIdx.x;
  const __nv_bfloat16* xr = x + row * x_stride;
  float amax = 0.0f;
  for (int64_t c = static_cast<int64_t>(threadIdx.x) * 8; c < cols; c += kQuantThreads * 8) {
    float f[8];
    unpack_bf16x8(ld_dependent16(xr + c), f);
#pragma unroll
    for (int e = 0; e < 8; ++e) amax = fmaxf(amax, fabsf(f[e]));
  }
  amax = block_reduce_max(amax, scratch);
  const float s = amax > 0.0f ? amax / kFp8E4m3Max : 1.0f;
  if (threadIdx.x == 0) scale[row] = s;
  uint8_t* qr = q + row * cols;
  const E4m3Divisor div(s);
  for (int64_t c = static_cast<int64_t>(threadIdx.x) * 8; c < cols; c += kQuantThreads * 8) {
    float f[8];
    unpack_bf16x8(ld_dependent16(xr + c), f);
    *reinterpret_cast<uint2*>(qr + c) = div.codes8(f);
  }
}

// y [n_tokens, n_out] bf16 in place: y[t, o] = bf16(y[t, o] * (x_scale[t] * w_scale[o])), eight
// outputs a thread (n_out % 8 == 0). grid (ceil(n_out / 8 / 256), min(n_tokens, 65535)), rows
// beyond gridDim.y by striding. x_scale was written by an earlier kernel of the stream: a plain
// (not read-only path) load after the wait.
__global__ void __launch_bounds__(kQuantThreads)
    scale_fp8_product_kernel(__nv_bfloat16* y, const float* x_scale, const float* __restrict__ w_scale,
                             int64_t n_tokens, int64_t n_out) {
  KESTREL_PDL_ENTRY();
  const int64_t o = (static_cast<int64_t>(blockIdx.x) * kQuantThreads + threadIdx.x) * 8;
  if (o >= n_out) return;
  for (int64_t t = blockIdx.y; t < n_tokens; t += gridDim.y) {
    __nv_bfloat16* yr = y + t * n_out + o;
    const float xs = x_scale[t];
    float f[8];
    unpack_bf16x8(ld_dependent16(yr), f);
#pragma unroll
    for (int e = 0; e < 8; ++e) f[e] *= xs * w_scale[o + e];
    *reinterpret_cast<uint4*>(yr) = pack_bf16x8(f);
  }
}

}  // namespace kestrel::cuda
