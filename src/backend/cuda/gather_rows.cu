#include "backend/cuda/gather_rows.cuh"

#include "backend/cuda/cuda_ops.h"

namespace kestrel::cuda {

void gather_rows(const bf16* in, const int32_t* rows, int64_t n_rows, int64_t width, bf16* out, cudaStream_t stream) {
  if (n_rows <= 0 || width <= 0) return;
  if (n_rows > 0x7fffffff) throw Error("gather_rows: too many rows for the launch grid");
  const bool vec = width % 8 == 0 && reinterpret_cast<uintptr_t>(in) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(out) % 16 == 0;
  const dim3 grid(static_cast<unsigned>(n_rows));
  if (vec) {
    auto* k = &gather_rows_kernel<true>;
    KESTREL_LAUNCH(k, grid, dim3(128), 0, stream, in, rows, width, out);
  } else {
    auto* k = &gather_rows_kernel<false>;
    KESTREL_LAUNCH(k, grid, dim3(128), 0, stream, in, rows, width, out);
  }
  KESTREL_CUDA_CHECK_LAUNCH();
}

}  // namespace kestrel::cuda
