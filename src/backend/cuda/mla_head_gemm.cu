#include "backend/cuda/mla_head_gemm.cuh"

#include <string>

namespace kestrel::cuda {

void mla_head_gemm(const MlaHeadGemmArgs& a, cudaStream_t stream) {
  if (a.n_tokens <= 0 || a.n_head <= 0) return;
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  if (a.n_in <= 0 || a.n_out <= 0 || a.n_in % 8 != 0 || a.n_out % 8 != 0)
    throw Error("mla_head_gemm: n_in " + std::to_string(a.n_in) + " and n_out " + std::to_string(a.n_out) +
                " must be positive multiples of 8");
  if (a.x_stride % 8 != 0 || a.x_head_stride % 8 != 0 || a.y_stride % 8 != 0 || a.y_head_stride % 8 != 0 ||
      !aligned(a.x) || !aligned(a.w) || !aligned(a.y))
    throw Error("mla_head_gemm: strides must be multiples of 8 elements and x, w, y 16-byte aligned");
  if (a.rope_dim < 0 || a.rope_dim % 2 != 0 || (a.rope_dim > 0 && (a.positions == nullptr || a.inv_freq == nullptr)))
    throw Error("mla_head_gemm: the RoPE part needs an even rope_dim, positions and inv_freq");
  if (a.n_tokens <= kHgSkinnyMaxTokens && a.n_in <= kHgSkinnyMaxIn) {
    if (a.n_head > 65535) throw Error("mla_head_gemm: too many heads for the launch grid");
    const size_t smem = mla_head_gemm_skinny_smem_bytes(a.n_in);
    auto* kern = &mla_head_gemm_skinny_kernel;
    set_max_dynamic_smem(kern, smem);
    KESTREL_LAUNCH(kern,
                   dim3(static_cast<unsigned>(ceil_div(a.n_out, kHgSkinnyCols)), static_cast<unsigned>(a.n_head),
                        static_cast<unsigned>(ceil_div(a.n_tokens, kHgSkinnyTokens))),
                   dim3(kHgThreads), smem, stream, a);
    KESTREL_CUDA_CHECK_LAUNCH();
    return;
  }
  const int64_t row_tiles = ceil_div(a.n_tokens, kHgRows);
  if (a.n_head > 65535 || row_tiles > 65535) throw Error("mla_head_gemm: too many heads or tokens for the launch grid");
  const dim3 grid(static_cast<unsigned>(ceil_div(a.n_out, kHgCols)), static_cast<unsigned>(a.n_head),
                  static_cast<unsigned>(row_tiles));
  auto* kern = &mla_head_gemm_kernel;
  set_max_dynamic_smem(kern, mla_head_gemm_smem_bytes());
  KESTREL_LAUNCH(kern, grid, dim3(kHgThreads), mla_head_gemm_smem_bytes(), stream, a);
  KESTREL_CUDA_CHECK_LAUNCH();
}

}  // namespace kestrel::cuda
