#include "backend/cuda/add_rms_norm.cuh"

#include <algorithm>

#include "backend/cuda/cuda_ops.h"
#include "backend/cuda/fp8_ops.h"
#include "backend/cuda/row_chunks.h"

namespace kestrel::cuda {

namespace {
template <int kChunks>
void launch_vec(float* residual, const bf16* add, const bf16* weight, bf16* out, int64_t n_tokens, int64_t dim,
                float eps, cudaStream_t stream) {
  const int64_t threads = ceil_div(ceil_div(dim / 8, kChunks), kWarpSize) * kWarpSize;
  auto* k = &add_rms_norm_vec_kernel<kChunks>;
  KESTREL_LAUNCH(k, dim3(static_cast<unsigned>(n_tokens)), dim3(static_cast<unsigned>(threads)), 0, stream,
                 residual, add, weight, out, dim, eps);
}
bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }
}  // namespace

void add_rms_norm(float* residual, const bf16* add, const bf16* weight, bf16* out, int64_t n_tokens,
                  int64_t dim, float eps, cudaStream_t stream) {
  if (n_tokens <= 0) return;
  constexpr int64_t kMaxThreads = 512;
  const int64_t n_chunks = dim / 8;
  const bool vec = dim % 8 == 0 && aligned16(residual) && aligned16(add) && aligned16(weight) && aligned16(out);
  if (vec && n_chunks <= kMaxThreads) {
    launch_vec<1>(residual, add, weight, out, n_tokens, dim, eps, stream);
  } else if (vec && n_chunks <= 2 * kMaxThreads) {
    launch_vec<2>(residual, add, weight, out, n_tokens, dim, eps, stream);
  } else if (vec && n_chunks <= 4 * kMaxThreads) {
    launch_vec<4>(residual, add, weight, out, n_tokens, dim, eps, stream);
  } else if (vec && n_chunks <= 8 * kMaxThreads) {
    launch_vec<8>(residual, add, weight, out, n_tokens, dim, eps, stream);
  } else {
    auto* k = &add_rms_norm_scalar_kernel;
    KESTREL_LAUNCH(k, dim3(static_cast<unsigned>(n_tokens)), dim3(256), 0, stream, residual, add, weight, out, dim,
                   eps);
  }
  KESTREL_CUDA_CHECK_LAUNCH();
}

bool fp8_fused_width_supported(int64_t width) { return width > 0 && width % 8 == 0 && width / 8 <= 8 * 512; }

void add_rms_norm_fp8(float* residual, const bf16* add, const float* add_x_scale, const float* add_w_scale,
                      const bf16* weight, uint8_t* q, float* q_scale, int64_t n_tokens, int64_t dim, float eps,
                      cudaStream_t stream) {
  if (n_tokens <= 0) return;
  if (!fp8_fused_width_supported(dim) || n_tokens > 0x7fffffff || (add_x_scale == nullptr) != (add_w_scale == nullptr))
    throw Error("add_rms_norm_fp8: dim " + std::to_string(dim) +
                " (a positive multiple of 8 up to 32768), both scales of the add or neither");
  if (!aligned16(residual) || !aligned16(add) || !aligned16(weight) || !aligned16(q) || !aligned16(add_w_scale))
    throw Error("add_rms_norm_fp8: residual, add, weight, add_w_scale and q must be 16-byte aligned");
  const RowChunks rc = row_chunks(dim);
  with_row_chunks(rc.chunks, [&](auto c) {
    auto* k = &add_rms_norm_fp8_kernel<decltype(c)::value>;
    KESTREL_LAUNCH(k, dim3(static_cast<unsigned>(n_tokens)),
                   dim3(static_cast<unsigned>(rc.threads)), 0, stream, residual, add, add_x_scale, add_w_scale, weight,
                   q, q_scale, dim, eps);
  });
  KESTREL_CUDA_CHECK_LAUNCH();
}

void add_residual(const float* residual, const bf16* add, float* out, int64_t n_tokens, int64_t dim,
                  cudaStream_t stream) {
  const int64_t n = n_tokens * dim;
  if (n <= 0) return;
  const int64_t blocks = std::min<int64_t>(ceil_div(n, 256), 4096);
  auto* k = &add_residual_kernel;
  KESTREL_LAUNCH(k, dim3(static_cast<unsigned>(blocks)), dim3(256), 0, stream, residual, add, out, n);
  KESTREL_CUDA_CHECK_LAUNCH();
}

}  // namespace kestrel::cuda
