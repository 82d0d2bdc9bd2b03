#include "backend/cuda/rms_norm.cuh"

#include <string>

#include "backend/cuda/cuda_ops.h"

namespace kestrel::cuda {

void rms_norm_heads(bf16* x, int64_t n_rows, int64_t row_stride, int64_t n_heads, int64_t dim, const bf16* weight,
                    float eps, cudaStream_t stream) {
  if (dim <= 0 || n_heads <= 0 || row_stride < n_heads * dim)
    throw Error("rms_norm_heads: " + std::to_string(n_heads) + " heads of " + std::to_string(dim) +
                " values do not fit rows of " + std::to_string(row_stride));
  if (n_rows <= 0) return;
  const int64_t n_items = n_rows * n_heads;
  const int64_t blocks = ceil_div(n_items, kRmsNormWarps);
  if (blocks > 0x7fffffff) throw Error("rms_norm_heads: too many rows for the launch grid");
  auto* k = &rms_norm_heads_kernel;
  KESTREL_LAUNCH(k, dim3(static_cast<unsigned>(blocks)), dim3(kRmsNormWarps * kWarpSize), 0, stream, x, n_items,
                 n_heads, row_stride, dim, weight, eps);
  KESTREL_CUDA_CHECK_LAUNCH();
}

}  // namespace kestrel::cuda
