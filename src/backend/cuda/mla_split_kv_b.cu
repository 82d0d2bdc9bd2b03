#include "backend/cuda/mla_split_kv_b.cuh"

#include <string>

#include "backend/cuda/mla_ops.h"

namespace kestrel::cuda {

void mla_split_kv_b(const bf16* kv_b, int64_t n_head, int64_t nope, int64_t v, int64_t r, bf16* uk_t, bf16* uv,
                    cudaStream_t stream) {
  if (n_head <= 0 || nope <= 0 || v <= 0 || r <= 0)
    throw Error("mla_split_kv_b: n_head, qk_nope, v_head_dim and kv_lora_rank must be positive");
  const int64_t blocks = ceil_div(n_head * (nope + v) * r, kMlaSplitThreads);
  if (blocks > 0x7fffffff) throw Error("mla_split_kv_b: kv_b_proj too large for the launch grid");
  auto* kern = &mla_split_kv_b_kernel;
  KESTREL_LAUNCH(kern, dim3(static_cast<unsigned>(blocks)), dim3(kMlaSplitThreads), 0, stream, kv_b, n_head, nope, v, r,
                 uk_t, uv);
  KESTREL_CUDA_CHECK_LAUNCH();
}

}  // namespace kestrel::cuda
