// The small kernels of a mixture-of-experts layer (moe_ops.h has the whole flow): routing (top-k
// experts per token from the router logits), grouping the (token, slot) rows by expert for the
// grouped GEMMs, and the weighted combine of each token's k expert outputs.
#pragma once

#include <climits>
#include <cmath>

#include "backend/cuda/device_common.cuh"
#include "backend/cuda/moe_ops.h"

namespace kestrel::cuda {

constexpr int kMoeRouteWarps = 4;   // tokens per routing block (one warp each)
constexpr int kMoeSortThreads = 256;
constexpr int kMoeMaxGroups = 32;   // group-limited routing: one group score per lane

// The fused routing and grouping kernel's dynamic shared memory, in this order: per warp the
// probabilities (double [n_expert]) and the chosen ids (int32 [top_k]); then the rows' ids [n_rows], the expert histogram [n_expert] and each expert's
// first tile [n_expert + 1] (the last: the tiles in use), int32.
struct MoeRouteSortSmem {
  double* p;
  int32_t *sel, *ids, *count, *tile0;
};
__host__ __device__ inline MoeRouteSortSmem moe_route_sort_layout(unsigned char* base, int warps, int n_expert,
                                                                  int top_k, int n_rows) {
  MoeRouteSortSmem s;
  size_t at = 0;
  s.p = reinterpret_cast<double*>(base);
  at += static_cast<size_t>(warps) * n_expert * sizeof(double);
  s.sel = reinterpret_cast<int32_t*>(base + at);
  at += static_cast<size_t>(warps) * top_k * 4;
  s.ids = reinterpret_cast<int32_t*>(base + at);
  at += static_cast<size_t>(n_rows) * 4;
  s.count = reinterpret_cast<int32_t*>(base + at);
  at += static_cast<size_t>(n_expert) * 4;
  s.tile0 = reinterpret_cast<int32_t*>(base + at);
  return s;
}
__host__ __device__ constexpr size_t moe_route_sort_smem(int warps, int n_expert, int top_k, int n_rows) {
  return static_cast<size_t>(warps) * n_expert * sizeof(double) +
         static_cast<size_t>(warps) * top_k * 4 + static_cast<size_t>(n_rows) * 4 + static_cast<size_t>(2 * n_expert + 1) * 4;
}

// The lowest id among the lanes holding the largest v, over the lanes with `has` (v a
// non-negative double, not NaN: its bits order as the values do, so three warp reductions of 32
// bits replace a shuffle tree of doubles); 0xffffffff when no lane has one.
__device__ __forceinline__ unsigned moe_warp_argmax(bool has, double v, int id) {
  const unsigned long long b = static_cast<unsigned long long>(__double_as_longlong(v));
  const unsigned hi = has ? static_cast<unsigned>(b >> 32) : 0u, lo = static_cast<unsigned>(b);
  const unsigned m_hi = __reduce_max_sync(0xffffffffu, hi);
  const bool eq_hi = has && hi == m_hi;
  const unsigned m_lo = __reduce_max_sync(0xffffffffu, eq_hi ? lo : 0u);
  const bool eq = eq_hi && lo == m_lo;
  return __reduce_min_sync(0xffffffffu, eq ? static_cast<unsigned>(id) : 0xffffffffu);
}

// Routes token t with one warp (moe_select, model/moe_router.cpp, step by step in the same
// arithmetic: the exponentials in double summed by one lane in expert order, selections as repeated
// arg-maxes, which pick what a stable descending sort puts first). Lane l owns experts l, l + 32, ...
// (at most kMoeMaxExperts / 32) and keeps their eligibility as bits; p [n_expert] is the warp's
// shared-memory scratch for the probabilities, sel [top_k] for the chosen ids. Warp barriers only.
__device__ __forceinline__ void moe_route_token(const float* __restrict__ logits, int64_t logits_stride,
                                                const int64_t* __restrict__ slots, int64_t t, const MoeRouteArgs& r,
                                                int32_t* __restrict__ ids, float* __restrict__ weights, double* p,
                                                int32_t* sel) {
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int n = r.n_expert, k = r.top_k;
  int32_t* out_ids = ids + t * k;
  float* out_w = weights + t * k;
  if (slots != nullptr && slots[t] < 0) {
    for (int i = lane; i < k; i += kWarpSize) {
      out_ids[i] = -1;
      out_w[i] = 0.0f;
    }
    return;
  }
  const float* row = logits + t * logits_stride;

  double mx = -INFINITY;
  for (int e = lane; e < n; e += kWarpSize) mx = fmax(mx, static_cast<double>(row[e]));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) mx = fmax(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  for (int e = lane; e < n; e += kWarpSize) p[e] = exp(static_cast<double>(row[e]) - mx);
  __syncwarp();
  double sum = 0.0;
  if (lane == 0) {
    int e = 0;
    for (; e + 8 <= n; e += 8) {  // the loads of 8 ahead of the dependent adds
      double v[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = p[e + i];
#pragma unroll
      for (int i = 0; i < 8; ++i) sum += v[i];
    }
    for (; e < n; ++e) sum += p[e];
  }
  sum = __shfl_sync(0xffffffffu, sum, 0);
  for (int e = lane; e < n; e += kWarpSize) p[e] /= sum;
  __syncwarp();

  // ok bit i: expert lane + 32 i is eligible and not chosen yet.
  const int mine = n > lane ? (n - lane + kWarpSize - 1) / kWarpSize : 0;
  unsigned ok = mine >= 32 ? 0xffffffffu : (1u << mine) - 1u;
  if (r.group_limited) {
    // Group g's score is its best probability; the topk_group best groups become eligible.
    const int per = n / r.n_group;
    double score = 0.0;
    if (lane < r.n_group)
      for (int e = lane * per; e < (lane + 1) * per; ++e) score = fmax(score, p[e]);
    unsigned groups = 0;
    bool taken = false;
    for (int i = 0; i < r.topk_group; ++i) {
      const unsigned g = moe_warp_argmax(lane < r.n_group && !taken, score, lane);
      if (g == 0xffffffffu) break;
      if (lane == static_cast<int>(g)) taken = true;
      groups |= 1u << g;
    }
    unsigned keep = 0;
    for (int i = 0; i < mine; ++i) keep |= ((groups >> ((lane + i * kWarpSize) / per)) & 1u) << i;
    ok &= keep;
  }

  for (int i = 0; i < k; ++i) {
    double v = 0.0;
    int best = INT_MAX;
    for (int j = 0; j < mine; ++j) {
      const double pj = p[lane + j * kWarpSize];
      if (((ok >> j) & 1u) != 0 && !(pj != pj) && (best == INT_MAX || pj > v)) {  // strict: lower ids win ties
        v = pj;
        best = lane + j * kWarpSize;
      }
    }
    unsigned id = moe_warp_argmax(best != INT_MAX, v, best);
    if (id == 0xffffffffu) {  // nothing eligible left but NaN probabilities: the lowest eligible id
      const unsigned any = __ballot_sync(0xffffffffu, ok != 0);
      const int src = any != 0 ? __ffs(any) - 1 : 0;
      const int low = ok != 0 ? lane + (__ffs(ok) - 1) * kWarpSize : INT_MAX;
      id = static_cast<unsigned>(__shfl_sync(0xffffffffu, low, src));
      // With nothing eligible at all (group rules leave fewer than top_k): expert 0.
      if (id == static_cast<unsigned>(INT_MAX)) id = 0;
    }
    if (lane == static_cast<int>(id) % kWarpSize) ok &= ~(1u << (static_cast<int>(id) / kWarpSize));
    if (lane == 0) sel[i] = static_cast<int32_t>(id);
  }
  __syncwarp();
  if (lane == 0) {
    double chosen = 0.0;
    for (int i = 0; i < k; ++i) chosen += p[sel[i]];
    for (int i = 0; i < k; ++i) {
      const int e = sel[i];
      double w = p[e];
      if (r.norm_topk) w /= chosen;
      out_ids[i] = e;
      out_w[i] = static_cast<float>(w * static_cast<double>(r.routed_scale));
    }
  }
  __syncwarp();
}

// One warp per token. grid ceil(n_tokens / kMoeRouteWarps), block kMoeRouteWarps warps. Uses
// warp barriers only, so a warp past the last token may return.
__global__ void __launch_bounds__(kMoeRouteWarps * kWarpSize)
    moe_route_kernel(const float* __restrict__ logits, int64_t logits_stride, const int64_t* __restrict__ slots,
                     int64_t n_tokens, MoeRouteArgs r, int32_t* __restrict__ ids, float* __restrict__ weights) {
  KESTREL_PDL_ENTRY();
  __shared__ double s_p[kMoeRouteWarps][kMoeMaxExperts];
  __shared__ int32_t s_sel[kMoeRouteWarps][kMoeMaxTopK];
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kMoeRouteWarps + warp;
  if (t >= n_tokens) return;
  moe_route_token(logits, logits_stride, slots, t, r, ids, weights, s_p[warp], s_sel[warp]);
}

// Routing and grouping in one block for small steps (moe_route_sort in moe_ops.h): warp w routes
// tokens w, w + warps, ...; then the block groups the rows as moe_sort_kernel does: an expert
// histogram, each expert's first tile (warp 0 scans the experts' tile counts, a chunk per lane),
// and row i's place in its expert's tiles = the rows of that expert before i (n_rows is small).
// grid 1, block 32 x warps; dynamic shared memory moe_route_sort_smem(n_tokens, n_expert, top_k).
__global__ void moe_route_sort_kernel(const float* __restrict__ logits, int64_t logits_stride,
                                      const int64_t* __restrict__ slots, int32_t n_tokens, MoeRouteArgs r,
                                      int32_t tile_rows, int64_t max_tiles, int32_t* __restrict__ ids,
                                      float* __restrict__ weights, int32_t* __restrict__ tile_expert,
                                      int32_t* __restrict__ perm, unsigned long long* __restrict__ counts) {
  KESTREL_PDL_ENTRY();
  const int tid = static_cast<int>(threadIdx.x), lane = tid % kWarpSize, warp = tid / kWarpSize;
  const int warps = static_cast<int>(blockDim.x) / kWarpSize, threads = static_cast<int>(blockDim.x);
  const int n = r.n_expert, k = r.top_k, n_rows = n_tokens * k;
  KESTREL_DYNAMIC_SMEM(smem);
  MoeRouteSortSmem sm = moe_route_sort_layout(smem, warps, n, k, n_rows);
  for (int t = warp; t < n_tokens; t += warps)
    moe_route_token(logits, logits_stride, slots, t, r, ids, weights, sm.p + warp * n, sm.sel + warp * k);
  for (int e = tid; e < n; e += threads) sm.count[e] = 0;
  __syncthreads();  // the ids in global memory are visible to the whole block from here
  for (int i = tid; i < n_rows; i += threads) {
    const int32_t e = ids[i];
    sm.ids[i] = e;
    if (e >= 0) atomicAdd(&sm.count[e], 1);
  }
  __syncthreads();
  if (warp == 0) {
    const int per = (n + kWarpSize - 1) / kWarpSize;
    const int e0 = min(lane * per, n), e1 = min(e0 + per, n);
    int32_t mine = 0;
    for (int e = e0; e < e1; ++e) mine += (sm.count[e] + tile_rows - 1) / tile_rows;
    int32_t incl = mine;  // inclusive scan over the lanes
#pragma unroll
    for (int o = 1; o < kWarpSize; o <<= 1) {
      const int32_t v = __shfl_sync(0xffffffffu, incl, max(lane - o, 0));
      if (lane >= o) incl += v;
    }
    int32_t at = incl - mine;
    for (int e = e0; e < e1; ++e) {
      sm.tile0[e] = at;
      at += (sm.count[e] + tile_rows - 1) / tile_rows;
    }
    if (lane == kWarpSize - 1) sm.tile0[n] = incl;
  }
  __syncthreads();
  for (int e = tid; e < n; e += threads) {
    const int32_t c = sm.count[e], t0 = sm.tile0[e], tiles = (c + tile_rows - 1) / tile_rows;
    if (counts != nullptr) counts[e] += static_cast<unsigned long long>(c);
    for (int i = 0; i < tiles; ++i) tile_expert[t0 + i] = e;
    for (int i = c; i < tiles * tile_rows; ++i) perm[static_cast<int64_t>(t0) * tile_rows + i] = -1;
  }
  for (int64_t i = sm.tile0[n] + tid; i < max_tiles; i += threads) tile_expert[i] = -1;
  for (int i = tid; i < n_rows; i += threads) {
    const int32_t e = sm.ids[i];
    if (e < 0) continue;
    int32_t rank = 0;
    for (int j = 0; j < i; ++j) rank += sm.ids[j] == e ? 1 : 0;
    perm[static_cast<int64_t>(sm.tile0[e]) * tile_rows + rank] = i;
  }
}

// Block e groups expert e's rows (moe_sort in moe_ops.h). Every block counts all experts' rows
// (shared-memory histogram) to find where its tiles start, then compacts its rows in increasing
// order, a block-wide chunk at a time (ballot ranks within a warp, warp totals before it).
// grid n_expert, block kMoeSortThreads.
__global__ void __launch_bounds__(kMoeSortThreads)
    moe_sort_kernel(const int32_t* __restrict__ ids, int64_t n_rows, int32_t n_expert, int32_t tile_rows,
                    int64_t max_tiles, int32_t* __restrict__ tile_expert, int32_t* __restrict__ perm,
                    unsigned long long* __restrict__ counts) {
  KESTREL_PDL_ENTRY();
  __shared__ int32_t s_count[kMoeMaxExperts];
  __shared__ int32_t s_warp[kMoeSortThreads / kWarpSize];
  __shared__ int64_t s_tile0;
  const int tid = static_cast<int>(threadIdx.x), lane = tid % kWarpSize, warp = tid / kWarpSize;
  const int e = static_cast<int>(blockIdx.x);
  for (int i = tid; i < n_expert; i += kMoeSortThreads) s_count[i] = 0;
  __syncthreads();
  for (int64_t i = tid; i < n_rows; i += kMoeSortThreads) {
    const int32_t x = ids[i];
    if (x >= 0) atomicAdd(&s_count[x], 1);
  }
  __syncthreads();
  if (tid == 0) {
    int64_t t0 = 0;
    for (int i = 0; i < e; ++i) t0 += (s_count[i] + tile_rows - 1) / tile_rows;
    s_tile0 = t0;
    if (counts != nullptr) counts[e] += static_cast<unsigned long long>(s_count[e]);
  }
  __syncthreads();
  const int64_t tile0 = s_tile0;
  const int32_t mine = s_count[e];
  const int64_t my_tiles = (mine + tile_rows - 1) / tile_rows;
  for (int64_t i = tid; i < my_tiles; i += kMoeSortThreads) tile_expert[tile0 + i] = e;
  if (e == n_expert - 1)
    for (int64_t i = tile0 + my_tiles + tid; i < max_tiles; i += kMoeSortThreads) tile_expert[i] = -1;

  int32_t* out = perm + tile0 * tile_rows;
  int64_t at = 0;
  for (int64_t base = 0; base < n_rows; base += kMoeSortThreads) {
    const int64_t i = base + tid;
    const bool hit = i < n_rows && ids[i] == e;
    const unsigned bits = __ballot_sync(0xffffffffu, hit);
    if (lane == 0) s_warp[warp] = __popc(bits);
    __syncthreads();
    int64_t before = 0, total = 0;
    for (int w = 0; w < kMoeSortThreads / kWarpSize; ++w) {
      before += w < warp ? s_warp[w] : 0;
      total += s_warp[w];
    }
    if (hit) out[at + before + __popc(bits & ((1u << lane) - 1u))] = static_cast<int32_t>(i);
    __syncthreads();  // s_warp is rewritten by the next chunk
    at += total;
  }
  for (int64_t i = mine + tid; i < my_tiles * tile_rows; i += kMoeSortThreads) out[i] = -1;
}

// One token per block, 8 columns (16 bytes) per thread and step (moe_combine in moe_ops.h).
__global__ void moe_combine_kernel(const __nv_bfloat16* __restrict__ y, const int32_t* __restrict__ ids,
                                   const float* __restrict__ weights, const __nv_bfloat16* __restrict__ shared,
                                   const float* __restrict__ shared_logits, int64_t logits_stride, int32_t top_k,
                                   int64_t d, __nv_bfloat16* __restrict__ out) {
  KESTREL_PDL_ENTRY();
  const int64_t t = blockIdx.x;
  const float g = shared_logits != nullptr ? 1.0f / (1.0f + expf(-shared_logits[t * logits_stride])) : 1.0f;
  for (int64_t c = threadIdx.x; c < d / 8; c += blockDim.x) {
    float acc[8] = {};
    for (int j = 0; j < top_k; ++j) {
      const int64_t row = t * top_k + j;
      if (ids[row] < 0) continue;
      const float w = weights[row];
      float v[8];
      unpack_bf16x8(reinterpret_cast<const uint4*>(y + row * d)[c], v);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] += w * v[i];
    }
    if (shared != nullptr) {
      float v[8];
      unpack_bf16x8(reinterpret_cast<const uint4*>(shared + t * d)[c], v);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] += g * v[i];
    }
    reinterpret_cast<uint4*>(out + t * d)[c] = pack_bf16x8(acc);
  }
}

}  // namespace kestrel::cuda
