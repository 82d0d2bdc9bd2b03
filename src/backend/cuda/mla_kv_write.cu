#include "backend/cuda/mla_kv_write.cuh"

#include <string>

namespace kestrel::cuda {

void mla_kv_write(const MlaKvWriteArgs& a, cudaStream_t stream) {
  if (a.n_tokens <= 0) return;
  if (a.rope_dim <= 0 || a.rope_dim % 2 != 0)
    throw Error("mla_kv_write: rope_dim " + std::to_string(a.rope_dim) + " must be even and positive");
  if (a.kv_lora_rank <= 0) throw Error("mla_kv_write: kv_lora_rank must be positive");
  if (a.block_size <= 0) throw Error("mla_kv_write: block_size must be positive");
  if (a.kv_stride < a.kv_lora_rank + a.rope_dim)
    throw Error("mla_kv_write: kv_stride " + std::to_string(a.kv_stride) + " is narrower than the latent and the key");
  if (a.qa != nullptr && (a.q_lora_rank <= 0 || a.qa_stride < a.q_lora_rank || a.qa_norm == nullptr || a.qa_out == nullptr))
    throw Error("mla_kv_write: the low-rank query needs q_lora_rank > 0, qa_stride >= it, its norm and an output");
  if (a.n_tokens > 0x7fffffff) throw Error("mla_kv_write: too many tokens for the launch grid");
  auto* kern = &mla_kv_write_kernel;
  KESTREL_LAUNCH(kern, dim3(static_cast<unsigned>(a.n_tokens)), dim3(kMlaKvWriteThreads),
                 sizeof(float) * static_cast<size_t>(a.rope_dim), stream, a);
  KESTREL_CUDA_CHECK_LAUNCH();
}

}  // namespace kestrel::cuda
