#include "backend/cuda/moe_gemm.cuh"

#include <string>

#include "backend/cuda/moe_ops.h"

namespace kestrel::cuda {

namespace {


template <int kBT, bool kSwiGLU>
void launch_moe_gemm(const MoeGemmParams& p, int64_t max_tiles, cudaStream_t stream) {
  auto* kernel = &moe_gemm_kernel<kBT, kSwiGLU>;
  constexpr size_t smem = moe_gemm_smem_bytes<kBT>();
  set_max_dynamic_smem(kernel, smem);
  const dim3 grid(static_cast<unsigned>(max_tiles), static_cast<unsigned>(ceil_div(p.n_out, kMoeGemmCols<kSwiGLU>)));
  KESTREL_LAUNCH(kernel, grid, dim3(kMoeGemmThreads), smem, stream, p);
  KESTREL_CUDA_CHECK_LAUNCH();
}

template <bool kSwiGLU>
void launch_moe_gemm(const MoeGemmParams& p, const MoePlan& plan, cudaStream_t stream) {
  switch (plan.tile_rows) {
    case 8: return launch_moe_gemm<8, kSwiGLU>(p, plan.max_tiles, stream);
    case 16: return launch_moe_gemm<16, kSwiGLU>(p, plan.max_tiles, stream);
    case 32: return launch_moe_gemm<32, kSwiGLU>(p, plan.max_tiles, stream);
    case 64: return launch_moe_gemm<64, kSwiGLU>(p, plan.max_tiles, stream);
    default: throw Error("moe_gemm: no kernel for row tiles of " + std::to_string(plan.tile_rows));
  }
}

template <int kU, int kWarps>
void launch_moe_skinny(const MoeGemmParams& p, bool swiglu, int64_t max_tiles, cudaStream_t stream) {
  auto* kernel = swiglu ? &moe_skinny_kernel<1, kU, kWarps, true> : &moe_skinny_kernel<1, kU, kWarps, false>;
  const int64_t rows_per_block = swiglu ? 8 : kSkinnyRows;
  const dim3 grid(static_cast<unsigned>(max_tiles), static_cast<unsigned>(ceil_div(p.n_out, rows_per_block)));
  KESTREL_LAUNCH(kernel, grid, dim3(kWarps * kWarpSize), 0, stream, p);
  KESTREL_CUDA_CHECK_LAUNCH();
}


}  // namespace

bool moe_gemm_uses_skinny(const MoeGemmArgs& a, const MoePlan& plan) {
  switch (a.kernel) {
    case MoeGemmKernel::Skinny:
      if (plan.tile_rows != 8)
        throw Error("moe_gemm: the skinny kernel takes row tiles of 8, not " + std::to_string(plan.tile_rows));
      return true;
    case MoeGemmKernel::Tiled: return false;
    case MoeGemmKernel::Auto: break;
  }
  return plan.tile_rows == 8 && a.n_tokens * a.top_k <= kMoeSkinnyMaxRows;
}

void moe_gemm(const MoeGemmArgs& a, const MoePlan& plan, cudaStream_t stream) {
  if (a.n_in <= 0 || a.n_in % 8 != 0 || a.n_in > 0x7fffffff || a.n_out <= 0 || a.n_out > int64_t{65535} * 64)
    throw Error("moe_gemm: unsupported shape (n_in " + std::to_string(a.n_in) + ", a positive multiple of 8; n_out " +
                std::to_string(a.n_out) + ", at most 65535 x 64)");
  if (a.top_k < 1) throw Error("moe_gemm: top_k must be positive");
  for (const void* p : {static_cast<const void*>(a.x), static_cast<const void*>(a.w)})
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) throw Error("moe_gemm: operand not 16-byte aligned");
  if (plan.max_tiles <= 0) return;
  if (plan.max_tiles > 0x7fffffff) throw Error("moe_gemm: too many row tiles for the launch grid");
  MoeGemmParams p{};
  p.x = a.x;
  p.w = a.w;
  p.y = a.y;
  p.tile_expert = a.tile_expert;
  p.perm = a.perm;
  p.w_expert_elems = (a.swiglu ? 2 : 1) * a.n_out * a.n_in;
  p.n_in = static_cast<int32_t>(a.n_in);
  p.n_out = static_cast<int32_t>(a.n_out);
  p.top_k = a.top_k;
  if (moe_gemm_uses_skinny(a, plan)) {
    // Defaults from kestrel_cuda_bench moe on the H200: rows shorter than 2048 (DeepSeek-V2-Lite's
    // down, 1408) run best with 4 warps of 2 k-steps (11.1 us against 13.5 us with 8 warps of 4),
    // longer ones with 8 warps of 4 (Mixtral's down, 14336: 64 us against 75 us).
    const bool short_rows = a.n_in < 2048;
    const int32_t u = a.skinny_unroll != 0 ? a.skinny_unroll : short_rows ? 2 : 4;
    const int32_t w = a.skinny_warps != 0 ? a.skinny_warps : short_rows ? 4 : 8;
    if (u == 4 && w == 8) return launch_moe_skinny<4, 8>(p, a.swiglu, plan.max_tiles, stream);
    if (u == 2 && w == 8) return launch_moe_skinny<2, 8>(p, a.swiglu, plan.max_tiles, stream);
    if (u == 4 && w == 4) return launch_moe_skinny<4, 4>(p, a.swiglu, plan.max_tiles, stream);
    if (u == 2 && w == 4) return launch_moe_skinny<2, 4>(p, a.swiglu, plan.max_tiles, stream);
    throw Error("moe_gemm: no skinny kernel with unroll " + std::to_string(u) + " and " + std::to_string(w) + " warps");
  } else if (a.swiglu) {
    launch_moe_gemm<true>(p, plan, stream);
  } else {
    launch_moe_gemm<false>(p, plan, stream);
  }
}

}  // namespace kestrel::cuda
