#include "backend/cuda/embedding.cuh"

#include <algorithm>

#include "backend/cuda/cuda_ops.h"

namespace kestrel::cuda {

void embedding(const bf16* table, const int32_t* ids, int64_t n_tokens, int64_t n_embd, float scale, float* out,
               cudaStream_t stream, int64_t vocab_begin, int64_t n_rows) {
  if (n_tokens <= 0) return;
  const bool vec = n_embd % 8 == 0 && reinterpret_cast<uintptr_t>(table) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(out) % 16 == 0;
  const int threads = static_cast<int>(std::min<int64_t>(256, std::max<int64_t>(32, ceil_div(vec ? n_embd / 8 : n_embd, 32) * 32)));
  const dim3 grid(static_cast<unsigned>(n_tokens));
  if (vec) {
    auto* k = &embedding_kernel<true>;
    KESTREL_LAUNCH(k, grid, threads, 0, stream, table, ids, n_embd, scale, out, vocab_begin, n_rows);
  } else {
    auto* k = &embedding_kernel<false>;
    KESTREL_LAUNCH(k, grid, threads, 0, stream, table, ids, n_embd, scale, out, vocab_begin, n_rows);
  }
  KESTREL_CUDA_CHECK_LAUNCH();
}

}  // namespace kestrel::cuda
