#include "backend/cuda/rope_write_kv.cuh"

#include <string>

#include "backend/cuda/cuda_ops.h"

namespace kestrel::cuda {

namespace {

void launch(RopeWriteKvArgs a, int64_t n_tokens, cudaStream_t stream) {
  if (n_tokens <= 0) return;
  if (a.rope_dim <= 0 || a.rope_dim % 2 != 0 || a.rope_dim > a.head_dim)
    throw Error("rope_write_kv: rope_dim " + std::to_string(a.rope_dim) + " must be even and in (0, head_dim " +
                std::to_string(a.head_dim) + "]");
  if (a.block_size <= 0) throw Error("rope_write_kv: block_size must be positive");
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  const bool vec = a.head_dim % 8 == 0 && (a.rotate_half ? (a.rope_dim / 2) % 8 == 0 : a.rope_dim % 8 == 0) &&
                   aligned(a.q_src) && aligned(a.q) && aligned(a.k) && aligned(a.v) && aligned(a.k_cache) &&
                   aligned(a.v_cache) && a.q_stride % 8 == 0 && a.k_stride % 8 == 0 && a.v_stride % 8 == 0;
  const size_t smem = sizeof(float) * static_cast<size_t>(a.rope_dim);
  const dim3 grid(static_cast<unsigned>(n_tokens));
  if (a.fp8.k != nullptr) {
    if (a.k_keep || a.head_dim > 256 || a.fp8.v == nullptr || a.fp8.k_scale == nullptr || a.fp8.v_scale == nullptr)
      throw Error("rope_write_kv: an FP8 cache needs codes and scales for k and v, head_dim <= 256, out of place");
    if (vec) {
      auto* kern = &rope_write_kv_kernel<true, true>;
      KESTREL_LAUNCH(kern, grid, dim3(128), smem, stream, a);
    } else {
      auto* kern = &rope_write_kv_kernel<false, true>;
      KESTREL_LAUNCH(kern, grid, dim3(128), smem, stream, a);
    }
  } else if (vec) {
    auto* kern = &rope_write_kv_kernel<true>;
    KESTREL_LAUNCH(kern, grid, dim3(128), smem, stream, a);
  } else {
    auto* kern = &rope_write_kv_kernel<false>;
    KESTREL_LAUNCH(kern, grid, dim3(128), smem, stream, a);
  }
  KESTREL_CUDA_CHECK_LAUNCH();
}

}  // namespace

void rope_write_kv(bf16* q, bf16* k, const bf16* v, const int32_t* positions, const int64_t* slot_mapping,
                   const float* inv_freq, float position_scale, int64_t n_tokens, int64_t n_head,
                   int64_t n_head_kv, int64_t head_dim, int64_t rope_dim, bool rotate_half, bf16* k_cache,
                   bf16* v_cache, int32_t block_size, cudaStream_t stream) {
  RopeWriteKvArgs a{q, q, k, v, n_head * head_dim, n_head_kv * head_dim, n_head_kv * head_dim, true,
                    positions, slot_mapping, inv_freq, position_scale,
                    static_cast<int32_t>(n_head), static_cast<int32_t>(n_head_kv), static_cast<int32_t>(head_dim),
                    static_cast<int32_t>(rope_dim), rotate_half, k_cache, v_cache, block_size};
  launch(a, n_tokens, stream);
}

void rope_write_kv_fused(const bf16* qkv, int64_t qkv_stride, bf16* q_out, const int32_t* positions,
                         const int64_t* slot_mapping, const float* inv_freq, float position_scale, int64_t n_tokens,
                         int64_t n_head, int64_t n_head_kv, int64_t head_dim, int64_t rope_dim, bool rotate_half,
                         bf16* k_cache, bf16* v_cache, int32_t block_size, cudaStream_t stream) {
  if (qkv_stride < (n_head + 2 * n_head_kv) * head_dim)
    throw Error("rope_write_kv_fused: qkv_stride " + std::to_string(qkv_stride) + " is narrower than q, k and v");
  // k is only read (k_keep false), so the const_cast never leads to a write.
  bf16* k = const_cast<bf16*>(qkv) + n_head * head_dim;
  RopeWriteKvArgs a{qkv, q_out, k, k + n_head_kv * head_dim, qkv_stride, qkv_stride, qkv_stride, false,
                    positions, slot_mapping, inv_freq, position_scale,
                    static_cast<int32_t>(n_head), static_cast<int32_t>(n_head_kv), static_cast<int32_t>(head_dim),
                    static_cast<int32_t>(rope_dim), rotate_half, k_cache, v_cache, block_size};
  launch(a, n_tokens, stream);
}

}  // namespace kestrel::cuda

namespace kestrel::cuda {

void rope_write_kv_fused_fp8(const bf16* qkv, int64_t qkv_stride, bf16* q_out, const int32_t* positions,
                             const int64_t* slot_mapping, const float* inv_freq, float position_scale,
                             int64_t n_tokens, int64_t n_head, int64_t n_head_kv, int64_t head_dim, int64_t rope_dim,
                             bool rotate_half, const Fp8KvCache& cache, int32_t block_size, cudaStream_t stream) {
  if (qkv_stride < (n_head + 2 * n_head_kv) * head_dim)
    throw Error("rope_write_kv_fused_fp8: qkv_stride " + std::to_string(qkv_stride) + " is narrower than q, k and v");
  if (cache.k == nullptr) throw Error("rope_write_kv_fused_fp8: no FP8 cache");
  bf16* k = const_cast<bf16*>(qkv) + n_head * head_dim;  // only read (k_keep false)
  RopeWriteKvArgs a{qkv, q_out, k, k + n_head_kv * head_dim, qkv_stride, qkv_stride, qkv_stride, false,
                    positions, slot_mapping, inv_freq, position_scale,
                    static_cast<int32_t>(n_head), static_cast<int32_t>(n_head_kv), static_cast<int32_t>(head_dim),
                    static_cast<int32_t>(rope_dim), rotate_half, nullptr, nullptr, block_size, cache};
  launch(a, n_tokens, stream);
}

}  // namespace kestrel::cuda
