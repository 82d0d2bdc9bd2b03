#include "backend/cuda/copy_blocks.cuh"

#include "backend/cuda/cuda_ops.h"

namespace kestrel::cuda {

void copy_blocks(void* const* layer_caches, int32_t n_caches, const int32_t* src, const int32_t* dst,
                 int32_t n_copies, int64_t block_bytes, cudaStream_t stream) {
  if (n_copies <= 0 || n_caches <= 0 || block_bytes <= 0) return;
  if (n_caches > 65535) throw Error("copy_blocks: n_caches " + std::to_string(n_caches) + " over 65535");
  const dim3 grid(static_cast<unsigned>(n_copies), static_cast<unsigned>(n_caches));
  if (block_bytes % 16 == 0) {
    auto* k = &copy_blocks_kernel<true>;
    KESTREL_LAUNCH(k, grid, dim3(256), 0, stream, layer_caches, src, dst, block_bytes);
  } else {
    auto* k = &copy_blocks_kernel<false>;
    KESTREL_LAUNCH(k, grid, dim3(256), 0, stream, layer_caches, src, dst, block_bytes);
  }
  KESTREL_CUDA_CHECK_LAUNCH();
}

}  // namespace kestrel::cuda
