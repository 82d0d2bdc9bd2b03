// Row gather: out[i, :] = in[rows[i], :] (the logits rows of a mixed prefill/decode batch, before
// the final norm's output goes through the LM head).
#pragma once

#include "backend/cuda/device_common.cuh"

namespace kestrel::cuda {

// in [*, width] bf16, rows [n_rows] (device), out [n_rows, width] bf16. grid (n_rows), one row per
// block; kVec moves 16 bytes per item (width % 8 == 0, 16-byte aligned rows).
template <bool kVec>
__global__ void gather_rows_kernel(const __nv_bfloat16* __restrict__ in, const int32_t* __restrict__ rows,
                                   int64_t width, __nv_bfloat16* __restrict__ out) {
  KESTREL_PDL_ENTRY();
  const int64_t i = blockIdx.x;
  const __nv_bfloat16* src = in + static_cast<int64_t>(rows[i]) * width;
  __nv_bfloat16* dst = out + i * width;
  if constexpr (kVec) {
    for (int64_t j = threadIdx.x; j < width / 8; j += blockDim.x)
      reinterpret_cast<uint4*>(dst)[j] = reinterpret_cast<const uint4*>(src)[j];
  } else {
    for (int64_t j = threadIdx.x; j < width; j += blockDim.x) dst[j] = src[j];
  }
}

}  // namespace kestrel::cuda
