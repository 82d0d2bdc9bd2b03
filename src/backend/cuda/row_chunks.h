// Launch shape of the kernels that hold one row a block in registers, kChunks chunks of 8 values a
// thread (add_rms_norm_fp8, silu_mul_fp8): the fewest chunks (1, 2, 4, 8) that keep the block at
// 512 threads or fewer. Internal to src/backend/cuda.
#pragma once

#include <cstdint>
#include <type_traits>

#include "backend/cuda/device_common.cuh"

namespace kestrel::cuda {

// The largest block row_chunks gives: the kernels' __launch_bounds__, so that ptxas keeps a
// thread's registers within what 512 threads may hold (at 8 chunks the row alone is 64 of them).
constexpr int kRowChunksMaxThreads = 512;

struct RowChunks {
  int chunks;       // per thread
  int64_t threads;  // whole warps
};

// width % 8 == 0 and width <= 32,768 (fp8_fused_width_supported).
inline RowChunks row_chunks(int64_t width) {
  const int64_t n_chunks = width / 8;
  const int chunks = n_chunks <= 512 ? 1 : n_chunks <= 1024 ? 2 : n_chunks <= 2048 ? 4 : 8;
  return {chunks, ceil_div(ceil_div(n_chunks, chunks), kWarpSize) * kWarpSize};
}

// Calls f(std::integral_constant<int, chunks>{}), for the kernel template's instance.
template <class F>
void with_row_chunks(int chunks, F&& f) {
  switch (chunks) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    default: f(std::integral_constant<int, 8>{}); break;
  }
}

}  // namespace kestrel::cuda
