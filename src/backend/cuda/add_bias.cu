#include "backend/cuda/add_bias.cuh"

#include <algorithm>

#include "backend/cuda/cuda_ops.h"

namespace kestrel::cuda {

void add_bias(bf16* y, const float* bias, int64_t n_tokens, int64_t width, cudaStream_t stream) {
  if (n_tokens <= 0 || width <= 0) return;
  const int threads = static_cast<int>(std::min<int64_t>(256, ceil_div(width, kWarpSize) * kWarpSize));
  const dim3 grid(static_cast<unsigned>(ceil_div(width, threads)), static_cast<unsigned>(std::min<int64_t>(n_tokens, 65535)));
  KESTREL_LAUNCH(add_bias_kernel, grid, dim3(threads), 0, stream, y, bias, n_tokens, width);
  KESTREL_CUDA_CHECK_LAUNCH();
}

}  // namespace kestrel::cuda
