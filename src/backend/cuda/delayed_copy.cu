#include "backend/cuda/delayed_copy.cuh"

#include <algorithm>

#include "backend/cuda/cuda_ops.h"

namespace kestrel::cuda {

void delayed_copy(const void* src, void* dst, size_t bytes, unsigned delay_ns, cudaStream_t stream) {
  if (bytes == 0) return;
  if (bytes % 16 != 0 || reinterpret_cast<uintptr_t>(src) % 16 != 0 || reinterpret_cast<uintptr_t>(dst) % 16 != 0)
    throw Error("delayed_copy: 16-byte aligned buffers of a multiple of 16 bytes only");
  const int64_t n16 = static_cast<int64_t>(bytes / 16);
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(ceil_div(n16, 256), 1024));
  auto* k = &delayed_copy_kernel;
  KESTREL_LAUNCH(k, dim3(blocks), dim3(256), 0, stream, static_cast<const uint4*>(src), static_cast<uint4*>(dst), n16,
                 delay_ns);
  KESTREL_CUDA_CHECK_LAUNCH();
}

}  // namespace kestrel::cuda
