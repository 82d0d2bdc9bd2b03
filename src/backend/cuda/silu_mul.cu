#include "backend/cuda/silu_mul.cuh"

#include <algorithm>

#include "backend/cuda/cuda_ops.h"

namespace kestrel::cuda {

namespace {
template <bool kGelu>
void glu_mul(const bf16* gate_up, bf16* out, int64_t n_tokens, int64_t n_ff, cudaStream_t stream) {
  if (n_tokens <= 0 || n_ff <= 0) return;
  const bool vec = n_ff % 8 == 0 && reinterpret_cast<uintptr_t>(gate_up) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(out) % 16 == 0;
  const int64_t n_items = vec ? n_ff / 8 : n_ff;
  const int threads = static_cast<int>(std::min<int64_t>(256, ceil_div(n_items, kWarpSize) * kWarpSize));
  const dim3 grid(static_cast<unsigned>(ceil_div(n_items, threads)),
                  static_cast<unsigned>(std::min<int64_t>(n_tokens, 65535)));
  if (vec) {
    auto* k = &silu_mul_kernel<true, kGelu>;
    KESTREL_LAUNCH(k, grid, dim3(threads), 0, stream, gate_up, out, n_tokens, n_ff);
  } else {
    auto* k = &silu_mul_kernel<false, kGelu>;
    KESTREL_LAUNCH(k, grid, dim3(threads), 0, stream, gate_up, out, n_tokens, n_ff);
  }
  KESTREL_CUDA_CHECK_LAUNCH();
}
}  // namespace

void silu_mul(const bf16* gate_up, bf16* out, int64_t n_tokens, int64_t n_ff, cudaStream_t stream) {
  glu_mul<false>(gate_up, out, n_tokens, n_ff, stream);
}

void gelu_tanh_mul(const bf16* gate_up, bf16* out, int64_t n_tokens, int64_t n_ff, cudaStream_t stream) {
  glu_mul<true>(gate_up, out, n_tokens, n_ff, stream);
}

}  // namespace kestrel::cuda
