// Token embedding lookup: one block per token row, 16-byte loads of the bf16 table row, f32 out.
#pragma once

#include "backend/cuda/device_common.cuh"

namespace kestrel::cuda {

// out[t, :] = table[ids[t] - vocab_begin, :] * scale, or zeros when that row is outside
// [0, n_rows) (a tensor-parallel rank's slice of the vocabulary). kVec: n_embd % 8 == 0 (rows are
// whole 16-byte chunks). grid (n_tokens), any block size.
template <bool kVec>
__global__ void embedding_kernel(const __nv_bfloat16* __restrict__ table, const int32_t* __restrict__ ids,
                                 int64_t n_embd, float scale, float* __restrict__ out, int64_t vocab_begin,
                                 int64_t n_rows) {
  KESTREL_PDL_ENTRY();
  const int64_t t = blockIdx.x;
  const int64_t id = static_cast<int64_t>(ids[t]) - vocab_begin;
  float* dst = out + t * n_embd;
  if (id < 0 || id >= n_rows) {
    for (int64_t i = threadIdx.x; i < n_embd; i += blockDim.x) dst[i] = 0.0f;
    return;
  }
  const __nv_bfloat16* row = table + id * n_embd;
  if constexpr (kVec) {
    for (int64_t c = threadIdx.x; c < n_embd / 8; c += blockDim.x) {
      float f[8];
      unpack_bf16x8(reinterpret_cast<const uint4*>(row)[c], f);
#pragma unroll
      for (int j = 0; j < 8; ++j) f[j] *= scale;
      reinterpret_cast<float4*>(dst)[2 * c] = make_float4(f[0], f[1], f[2], f[3]);
      reinterpret_cast<float4*>(dst)[2 * c + 1] = make_float4(f[4], f[5], f[6], f[7]);
    }
  } else {
    for (int64_t i = threadIdx.x; i < n_embd; i += blockDim.x) dst[i] = __bfloat162float(row[i]) * scale;
  }
}

}  // namespace kestrel::cuda
