#include "backend/cuda/add_rms_norm.cuh"

#include <algorithm>

#include "backend/cuda/cuda_ops.h"

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
