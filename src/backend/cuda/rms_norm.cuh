// In-place RMSNorm (Zhang & Sennrich 2019) of the heads of bf16 rows: one warp per (row, head),
// the head's values held in f32 registers between the sum of squares and the scaled write.
#pragma once

#include "backend/cuda/device_common.cuh"

namespace kestrel::cuda {

constexpr int kRmsNormWarps = 4;       // warps (items) per block
constexpr int kRmsNormMaxPerLane = 32;  // dim <= 32 * 32 = 1024 in registers; longer rows re-read x

// Items (row, head) in row-major order: item i is row i / n_heads, head i % n_heads.
// grid (ceil(n_rows * n_heads / kRmsNormWarps)), kRmsNormWarps * 32 threads.
__global__ void __launch_bounds__(kRmsNormWarps * kWarpSize)
    rms_norm_heads_kernel(__nv_bfloat16* __restrict__ x, int64_t n_items, int64_t n_heads, int64_t row_stride,
                          int64_t dim, const __nv_bfloat16* __restrict__ weight, float eps) {
  KESTREL_PDL_ENTRY();
  const int lane = threadIdx.x % kWarpSize;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kRmsNormWarps + threadIdx.x / kWarpSize;
  if (item >= n_items) return;
  __nv_bfloat16* v = x + (item / n_heads) * row_stride + (item % n_heads) * dim;
  float r[kRmsNormMaxPerLane];
  float ss = 0.0f;
#pragma unroll
  for (int j = 0; j < kRmsNormMaxPerLane; ++j) {
    const int64_t i = lane + static_cast<int64_t>(j) * kWarpSize;
    r[j] = i < dim ? __bfloat162float(v[i]) : 0.0f;
    ss += r[j] * r[j];
  }
  for (int64_t i = lane + static_cast<int64_t>(kRmsNormMaxPerLane) * kWarpSize; i < dim; i += kWarpSize) {
    const float y = __bfloat162float(v[i]);
    ss += y * y;
  }
  ss = warp_reduce_sum(ss);
  const float inv = rsqrtf(ss / static_cast<float>(dim) + eps);
  for (int64_t i = lane + static_cast<int64_t>(kRmsNormMaxPerLane) * kWarpSize; i < dim; i += kWarpSize)
    v[i] = __float2bfloat16_rn(__bfloat162float(v[i]) * inv * __bfloat162float(weight[i]));
#pragma unroll
  for (int j = 0; j < kRmsNormMaxPerLane; ++j) {
    const int64_t i = lane + static_cast<int64_t>(j) * kWarpSize;
    if (i < dim) v[i] = __float2bfloat16_rn(r[j] * inv * __bfloat162float(weight[i]));
  }
}

}  // namespace kestrel::cuda
