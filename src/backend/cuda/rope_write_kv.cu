#include "backend/cuda/rope_write_kv.cuh"

#include <string>

#include "backend/cuda/cuda_ops.h"

namespace kestrel::cuda {

void rope_write_kv(bf16* q, bf16* k, const bf16* v, const int32_t* positions, const int64_t* slot_mapping,
                   const float* inv_freq, float position_scale, int64_t n_tokens, int64_t n_head,
                   int64_t n_head_kv, int64_t head_dim, int64_t rope_dim, bool rotate_half, bf16* k_cache,
                   bf16* v_cache, int32_t block_size, cudaStream_t stream) {
  if (n_tokens <= 0) return;
  if (rope_dim <= 0 || rope_dim % 2 != 0 || rope_dim > head_dim)
    throw Error("rope_write_kv: rope_dim " + std::to_string(rope_dim) + " must be even and in (0, head_dim " +
                std::to_string(head_dim) + "]");
  if (block_size <= 0) throw Error("rope_write_kv: block_size must be positive");
  RopeWriteKvArgs a{q, k, v, positions, slot_mapping, inv_freq, position_scale,
                    static_cast<int32_t>(n_head), static_cast<int32_t>(n_head_kv), static_cast<int32_t>(head_dim),
                    static_cast<int32_t>(rope_dim), rotate_half, k_cache, v_cache, block_size};
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  const bool vec = head_dim % 8 == 0 && (rotate_half ? (rope_dim / 2) % 8 == 0 : rope_dim % 8 == 0) &&
                   aligned(q) && aligned(k) && aligned(v) && aligned(k_cache) && aligned(v_cache);
  const size_t smem = sizeof(float) * static_cast<size_t>(rope_dim);
  const dim3 grid(static_cast<unsigned>(n_tokens));
  if (vec) {
    auto* kern = &rope_write_kv_kernel<true>;
    KESTREL_LAUNCH(kern, grid, dim3(128), smem, stream, a);
  } else {
    auto* kern = &rope_write_kv_kernel<false>;
    KESTREL_LAUNCH(kern, grid, dim3(128), smem, stream, a);
  }
  KESTREL_CUDA_CHECK_LAUNCH();
}

}  // namespace kestrel::cuda
