// Row-wise FP8 E4M3 quantization (fp8_ops.h): the launcher of fp8_quant.cuh's kernel.
#include <algorithm>
#include <string>

#include "backend/cuda/fp8_quant.cuh"
#include "backend/cuda/fp8_ops.h"

namespace kestrel::cuda {


void quantize_rows_fp8(const bf16* x, int64_t x_stride, int64_t rows, int64_t cols, uint8_t* q, float* scale,
                       cudaStream_t stream) {
  if (rows <= 0) return;
  if (cols <= 0 || cols % 8 != 0 || x_stride < cols || x_stride % 8 != 0 || rows > 0x7fffffff)
    throw Error("quantize_rows_fp8: cols " + std::to_string(cols) + " (a positive multiple of 8), x_stride " +
                std::to_string(x_stride) + " (a multiple of 8, at least cols), rows " + std::to_string(rows));
  if (reinterpret_cast<uintptr_t>(x) % 16 != 0 || reinterpret_cast<uintptr_t>(q) % 8 != 0)
    throw Error("quantize_rows_fp8: x must be 16-byte and q 8-byte aligned");
  auto* k = &quantize_rows_fp8_kernel;
  KESTREL_LAUNCH(k, dim3(static_cast<unsigned>(rows)), dim3(kQuantThreads), 0, stream, x, x_stride, cols, q, scale);
  KESTREL_CUDA_CHECK_LAUNCH();
}

void scale_fp8_product(bf16* y, const float* x_scale, const float* w_scale, int64_t n_tokens, int64_t n_out,
                       cudaStream_t stream) {
  if (n_tokens <= 0) return;
  if (n_out <= 0 || n_out % 8 != 0)
    throw Error("scale_fp8_product: n_out " + std::to_string(n_out) + " (a positive multiple of 8)");
  if (reinterpret_cast<uintptr_t>(y) % 16 != 0) throw Error("scale_fp8_product: y must be 16-byte aligned");
  const dim3 grid(static_cast<unsigned>(ceil_div(n_out / 8, kQuantThreads)),
                  static_cast<unsigned>(std::min<int64_t>(n_tokens, 65535)));
  KESTREL_LAUNCH(scale_fp8_product_kernel, grid, dim3(kQuantThreads), 0, stream, y, x_scale,
                 w_scale, n_tokens, n_out);
  KESTREL_CUDA_CHECK_LAUNCH();
}

}  // namespace kestrel::cuda
