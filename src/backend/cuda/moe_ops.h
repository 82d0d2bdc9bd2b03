// Host-side launchers of the mixture-of-experts kernels (moe_route.cu, moe_gemm.cu), in the style
// of cuda_ops.h: device pointers, enqueued on `stream`, never synchronising, bf16 as __nv_bfloat16,
// f32 accumulation. Every launch size comes from host-known bounds (n_tokens, n_expert, the plan's
// max_tiles), so the whole layer is CUDA-graph capturable; tiles the routing leaves empty exit
// before they read a weight.
//
// One MoE FFN (Mixtral, Qwen2-MoE, DeepSeek-V2) over n tokens of width d, E experts of width f,
// k experts per token:
//   logits [n, stride] f32 = x . Router^T (the runner's projection)
//   moe_route:   ids [n, k] int32, weights [n, k] f32 per token (moe_select's rule)
//   moe_sort:    (or both in one: moe_route_sort) the (token, slot) rows grouped by expert, each expert's rows padded to whole
//                tiles of plan.tile_rows: tile_expert [max_tiles], perm [max_tiles * tile_rows]
//   moe_gemm (gate|up, SwiGLU):  act [max_tiles * tile_rows, f] bf16 = silu(x W_g^T) * (x W_u^T)
//   moe_gemm (down):             y [n * k, d] bf16 = act . W_d^T, row t * k + j
//   moe_combine: out [n, d] bf16 = sum_j weights[t, j] * y[t * k + j] (j = 0..k-1 in order)
//                                  + g_t * shared[t] (optional shared expert output)
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace kestrel::cuda {

// Limits of the routing kernels (per-warp shared memory holds one token's E probabilities).
constexpr int32_t kMoeMaxExperts = 512;
constexpr int32_t kMoeMaxTopK = 32;

// The router's selection rule, as kestrel::MoeRouting (model/moe_router.h) states it; the kernels
// take this copy so that the op library depends on no model header.
struct MoeRouteArgs {
  int32_t n_expert = 0;
  int32_t top_k = 0;
  bool group_limited = false;  // DeepSeek's group-limited greedy
  int32_t n_group = 1;         // groups of n_expert / n_group consecutive experts
  int32_t topk_group = 1;      // groups eligible per token
  bool norm_topk = false;      // divide the k weights by their sum
  float routed_scale = 1.0f;   // then multiply them by this
};

// Top-k experts of each token from its router logits, exactly as kestrel::moe_select: softmax
// over the E logits in double (max subtracted, exponentials summed in expert order), under
// group_limited the topk_group groups of the best single probability (ties to the lower group)
// eligible, the k most probable eligible experts best first (ties to the lower id), their
// probabilities renormalised over the k (norm_topk, summed best first) and times routed_scale,
// rounded to f32 once. (The device's double exp may differ from the host's in the last bit, so a
// weight may differ from moe_select's by an f32 ulp in rare cases; ids are the same unless two
// probabilities are within a few double ulps.)
// logits [n_tokens, *] f32, rows logits_stride apart (>= n_expert); slots [n_tokens] or null: a
// token whose slot is negative (a padding row of a captured decode batch) gets ids -1 and weights
// 0 and is left out of every later step. ids, weights [n_tokens, top_k].
// Errors: kestrel::Error for n_expert outside [1, kMoeMaxExperts], top_k outside [1,
// min(kMoeMaxTopK, n_expert)], or a group split that does not divide n_expert (or topk_group
// outside [1, n_group], or fewer than top_k experts in topk_group groups).
void moe_route(const float* logits, int64_t logits_stride, const int64_t* slots, int64_t n_tokens,
               const MoeRouteArgs& r, int32_t* ids, float* weights, cudaStream_t stream);

// The row tiling of one layer's grouped GEMMs for n_tokens tokens: tile_rows (8, 16, 32 or 64), the
// smallest that holds twice the mean rows per expert (an expert with more rows than a tile reads
// its weights once per tile, and a random routing gives many experts more than the mean), and
// max_tiles, an upper bound on the tiles the rows of any routing fill: min(n k, ceil(n k /
// tile_rows) + min(E, n k)). moe_plan_tiles takes tile_rows as given (benchmarks, tests).
struct MoePlan {
  int32_t tile_rows = 8;
  int64_t max_tiles = 0;
  int64_t padded_rows() const { return max_tiles * tile_rows; }
};
MoePlan moe_plan(int64_t n_tokens, int32_t n_expert, int32_t top_k);
MoePlan moe_plan_tiles(int64_t n_tokens, int32_t n_expert, int32_t top_k, int32_t tile_rows);

// Groups the rows r = t * k + j of ids [n_rows] (n_rows = n_tokens * k; ids -1 are skipped) by
// expert: expert e's rows, in increasing r, fill whole tiles of plan.tile_rows from tile
// sum_{e' < e} ceil(count_e' / tile_rows) on, in expert order. tile_expert [plan.max_tiles] gets
// each used tile's expert and -1 after the last; perm [plan.padded_rows()] gets each used tile's
// rows (-1 in the padding of an expert's last tile; entries of unused tiles are not written).
// counts [n_expert] u64 or null: counts[e] += expert e's rows (the expert-usage counters).
// Deterministic: the same ids give the same outputs. grid n_expert blocks.
void moe_sort(const int32_t* ids, int64_t n_rows, int32_t n_expert, const MoePlan& plan, int32_t* tile_expert,
              int32_t* perm, unsigned long long* counts, cudaStream_t stream);

// moe_route then moe_sort, with the same outputs; a step of at most 16 tokens (and at most 48 KB of
// routing scratch: 256 experts at 16 tokens) runs both in one single-block launch, since at
// decode batch sizes each of the two kernels is mostly launch and dependency latency (H200, ncu,
// DeepSeek-V2-Lite at batch 1: 6.6 us and 5.0 us). moe_route_sort_fused says which.
bool moe_route_sort_fused(int64_t n_tokens, const MoeRouteArgs& r);
void moe_route_sort(const float* logits, int64_t logits_stride, const int64_t* slots, int64_t n_tokens,
                    const MoeRouteArgs& r, const MoePlan& plan, int32_t* ids, float* weights, int32_t* tile_expert,
                    int32_t* perm, unsigned long long* counts, cudaStream_t stream);

// The grouped GEMM over the sorted rows, one launch for all experts, tensor cores (mma.sync
// m16n8k16 bf16, f32 accumulation) with the weights streamed through shared memory by cp.async:
// tile i of plan.tile_rows rows runs expert tile_expert[i] (a tile with -1 exits at once, reading
// nothing); each expert's weight tile is read once per row tile.
// - swiglu (gate|up): w [E, 2 n_out, n_in] (each expert's n_out gate rows, then its n_out up
//   rows); row p of the tile reads x row perm[p] / top_k (x [*, n_in], the tokens' rows) and writes
//   y [padded_rows, n_out] row p = silu(x w_gate^T) * (x w_up^T), rounded to bf16 once (f32 until
//   then); padding rows are not written.
// - else (down): w [E, n_out, n_in]; row p reads x row p (x [padded_rows, n_in], the gate|up
//   GEMM's output) and writes y [n_tokens * top_k, n_out] row perm[p].
// Two kernels compute it (moe_gemm.cuh): the tiled one (weights through shared memory, 128
// weight rows per block), and the skinny one (16 weight rows per block, straight into registers,
// the warps splitting k) for steps of at most kMoeSkinnyMaxRows (token, expert) rows (small decode
// batches), where the few rows per expert leave the tiled kernel too few blocks to keep enough
// loads in flight (H200, kestrel_cuda_bench moe: DeepSeek-V2-Lite shape at batch 1, gate|up 22 us
// against 42 us, down 11 us against 23 us; Mixtral-8x7B's down 64 us against 229 us; at 4 tokens
// still ahead, 106 us against 116 us for DeepSeek). Each kernel fixes the order of a row's sums
// whatever its tile holds: a row's bits depend on the kernel, never on the other rows.
// n_in a multiple of 8, x, w 16-byte aligned. Errors: kestrel::Error for a bad shape or alignment,
// or the skinny kernel asked for a plan with tiles of more than 8 rows (or a variant not built).
enum class MoeGemmKernel { Auto, Tiled, Skinny };
constexpr int64_t kMoeSkinnyMaxRows = 24;
struct MoeGemmArgs {
  const __nv_bfloat16* x = nullptr;
  const __nv_bfloat16* w = nullptr;
  __nv_bfloat16* y = nullptr;
  const int32_t* tile_expert = nullptr;
  const int32_t* perm = nullptr;
  int64_t n_in = 0, n_out = 0;
  int32_t top_k = 1;
  bool swiglu = false;
  MoeGemmKernel kernel = MoeGemmKernel::Auto;  // Auto: skinny for n_tokens * top_k <= kMoeSkinnyMaxRows
  int64_t n_tokens = 0;                        // for the Auto choice
  int32_t skinny_unroll = 0, skinny_warps = 0;  // the skinny kernel's k-steps per load and warps (0: tuned)
};
bool moe_gemm_uses_skinny(const MoeGemmArgs& a, const MoePlan& plan);
void moe_gemm(const MoeGemmArgs& a, const MoePlan& plan, cudaStream_t stream);

// out[t] = sum over j = 0..k-1 (in order, skipping ids -1) of weights[t, j] * y[t * k + j], plus,
// when shared is not null, g_t * shared[t] with g_t = sigmoid(shared_logits[t * logits_stride])
// (Qwen2-MoE's shared-expert gate; shared_logits null: g_t = 1); f32 sums, one rounding to bf16.
// y [n_tokens * k, d] bf16, shared [n_tokens, d] bf16 or null, out [n_tokens, d] bf16; d a
// multiple of 8, 16-byte aligned rows. A row's bits do not depend on the other rows.
void moe_combine(const __nv_bfloat16* y, const int32_t* ids, const float* weights, const __nv_bfloat16* shared,
                 const float* shared_logits, int64_t logits_stride, int64_t n_tokens, int32_t top_k, int64_t d,
                 __nv_bfloat16* out, cudaStream_t stream);

}  // namespace kestrel::cuda
