#include "backend/cuda/moe_route.cuh"

#include <algorithm>
#include <string>

#include "backend/cuda/moe_ops.h"

namespace kestrel::cuda {

namespace {

void check_route(const MoeRouteArgs& r, int64_t logits_stride) {
  if (r.n_expert < 1 || r.n_expert > kMoeMaxExperts)
    throw Error("moe_route: n_expert " + std::to_string(r.n_expert) + " outside [1, " +
                std::to_string(kMoeMaxExperts) + "]");
  if (r.top_k < 1 || r.top_k > std::min(kMoeMaxTopK, r.n_expert))
    throw Error("moe_route: top_k " + std::to_string(r.top_k) + " outside [1, min(" + std::to_string(kMoeMaxTopK) +
                ", n_expert)]");
  if (logits_stride < r.n_expert) throw Error("moe_route: logits_stride below n_expert");
  if (r.group_limited) {
    if (r.n_group < 1 || r.n_group > kMoeMaxGroups || r.n_expert % r.n_group != 0)
      throw Error("moe_route: n_group " + std::to_string(r.n_group) + " must divide n_expert " +
                  std::to_string(r.n_expert) + " and be at most " + std::to_string(kMoeMaxGroups));
    if (r.topk_group < 1 || r.topk_group > r.n_group || r.topk_group * (r.n_expert / r.n_group) < r.top_k)
      throw Error("moe_route: topk_group " + std::to_string(r.topk_group) + " groups of " +
                  std::to_string(r.n_expert / r.n_group) + " experts hold fewer than top_k " + std::to_string(r.top_k));
  }
}

void check_sort(int64_t n_rows, int32_t n_expert) {
  if (n_expert < 1 || n_expert > kMoeMaxExperts)
    throw Error("moe_sort: n_expert " + std::to_string(n_expert) + " outside [1, " + std::to_string(kMoeMaxExperts) +
                "]");
  if (n_rows > 0x7fffffff) throw Error("moe_sort: more than 2^31 rows");
}

// Warps of the fused kernel for n_tokens tokens: one per token up to 16; 0 when the step is too
// large for one block (its shared memory past 48 KB, or more tokens than warps).
int route_sort_warps(int64_t n_tokens, const MoeRouteArgs& r) {
  constexpr int64_t kMaxWarps = 16;
  if (n_tokens < 1 || n_tokens > kMaxWarps) return 0;
  const int warps = static_cast<int>(n_tokens);
  const size_t smem = moe_route_sort_smem(warps, r.n_expert, r.top_k, static_cast<int>(n_tokens) * r.top_k);
  return smem <= 48 * 1024 ? warps : 0;
}

}  // namespace

void moe_route(const float* logits, int64_t logits_stride, const int64_t* slots, int64_t n_tokens,
               const MoeRouteArgs& r, int32_t* ids, float* weights, cudaStream_t stream) {
  check_route(r, logits_stride);
  if (n_tokens <= 0) return;
  const dim3 grid(static_cast<unsigned>(ceil_div(n_tokens, kMoeRouteWarps)));
  KESTREL_LAUNCH(moe_route_kernel, grid, dim3(kMoeRouteWarps * kWarpSize), 0, stream, logits, logits_stride, slots,
                 n_tokens, r, ids, weights);
  KESTREL_CUDA_CHECK_LAUNCH();
}

MoePlan moe_plan_tiles(int64_t n_tokens, int32_t n_expert, int32_t top_k, int32_t tile_rows) {
  MoePlan p;
  const int64_t rows = n_tokens * top_k;
  p.tile_rows = tile_rows;
  p.max_tiles = std::min(rows, ceil_div(rows, p.tile_rows) + std::min<int64_t>(n_expert, rows));
  return p;
}

MoePlan moe_plan(int64_t n_tokens, int32_t n_expert, int32_t top_k) {
  const int64_t mean = ceil_div(n_tokens * top_k, std::max(1, n_expert));
  return moe_plan_tiles(n_tokens, n_expert, top_k, mean <= 4 ? 8 : mean <= 8 ? 16 : mean <= 16 ? 32 : 64);
}

void moe_sort(const int32_t* ids, int64_t n_rows, int32_t n_expert, const MoePlan& plan, int32_t* tile_expert,
              int32_t* perm, unsigned long long* counts, cudaStream_t stream) {
  check_sort(n_rows, n_expert);
  if (n_rows <= 0 || plan.max_tiles <= 0) return;
  KESTREL_LAUNCH(moe_sort_kernel, dim3(static_cast<unsigned>(n_expert)), dim3(kMoeSortThreads), 0, stream, ids,
                 n_rows, n_expert, plan.tile_rows, plan.max_tiles, tile_expert, perm, counts);
  KESTREL_CUDA_CHECK_LAUNCH();
}

bool moe_route_sort_fused(int64_t n_tokens, const MoeRouteArgs& r) { return route_sort_warps(n_tokens, r) > 0; }

void moe_route_sort(const float* logits, int64_t logits_stride, const int64_t* slots, int64_t n_tokens,
                    const MoeRouteArgs& r, const MoePlan& plan, int32_t* ids, float* weights, int32_t* tile_expert,
                    int32_t* perm, unsigned long long* counts, cudaStream_t stream) {
  check_route(r, logits_stride);
  check_sort(n_tokens * r.top_k, r.n_expert);
  if (n_tokens <= 0 || plan.max_tiles <= 0) return;
  const int warps = route_sort_warps(n_tokens, r);
  if (warps == 0) {
    moe_route(logits, logits_stride, slots, n_tokens, r, ids, weights, stream);
    moe_sort(ids, n_tokens * r.top_k, r.n_expert, plan, tile_expert, perm, counts, stream);
    return;
  }
  const int n_rows = static_cast<int>(n_tokens) * r.top_k;
  KESTREL_LAUNCH(moe_route_sort_kernel, dim3(1), dim3(static_cast<unsigned>(warps * kWarpSize)),
                 moe_route_sort_smem(warps, r.n_expert, r.top_k, n_rows), stream, logits, logits_stride, slots,
                 static_cast<int32_t>(n_tokens), r, plan.tile_rows, plan.max_tiles, ids, weights, tile_expert, perm,
                 counts);
  KESTREL_CUDA_CHECK_LAUNCH();
}

void moe_combine(const __nv_bfloat16* y, const int32_t* ids, const float* weights, const __nv_bfloat16* shared,
                 const float* shared_logits, int64_t logits_stride, int64_t n_tokens, int32_t top_k, int64_t d,
                 __nv_bfloat16* out, cudaStream_t stream) {
  if (d % 8 != 0) throw Error("moe_combine: d " + std::to_string(d) + " is not a multiple of 8");
  for (const void* p : {static_cast<const void*>(y), static_cast<const void*>(shared), static_cast<const void*>(out)})
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) throw Error("moe_combine: operand not 16-byte aligned");
  if (n_tokens <= 0) return;
  if (n_tokens > 0x7fffffff) throw Error("moe_combine: too many tokens for the launch grid");
  const int threads = static_cast<int>(std::min<int64_t>(256, ceil_div(d / 8, kWarpSize) * kWarpSize));
  KESTREL_LAUNCH(moe_combine_kernel, dim3(static_cast<unsigned>(n_tokens)), dim3(threads), 0, stream, y, ids, weights,
                 shared, shared_logits, logits_stride, top_k, d, out);
  KESTREL_CUDA_CHECK_LAUNCH();
}

}  // namespace kestrel::cuda
