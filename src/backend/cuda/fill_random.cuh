// Generated weights on the device (--load-format dummy): bf16 values computed from the tensor's
// key and each element's index by core/random_fill.h, the host's generator, so the device copy
// equals the host's bit for bit.
#pragma once

#include "backend/cuda/device_common.cuh"
#include "core/random_fill.h"

namespace kestrel::cuda {

// out[i] = random_fill_bf16(f, first + i) for i < n, as bf16 bits. kVec: 8 elements per thread
// from two hashes and a 16-byte store (out 16-byte aligned, n % 8 == 0, first % 4 == 0); else
// one. Grid-stride over the items.
template <bool kVec>
__global__ void fill_random_kernel(uint16_t* __restrict__ out, int64_t n, uint64_t first, RandomFill f) {
  KESTREL_PDL_ENTRY();
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t n_items = kVec ? n / 8 : n;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < n_items; t += stride) {
    if constexpr (kVec) {
      uint16_t v[8];
      const uint64_t g = (first + static_cast<uint64_t>(t) * 8) / 4;
      const uint64_t z0 = random_fill_group(f.key, g), z1 = random_fill_group(f.key, g + 1);
#pragma unroll
      for (unsigned j = 0; j < 4; ++j) {
        v[j] = random_fill_round(random_fill_lane(z0, j), f.step);
        v[4 + j] = random_fill_round(random_fill_lane(z1, j), f.step);
      }
      uint4 packed;
      std::memcpy(&packed, v, sizeof packed);
      reinterpret_cast<uint4*>(out)[t] = packed;
    } else {
      out[t] = random_fill_bf16(f, first + static_cast<uint64_t>(t));
    }
  }
}

}  // namespace kestrel::cuda
