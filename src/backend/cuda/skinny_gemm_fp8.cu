// Skinny GEMM over E4M3 weight rows (fp8_ops.h): the launchers of skinny_gemm_fp8.cuh's kernel.
#include "backend/cuda/skinny_gemm_fp8.cuh"

#include <string>

#include "backend/cuda/fp8_ops.h"

namespace kestrel::cuda {

namespace {

template <int kNT, int kU, int kWarps>
void launch_fp8(const SkinnyFp8Args& a, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(ceil_div(a.n_out, kSkinnyRows))), block(kWarps * kWarpSize);
  const int nt = static_cast<int>(a.n_tokens), ni = static_cast<int>(a.n_in), no = static_cast<int>(a.n_out);
  if (a.swiglu) {
    auto* k = &skinny_gemm_fp8_kernel<kNT, kU, kWarps, true, false>;
    KESTREL_LAUNCH(k, grid, block, 0, stream, a.x, a.x_stride, a.w8, a.w_scale, a.y, nt, ni, no);
  } else if (a.f32_out) {
    auto* k = &skinny_gemm_fp8_kernel<kNT, kU, kWarps, false, true>;
    KESTREL_LAUNCH(k, grid, block, 0, stream, a.x, a.x_stride, a.w8, a.w_scale, a.y, nt, ni, no);
  } else {
    auto* k = &skinny_gemm_fp8_kernel<kNT, kU, kWarps, false, false>;
    KESTREL_LAUNCH(k, grid, block, 0, stream, a.x, a.x_stride, a.w8, a.w_scale, a.y, nt, ni, no);
  }
  KESTREL_CUDA_CHECK_LAUNCH();
}

}  // namespace

bool skinny_gemm_fp8_supports(int64_t n_tokens, int64_t n_in, int64_t n_out) {
  return n_tokens >= 1 && n_tokens <= kSkinnyFp8MaxTokens && n_in > 0 && n_in % 16 == 0 && n_in <= 0x7fffffff &&
         n_out > 0 && n_out <= 0x7fffffff;
}

void skinny_gemm_fp8(const SkinnyFp8Args& a, cudaStream_t stream) {
  if (!skinny_gemm_fp8_supports(a.n_tokens, a.n_in, a.n_out))
    throw Error("skinny_gemm_fp8: unsupported shape (n_tokens " + std::to_string(a.n_tokens) + ", n_in " +
                std::to_string(a.n_in) + ", n_out " + std::to_string(a.n_out) + ")");
  ProjectionOperands checked = a;
  checked.w = reinterpret_cast<const bf16*>(a.w8);
  check_gemv_operands("skinny_gemm_fp8", checked);
  if (a.w_scale == nullptr) throw Error("skinny_gemm_fp8: no weight scales");
  const int u = a.unroll, wp = a.warps;
  // Defaults: at up to 8 tokens 4 warps of 4 k-steps, the fastest in the Llama-3.1-8B-shaped model
  // on the H200 (batch-1 decode 294.8 tok/s; 280.0 with 8 warps of 2 for o and down, although
  // those are faster alone: 7.2 against 8.8 us and 19.7 against 24.1 us in kestrel_cuda_bench fp8,
  // where no kernel overlaps the next one's start).
  if (a.n_tokens <= 8) {
    if ((u == 0 || u == 4) && (wp == 0 || wp == 4)) return launch_fp8<1, 4, 4>(a, stream);
    if (u == 2 && wp == 8) return launch_fp8<1, 2, 8>(a, stream);
    if (u == 4 && wp == 8) return launch_fp8<1, 4, 8>(a, stream);
    if (u == 1 && wp == 8) return launch_fp8<1, 1, 8>(a, stream);
    if (u == 2 && wp == 4) return launch_fp8<1, 2, 4>(a, stream);
  } else if (a.n_tokens <= 16) {
    if ((u == 0 || u == 2) && (wp == 0 || wp == 8)) return launch_fp8<2, 2, 8>(a, stream);
    if (u == 1 && wp == 8) return launch_fp8<2, 1, 8>(a, stream);
    if (u == 2 && wp == 4) return launch_fp8<2, 2, 4>(a, stream);
  }
  throw Error("skinny_gemm_fp8: no kernel built for unroll " + std::to_string(u) + ", warps " + std::to_string(wp) +
              " at " + std::to_string(a.n_tokens) + " tokens");
}

}  // namespace kestrel::cuda
