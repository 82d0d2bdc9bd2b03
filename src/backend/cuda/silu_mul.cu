#include "backend/cuda/silu_mul.cuh"

#include <algorithm>

#include "backend/cuda/cuda_ops.h"
#include "backend/cuda/fp8_ops.h"
#include "backend/cuda/row_chunks.h"

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

void silu_mul_fp8(const bf16* gate_up, const float* gu_x_scale, const float* gu_w_scale, uint8_t* q, float* q_scale,
                  int64_t n_tokens, int64_t n_ff, cudaStream_t stream) {
  if (n_tokens <= 0) return;
  if (!fp8_fused_width_supported(n_ff) || n_tokens > 0x7fffffff || (gu_x_scale == nullptr) != (gu_w_scale == nullptr))
    throw Error("silu_mul_fp8: n_ff " + std::to_string(n_ff) +
                " (a positive multiple of 8 up to 32768), both scales of gate_up or neither");
  if (reinterpret_cast<uintptr_t>(gate_up) % 16 != 0 || reinterpret_cast<uintptr_t>(q) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(gu_w_scale) % 16 != 0)
    throw Error("silu_mul_fp8: gate_up, gu_w_scale and q must be 16-byte aligned");
  const RowChunks rc = row_chunks(n_ff);
  with_row_chunks(rc.chunks, [&](auto c) {
    auto* k = &silu_mul_fp8_kernel<decltype(c)::value>;
    KESTREL_LAUNCH(k, dim3(static_cast<unsigned>(n_tokens)),
                   dim3(static_cast<unsigned>(rc.threads)), 0, stream, gate_up, gu_x_scale, gu_w_scale, q, q_scale,
                   n_ff);
  });
  KESTREL_CUDA_CHECK_LAUNCH();
}

}  // namespace kestrel::cuda
