#include "backend/cuda/fill_random.cuh"

#include <algorithm>

#include "backend/cuda/fill_ops.h"

namespace kestrel::cuda {

void fill_random_bf16(__nv_bfloat16* out, int64_t n, uint64_t first, const RandomFill& f, cudaStream_t stream) {
  if (n <= 0) return;
  auto* o = reinterpret_cast<uint16_t*>(out);
  const bool vec = n % 8 == 0 && first % 4 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0;
  const int64_t n_items = vec ? n / 8 : n;
  constexpr int kThreads = 256;
  // Enough blocks to fill the GPU; the rest is grid-stride.
  const auto blocks = static_cast<unsigned>(std::min<int64_t>(ceil_div(n_items, kThreads), 8192));
  if (vec) {
    auto* k = &fill_random_kernel<true>;
    KESTREL_LAUNCH(k, dim3(blocks), dim3(kThreads), 0, stream, o, n, first, f);
  } else {
    auto* k = &fill_random_kernel<false>;
    KESTREL_LAUNCH(k, dim3(blocks), dim3(kThreads), 0, stream, o, n, first, f);
  }
  KESTREL_CUDA_CHECK_LAUNCH();
}

}  // namespace kestrel::cuda
