// Bias add after a GEMM (Qwen2's q/k/v projections, HF Llama's attention_bias): y[t, i] += b[i].
#pragma once

#include "backend/cuda/device_common.cuh"

namespace kestrel::cuda {

// y [n_tokens, width] bf16 (in place), bias [width] f32. grid (ceil(width / blockDim.x),
// min(n_tokens, 65535)); rows beyond gridDim.y are covered by striding.
__global__ void add_bias_kernel(__nv_bfloat16* __restrict__ y, const float* __restrict__ bias, int64_t n_tokens,
                                int64_t width) {
  KESTREL_PDL_ENTRY();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= width) return;
  for (int64_t t = blockIdx.y; t < n_tokens; t += gridDim.y) {
    __nv_bfloat16& e = y[t * width + i];
    e = __float2bfloat16_rn(__bfloat162float(e) + bias[i]);
  }
}

}  // namespace kestrel::cuda
