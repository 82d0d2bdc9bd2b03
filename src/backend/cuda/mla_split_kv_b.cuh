// Per-head W_UK^T and W_UV of multi-head latent attention from kv_b_proj, on the device
// (mla_ops.h, mla_split_kv_b): one thread per element of KvB, each written once to its place.
#pragma once

#include "backend/cuda/device_common.cuh"

namespace kestrel::cuda {

constexpr int kMlaSplitThreads = 256;

// grid ceil(n_head (nope + v) r / kMlaSplitThreads), kMlaSplitThreads threads.
__global__ void mla_split_kv_b_kernel(const __nv_bfloat16* __restrict__ kv_b, int64_t n_head, int64_t nope,
                                      int64_t v, int64_t r, __nv_bfloat16* __restrict__ uk_t,
                                      __nv_bfloat16* __restrict__ uv) {
  KESTREL_PDL_ENTRY();
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= n_head * (nope + v) * r) return;
  const int64_t row = idx / r, j = idx % r;
  const int64_t h = row / (nope + v), i = row % (nope + v);
  if (i < nope) {
    uk_t[(h * r + j) * nope + i] = kv_b[idx];
  } else {
    uv[(h * v + (i - nope)) * r + j] = kv_b[idx];
  }
}

}  // namespace kestrel::cuda
