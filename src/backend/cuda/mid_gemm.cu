// Launcher of mid_gemm_kernel (mid_gemm.cuh): picks the token tiles and the split-K count, and
// adds the reduction launch when the GEMM splits.
#include "backend/cuda/mid_gemm.cuh"

#include <algorithm>
#include <string>

#include "backend/cuda/cuda_ops.h"

namespace kestrel::cuda {

namespace {

constexpr int kMidGroups = 4;  // row groups of 16 per block: 64 rows of W, 2 warps per k-chunk

// Split-K count when not given: enough blocks for about two per SM (132 on an H200), with at
// least 4 chunks of n_in per split.
int auto_splits(int64_t n_in, int64_t n_out) {
  const int64_t row_blocks = ceil_div(n_out, 16 * kMidGroups);
  const int64_t most = std::max<int64_t>(1, n_in / (4 * kMidChunk));
  return static_cast<int>(std::clamp<int64_t>(ceil_div(264, row_blocks), 1, std::min<int64_t>(most, 16)));
}

template <int kNT>
void launch_mid(const MidGemmArgs& a, int splits, int64_t k_split, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(ceil_div(a.n_out, 16 * kMidGroups)), static_cast<unsigned>(splits));
  const size_t smem = mid_gemm_smem_bytes<kNT>();
  const int nt = static_cast<int>(a.n_tokens), ni = static_cast<int>(a.n_in), no = static_cast<int>(a.n_out),
            ks = static_cast<int>(k_split);
  auto launch = [&](auto* kernel) {
    set_max_dynamic_smem(kernel, smem);
    KESTREL_LAUNCH(kernel, grid, dim3(kMidThreads), smem, stream, a.x, a.x_stride, a.w, a.y, a.workspace, nt, ni,
                   no, ks);
    KESTREL_CUDA_CHECK_LAUNCH();
  };
  if (a.swiglu)
    launch(&mid_gemm_kernel<kNT, kMidGroups, true, false>);
  else if (a.f32_out)
    launch(&mid_gemm_kernel<kNT, kMidGroups, false, true>);
  else
    launch(&mid_gemm_kernel<kNT, kMidGroups, false, false>);
}

}  // namespace

bool mid_gemm_supports(int64_t n_tokens, int64_t n_in, int64_t n_out) {
  return n_tokens >= 1 && n_tokens <= kMidGemmMaxTokens && n_in > 0 && n_in % 8 == 0 && n_in <= 0x7fffffff &&
         n_out > 0 && n_out <= 0x7fffffff && n_tokens * n_out <= 0x7fffffff;
}

int mid_gemm_splits(int64_t n_in, int64_t n_out, int splits) {
  const int64_t chunks = ceil_div(n_in, kMidChunk);
  const int64_t s = splits > 0 ? splits : auto_splits(n_in, n_out);
  // Whole chunks per split, and no empty split.
  const int64_t per = ceil_div(chunks, std::min<int64_t>(s, chunks));
  return static_cast<int>(ceil_div(chunks, per));
}

size_t mid_gemm_workspace_bytes(int64_t n_tokens, int64_t n_in, int64_t n_out, int splits) {
  const int s = mid_gemm_splits(n_in, n_out, splits);
  return s > 1 ? static_cast<size_t>(s) * static_cast<size_t>(n_tokens * n_out) * sizeof(float) : 0;
}

void mid_gemm(const MidGemmArgs& a, cudaStream_t stream) {
  if (!mid_gemm_supports(a.n_tokens, a.n_in, a.n_out))
    throw Error("mid_gemm: unsupported shape (n_tokens " + std::to_string(a.n_tokens) + ", n_in " +
                std::to_string(a.n_in) + ", n_out " + std::to_string(a.n_out) + ")");
  check_gemv_operands("mid_gemm", a);
  const int splits = mid_gemm_splits(a.n_in, a.n_out, a.splits);
  const size_t need = mid_gemm_workspace_bytes(a.n_tokens, a.n_in, a.n_out, a.splits);
  if (a.workspace_bytes < need || (need > 0 && a.workspace == nullptr))
    throw Error("mid_gemm: workspace of " + std::to_string(a.workspace_bytes) + " bytes, " + std::to_string(need) +
                " needed (mid_gemm_workspace_bytes)");
  const int64_t k_split = ceil_div(ceil_div(a.n_in, kMidChunk), splits) * kMidChunk;
  if (a.n_tokens <= 16)
    launch_mid<2>(a, splits, k_split, stream);
  else if (a.n_tokens <= 32)
    launch_mid<4>(a, splits, k_split, stream);
  else
    launch_mid<8>(a, splits, k_split, stream);
  if (splits > 1) {
    const int64_t n = a.n_tokens * a.n_out;
    const dim3 grid(static_cast<unsigned>(ceil_div(n, 256)));
    if (a.f32_out) {
      auto* k = &mid_gemm_reduce_kernel<true>;
      KESTREL_LAUNCH(k, grid, dim3(256), 0, stream, a.workspace, a.y, splits, n);
    } else {
      auto* k = &mid_gemm_reduce_kernel<false>;
      KESTREL_LAUNCH(k, grid, dim3(256), 0, stream, a.workspace, a.y, splits, n);
    }
    KESTREL_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace kestrel::cuda
