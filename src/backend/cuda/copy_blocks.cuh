// Copy-on-write of whole KV blocks: for each (copy, cache tensor), one block of threads copies
// block_bytes from block src[i] to block dst[i] with 16-byte loads and stores.
#pragma once

#include "backend/cuda/device_common.cuh"

namespace kestrel::cuda {

// caches [n_caches] device pointers, each a tensor of whole blocks of block_bytes bytes;
// src, dst [n_copies] block ids. grid (n_copies, n_caches). kVec: block_bytes % 16 == 0 and every
// cache 16-byte aligned.
template <bool kVec>
__global__ void copy_blocks_kernel(void* const* __restrict__ caches, const int32_t* __restrict__ src,
                                   const int32_t* __restrict__ dst, int64_t block_bytes) {
  KESTREL_PDL_ENTRY();
  auto* base = static_cast<unsigned char*>(caches[blockIdx.y]);
  const unsigned char* from = base + static_cast<int64_t>(src[blockIdx.x]) * block_bytes;
  unsigned char* to = base + static_cast<int64_t>(dst[blockIdx.x]) * block_bytes;
  if constexpr (kVec) {
    for (int64_t i = threadIdx.x; i < block_bytes / 16; i += blockDim.x)
      reinterpret_cast<uint4*>(to)[i] = reinterpret_cast<const uint4*>(from)[i];
  } else {
    for (int64_t i = threadIdx.x; i < block_bytes; i += blockDim.x) to[i] = from[i];
  }
}

}  // namespace kestrel::cuda
