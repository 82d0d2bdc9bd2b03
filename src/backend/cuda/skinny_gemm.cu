#include "backend/cuda/skinny_gemm.cuh"

#include <string>

#include "backend/cuda/cuda_ops.h"

namespace kestrel::cuda {

void check_gemv_operands(const char* op, const ProjectionOperands& a) {
  if (a.swiglu && a.f32_out) throw Error(std::string(op) + ": SwiGLU input with f32 output is not built");
  const int64_t min_stride = a.swiglu ? 2 * a.n_in : a.n_in;
  if (a.x_stride < min_stride || a.x_stride % 8 != 0)
    throw Error(std::string(op) + ": x_stride " + std::to_string(a.x_stride) + " must be a multiple of 8 and >= " +
                std::to_string(min_stride));
  for (const void* ptr : {static_cast<const void*>(a.x), static_cast<const void*>(a.w)})
    if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0) throw Error(std::string(op) + ": operand not 16-byte aligned");
}

namespace {

template <int kNT, int kU, int kWarps>
void launch_skinny(const SkinnyGemmArgs& a, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(ceil_div(a.n_out, kSkinnyRows))), block(kWarps * kWarpSize);
  const int nt = static_cast<int>(a.n_tokens), ni = static_cast<int>(a.n_in), no = static_cast<int>(a.n_out);
  if (a.swiglu) {
    auto* k = &skinny_gemm_kernel<kNT, kU, kWarps, true, false>;
    KESTREL_LAUNCH(k, grid, block, 0, stream, a.x, a.x_stride, a.w, a.y, nt, ni, no);
  } else if (a.f32_out) {
    auto* k = &skinny_gemm_kernel<kNT, kU, kWarps, false, true>;
    KESTREL_LAUNCH(k, grid, block, 0, stream, a.x, a.x_stride, a.w, a.y, nt, ni, no);
  } else {
    auto* k = &skinny_gemm_kernel<kNT, kU, kWarps, false, false>;
    KESTREL_LAUNCH(k, grid, block, 0, stream, a.x, a.x_stride, a.w, a.y, nt, ni, no);
  }
  KESTREL_CUDA_CHECK_LAUNCH();
}

}  // namespace

bool skinny_gemm_supports(int64_t n_tokens, int64_t n_in, int64_t n_out) {
  return n_tokens >= 1 && n_tokens <= kSkinnyMaxTokens && n_in > 0 && n_in % 8 == 0 && n_in <= 0x7fffffff &&
         n_out > 0 && n_out <= 0x7fffffff;
}

void skinny_gemm(const SkinnyGemmArgs& a, cudaStream_t stream) {
  if (!skinny_gemm_supports(a.n_tokens, a.n_in, a.n_out))
    throw Error("skinny_gemm: unsupported shape (n_tokens " + std::to_string(a.n_tokens) + ", n_in " +
                std::to_string(a.n_in) + ", n_out " + std::to_string(a.n_out) + ")");
  check_gemv_operands("skinny_gemm", a);
  const int u = a.unroll, wp = a.warps;
  if (a.n_tokens <= 8) {
    if ((u == 0 || u == 4) && (wp == 0 || wp == 8)) return launch_skinny<1, 4, 8>(a, stream);
    if (u == 4 && wp == 4) return launch_skinny<1, 4, 4>(a, stream);
    if (u == 2 && wp == 8) return launch_skinny<1, 2, 8>(a, stream);
    if (u == 2 && wp == 4) return launch_skinny<1, 2, 4>(a, stream);
    if (u == 8 && wp == 8) return launch_skinny<1, 8, 8>(a, stream);
    if (u == 8 && wp == 4) return launch_skinny<1, 8, 4>(a, stream);
  } else if (a.n_tokens <= 16) {
    if ((u == 0 || u == 4) && (wp == 0 || wp == 8)) return launch_skinny<2, 4, 8>(a, stream);
    if (u == 2 && wp == 8) return launch_skinny<2, 2, 8>(a, stream);
  } else if (a.n_tokens <= 32) {
    if ((u == 0 || u == 2) && (wp == 0 || wp == 8)) return launch_skinny<4, 2, 8>(a, stream);
    if (u == 1 && wp == 8) return launch_skinny<4, 1, 8>(a, stream);
  } else {
    if ((u == 0 || u == 1) && (wp == 0 || wp == 8)) return launch_skinny<8, 1, 8>(a, stream);
  }
  throw Error("skinny_gemm: no kernel built for unroll " + std::to_string(u) + ", warps " + std::to_string(wp) +
              " at " + std::to_string(a.n_tokens) + " tokens");
}

}  // namespace kestrel::cuda
