// Launcher of the paged attention kernels (paged_attention.cuh, paged_attention_simt.cuh): picks
// the kernels for the head dim, sizes the workspace, picks the split-KV count, and enqueues plan +
// prefill (when some sequence has 2+ query tokens), decode, and the split-KV reduction (when the
// decode kernel splits).
#include "backend/cuda/paged_attention.cuh"
#include "backend/cuda/paged_attention_decode.cuh"
#include "backend/cuda/paged_attention_simt.cuh"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "backend/cuda/cuda_ops.h"

namespace kestrel::cuda {

namespace {

// Split-KV. The decode work is one block per (sequence, KV head chunk) "item"; a split cuts each
// sequence's context into n_splits ranges of whole 64-key tiles (split_key_range), paid for by a
// partial result per split and the reduction kernel. Two regimes (split_count):
// - fewer items than half the resident decode blocks (SMs x blocks per SM): the GPU would sit
//   mostly idle, so split up to one wave of blocks, at least 4 tiles (256 keys) per split at
//   max_context;
// - else the items fill the GPU already, and a split only evens out the waves: up to two waves,
//   and only with at least 12 tiles (768 keys) per split at max_context.
// Measured on an H200 (op benchmark, 32/8 heads, d128; docs/performance.md, "H200: decode
// attention kernels"), splits chosen as ceil(k x resident / items) with 2 tiles minimum, for
// k = 1 / 2 / 4:
// 64 x 576 keys 58.7 / 61.4 / 71.2 us (1 / 2 / 4 splits); 64 x 2048 175.0 / 156.2 / 166.5 us;
// 1 x 32768 95.8 / 131 / 223 us; 1 x 228 (graph bound 512) 14.2 / 13.8 / 14.1 us; 256 x 1024 and
// 400 x 1000-2000 unsplit either way. In the whole model (8B shape, FP8 weights, one H100,
// `kestrel bench`), 4 tiles a split at least against 2: batch-1 decode at 512 context 299.2 ->
// 305.2 tok/s, at 7,936 297.4 -> 303.5, batch 4 at 2,048 855.3 -> 889.4, batch 16 unchanged; 8
// tiles gave the same as 4 (fewer, longer splits: less partial output and reduction per token).
// p.split_items_per_block = k and p.split_min_tiles = t
// replace the rule by ceil(k x resident / items) with t tiles per split at least (for sweeps:
// scripts/device/gpu_decode_attention.sh).
// The rule's split count for the longest context (max_tiles key tiles: the grid's z) and its least
// tiles per split; each query takes min(count, its own tiles / min_tiles) splits, at least one
// (decode_splits), so its ranges depend on its own context and the item count only.
struct SplitRule {
  int64_t n_splits = 1, min_tiles = 1;
};
SplitRule split_rule(const AttentionParams& p, int64_t items, int64_t resident, int64_t max_tiles) {
  const int64_t forced_k = std::max<int64_t>(p.split_items_per_block, 0);
  const int64_t forced_t = std::max<int64_t>(p.split_min_tiles, 0);
  if (items <= 0) return {};
  const bool sparse = 2 * items < resident;
  const int64_t k = forced_k > 0 ? forced_k : (sparse ? 1 : 2);
  const int64_t min_tiles = forced_t > 0 ? forced_t : forced_k > 0 ? 2 : sparse ? 4 : 12;
  return {std::clamp<int64_t>(ceil_div(k * resident, items), 1, std::max<int64_t>(1, max_tiles / min_tiles)),
          min_tiles};
}

// Blocks of `kernel` (128 threads, `smem` bytes of dynamic shared memory) resident on the whole
// device at once, queried once per kernel (the emulation answers 6).
template <class Kernel>
int64_t resident_blocks(Kernel kernel, size_t smem) {
#if defined(KESTREL_CUDA_EMULATE)
  (void)kernel;
  (void)smem;
  return 6;
#else
  static std::mutex mu;
  static std::map<std::pair<const void*, size_t>, int64_t> cache;  // one device: the runner's
  const std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_pair(reinterpret_cast<const void*>(kernel), smem);
  if (auto it = cache.find(key); it != cache.end()) return it->second;
  int dev = 0, sms = 0, per_sm = 0;
  KESTREL_CUDA_CHECK(cudaGetDevice(&dev));
  KESTREL_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  set_max_dynamic_smem(kernel, smem);
  KESTREL_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kAttnThreads, smem));
  const int64_t n = static_cast<int64_t>(std::max(per_sm, 1)) * sms;
  cache.emplace(key, n);
  return n;
#endif
}

int64_t round_up(int64_t x, int64_t m) { return ceil_div(x, m) * m; }

// Head dims with tensor-core kernels (paged_attention.cuh): 64 and 128 (most models), 32, 80
// (Phi-2), 96 (Phi-3) and 256 (Gemma). Adding one (a multiple of 16) is adding it to this list and
// checking ptxas' register and spill report. The other multiples of 8 up to 256 run on the SIMT
// kernel (paged_attention_simt.cuh).
template <int... Ds>
struct HeadDimList {
  static bool contains(int32_t d) { return ((d == Ds) || ...); }
  // Calls f.template operator()<D>() for the D equal to d; false when d is not in the list.
  template <class F>
  static bool dispatch(int32_t d, F&& f) {
    return ((d == Ds && (f.template operator()<Ds>(), true)) || ...);
  }
};
using MmaHeadDims = HeadDimList<32, 64, 80, 96, 128, 256>;

// The SIMT kernels' slot count for head_dim d: ceil(d / 32) rounded up to a power of two.
template <class F>
void dispatch_simt(int32_t d, F&& f) {
  if (d <= 32) {
    f.template operator()<1>();
  } else if (d <= 64) {
    f.template operator()<2>();
  } else if (d <= 128) {
    f.template operator()<4>();
  } else {
    f.template operator()<8>();
  }
}

// Calls f(kernel, shared memory bytes) with the tensor-core decode kernel for head_dim D, `stages`
// K/V stages (kDecodeStagesSupported), the cache type and, on the FP8 fragment path, fp8_tile keys
// a stage (64 or kFp8KeyTile).
template <int D, bool kFp8, class F>
void with_decode_kernel(int32_t stages, int32_t fp8_tile, F&& f) {
  auto take = [&]<int kStages, int kTile>() {
    if constexpr (kDecodeStagesSupported<D, kStages, kFp8>)
      f(&attention_decode_kernel<D, kStages, kFp8, kTile>, attn_decode_smem_bytes<D, kStages, kFp8, kTile>());
  };
  if constexpr (kFp8 && kFp8Fragments<D>) {
    if (fp8_tile == 64) {
      if (stages == 2) {
        take.template operator()<2, 64>();
      } else {
        take.template operator()<3, 64>();
      }
      return;
    }
  }
  switch (stages) {
    case 2: take.template operator()<2, kFp8KeyTile>(); break;
    default: take.template operator()<3, kFp8KeyTile>(); break;
  }
}

// Resident blocks of the decode kernel that runs (its stages, cache type and FP8 stage keys: the
// FP8 fragment path's stages take half the shared memory).
int64_t decode_resident_blocks(int32_t d, int32_t stages, bool fp8, int32_t fp8_tile) {
  int64_t n = 1;
  auto count = [&](auto kernel, size_t smem) { n = resident_blocks(kernel, smem); };
  if (!MmaHeadDims::dispatch(d, [&]<int D>() {
        if (fp8) {
          with_decode_kernel<D, true>(stages, fp8_tile, count);
        } else {
          with_decode_kernel<D, false>(stages, fp8_tile, count);
        }
      }))
    dispatch_simt(d, [&]<int kSlots>() {
      n = resident_blocks(&attention_simt_kernel<kSlots, true>, attn_simt_smem_bytes(d));
    });
  return n;
}

// K/V stages of the tensor-core decode kernel: p.decode_stages, else by the item count. Three stages (two 32 KB tiles loading while one is computed, 2 blocks per SM at
// d128) against two (3 blocks per SM), H200 op benchmark, 32/8 heads, d128 (docs/performance.md,
// "H200: decode attention kernels"): 64 x 576 keys 49.9 against 58.8 us, 1 x 32768 66.1
// against 95.9 us, 1 x 228 13.9 against 14.4; but 256 x 1024 284.1 against 277.1 us and
// 400 x 1000-2000 keys 648.2 against 590.2 us. So three stages while the items fit in two waves of the two-stage
// kernel's resident blocks (64 x 8 items: yes; 256 x 8: no), else two.
// Whether the decode kernel takes the FP8 fragment path (an FP8 cache at a kFp8Fragments head dim).
bool fp8_fragment_path(const AttentionParams& p) {
  static_assert(kFp8Fragments<64> && kFp8Fragments<128> && !kFp8Fragments<32> && !kFp8Fragments<80> &&
                !kFp8Fragments<96> && !kFp8Fragments<256>);
  return p.k_scale != nullptr && (p.head_dim == 64 || p.head_dim == 128);
}

// The FP8 fragment path's stages hold 128 keys (33 KB at d128). With 64-key stages, measured on an
// H200 (op benchmark, 32/8 heads, d128; docs/performance.md, "H200: FP8 (E4M3) KV cache"), stages
// of the bytes of 2 / 3 / 4 / 6 64-key ones: 64 x 4096 keys 221 / 220 / 224 / 269 us, 256 x 1024
// 222 / 221 / 223 / 276, 400 x 1000-2000 489 / 489 / 485 / 630, but 1 x 32768 (8 items) 87.9 /
// 87.2 / 89.0 / 65.8: there a block's own bytes in flight bound it. So three stages (2 blocks per
// SM) for a handful of items (at most 1/16 of the two-stage kernel's resident blocks: batch 1 to 3
// of the 8B), else two (3 blocks per SM). With 128-key stages on an H100, 2 / 3 stages: 64 x 4096
// 217.6 / 226.3 us, 256 x 1024 219.4 / 232.4, 400 x 1000-2000 470.4 / 511.8, 64 x 576 49.3 / 46.9.
// The stage count is chosen by this rule with 128-key stages (the threshold was measured so).
//
// Keys of the FP8 fragment path's stages: p.fp8_decode_key_tile (64 or 128), else 64 with two
// stages (4 blocks of 16 keys a warp an SM: more warps to hide latency with) and kFp8KeyTile with
// three (a few items, where a block's own bytes in flight bound it). H100, 128-key stages (the rule's
// stages) against 64-key ones with 2 / 3 stages: 64 x 4096 215.9 against 216.5 / 217.5 us, 256 x
// 1024 218.9 against 206.0 / 207.6, 64 x 576 49.4 against 38.6 / 40.8, 400 x 1000-2000 466.0
// against 461.4 / 462.4, d64 64 x 2048 (9/3 heads) 42.5 against 40.9 / 41.1, but 1 x 32768 (8
// items, 3 stages) 65.0 against 80.2 / 81.9 (docs/performance.md, "H200: FP8 (E4M3) KV cache").
int32_t fp8_decode_tile(const AttentionParams& p, int32_t stages) {
  const int32_t t = p.fp8_decode_key_tile;
  if (t != 0 && t != 64 && t != kFp8KeyTile)
    throw Error("paged_attention: fp8_decode_key_tile " + std::to_string(t) + " (0, 64 or 128)");
  return t != 0 ? t : stages == 2 ? 64 : kFp8KeyTile;
}

int32_t decode_stages(const AttentionParams& p, int64_t items) {
  const bool fp8_fragments = fp8_fragment_path(p);
  const int32_t s = p.decode_stages;
  if (s == 0) {
    if (fp8_fragments) return 16 * items <= decode_resident_blocks(p.head_dim, 2, true, kFp8KeyTile) ? 3 : 2;
    return items <= 2 * decode_resident_blocks(p.head_dim, 2, false, 0) ? 3 : 2;
  }
  if (s != 2 && s != 3) throw Error("paged_attention: decode_stages " + std::to_string(s) + " (2 or 3)");
  return s;
}

struct Plan {
  bool mma = true;  // tensor-core kernels (else the SIMT kernel)
  int32_t group = 1;
  int32_t prefill_heads = 1, prefill_head_chunks = 1, tokens_per_tile = 1;
  int32_t decode_heads = 1, decode_head_chunks = 1;
  int64_t max_tiles = 0;     // bound on the prefill tile list's length
  int32_t n_splits = 1, split_min_tiles = 1;
  // Uniform runs of 2 .. kDecodeRowsMaxQuery tokens on the decode kernels, one item per token
  // (AttnKernelArgs::decode_rows): the run length, else 0.
  int32_t decode_rows = 0;
  int64_t part_rows = 0;  // the decode grid's x: sequences, or tokens with decode_rows
  int32_t decode_stages = 2;  // K/V stages of the tensor-core decode kernel
  int32_t fp8_tile = kFp8KeyTile;  // keys of the FP8 fragment path's stages
  // Workspace layout (bytes).
  size_t n_tiles_offset = 0, tiles_offset = 0, lse_offset = 0, out_offset = 0, total = 0;
};

Plan make_plan(const AttentionParams& p) {
  if (!attention_supports_head_dim(p.head_dim))
    throw Error("paged_attention: head_dim " + std::to_string(p.head_dim) +
                " unsupported (a multiple of 8 from 8 to 256)");
  if (p.n_head_kv <= 0 || p.n_head % p.n_head_kv != 0)
    throw Error("paged_attention: n_head " + std::to_string(p.n_head) + " is not a multiple of n_head_kv " +
                std::to_string(p.n_head_kv));
  if (p.block_size <= 0) throw Error("paged_attention: block_size must be positive");
  Plan plan;
  plan.mma = MmaHeadDims::contains(p.head_dim);
  const int32_t prefill_rows = plan.mma ? kPrefillRows : kSimtRows;
  plan.group = p.n_head / p.n_head_kv;
  plan.prefill_heads = std::min(plan.group, prefill_rows);
  plan.prefill_head_chunks = static_cast<int32_t>(ceil_div(plan.group, plan.prefill_heads));
  plan.tokens_per_tile = prefill_rows / plan.prefill_heads;
  static_assert(kSimtRows == kDecodeRows, "one decode plan for both kernels");
  // The FP8 fragment path's items hold up to 8 heads (the mma's n), the others' up to 16 (its m).
  plan.decode_heads = std::min(plan.group, fp8_fragment_path(p) ? kFp8Heads : kDecodeRows);
  plan.decode_head_chunks = static_cast<int32_t>(ceil_div(plan.group, plan.decode_heads));
  plan.max_tiles = ceil_div(p.n_tokens, plan.tokens_per_tile) + std::min<int64_t>(p.n_seqs, p.n_tokens / 2);

  // A windowed query's keys span at most ceil(window / kKeyTile) + 1 tiles (split_key_range).
  int64_t max_tiles = ceil_div(std::max<int32_t>(p.max_context, 1), kKeyTile);
  if (p.window > 0) max_tiles = std::min<int64_t>(max_tiles, ceil_div(p.window, kKeyTile) + 1);
  // Items as the sequences' one-token steps would have them (with decode_rows too), so that a
  // verify step's rows get the stages and split counts, hence the bits, of those steps.
  const int64_t items = p.n_seqs * p.n_head_kv * plan.decode_head_chunks;
  plan.decode_rows = p.uniform_query_len > 1 && p.uniform_query_len <= kDecodeRowsMaxQuery && p.decode_rows
                         ? p.uniform_query_len
                         : 0;
  plan.part_rows = plan.decode_rows > 0 ? p.n_tokens : p.n_seqs;
  plan.decode_stages = decode_stages(p, items);
  plan.fp8_tile = fp8_decode_tile(p, plan.decode_stages);
  const SplitRule rule = split_rule(
      p, items, decode_resident_blocks(p.head_dim, plan.decode_stages, p.k_scale != nullptr, plan.fp8_tile), max_tiles);
  plan.n_splits = static_cast<int32_t>(rule.n_splits);
  plan.split_min_tiles = static_cast<int32_t>(rule.min_tiles);

  size_t at = 0;
  plan.n_tiles_offset = at;
  at += 16;
  plan.tiles_offset = at;
  at += static_cast<size_t>(plan.max_tiles) * sizeof(int2);
  if (plan.n_splits > 1) {
    at = static_cast<size_t>(round_up(static_cast<int64_t>(at), 256));
    plan.lse_offset = at;
    at += static_cast<size_t>(plan.n_splits) * static_cast<size_t>(plan.part_rows * p.n_head) * sizeof(float);
    at = static_cast<size_t>(round_up(static_cast<int64_t>(at), 256));
    plan.out_offset = at;
    at += static_cast<size_t>(plan.n_splits) * static_cast<size_t>(plan.part_rows * p.n_head * p.head_dim) *
          sizeof(float);
  }
  plan.total = at;
  return plan;
}

// The launches of one attention call: plan + prefill (when some sequence has 2+ query tokens; no
// plan with uniform query runs), decode (unless every sequence has 2+ tokens, uniform_query_len),
// and the split-KV reduction (when the decode kernel splits). The tensor-core and the
// SIMT kernel families differ only in the kernels and their shared memory.
void launch_kernels(const AttentionParams& p, const Plan& plan, const AttnKernelArgs& base,
                    void (*prefill)(AttnKernelArgs), size_t prefill_smem, void (*decode)(AttnKernelArgs),
                    size_t decode_smem, void (*reduce)(AttnKernelArgs), cudaStream_t stream) {
  // Uniform runs on the decode kernels (plan.decode_rows): no prefill launch.
  const bool any_prefill = plan.decode_rows == 0 && (p.max_query_len <= 0 || p.max_query_len > 1);
  // Other uniform runs of 2+ query tokens: the prefill tiles follow from the block index, and no
  // sequence is the decode kernel's.
  const bool uniform_prefill = plan.decode_rows == 0 && p.uniform_query_len > 1;
  if (any_prefill) {
    AttnKernelArgs a = base;
    a.heads_per_tile = plan.prefill_heads;
    a.head_chunks = plan.prefill_head_chunks;
    int64_t tiles = plan.max_tiles;
    if (uniform_prefill) {
      a.uniform_query = p.uniform_query_len;
      tiles = p.n_seqs * ceil_div(p.uniform_query_len, plan.tokens_per_tile);
    } else {
      auto* plan_kernel = &attention_plan_kernel;
      KESTREL_LAUNCH(plan_kernel, dim3(1), dim3(256), 0, stream, p.query_start, p.n_seqs, plan.tokens_per_tile,
                     const_cast<int2*>(a.tiles), const_cast<int32_t*>(a.n_tiles));
      KESTREL_CUDA_CHECK_LAUNCH();
    }
    set_max_dynamic_smem(prefill, prefill_smem);
    const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(p.n_head_kv * plan.prefill_head_chunks));
    KESTREL_LAUNCH(prefill, grid, dim3(kAttnThreads), prefill_smem, stream, a);
    KESTREL_CUDA_CHECK_LAUNCH();
  }
  if (uniform_prefill) return;
  AttnKernelArgs a = base;
  a.heads_per_tile = plan.decode_heads;
  a.head_chunks = plan.decode_head_chunks;
  set_max_dynamic_smem(decode, decode_smem);
  const dim3 grid(static_cast<unsigned>(plan.part_rows), static_cast<unsigned>(p.n_head_kv * plan.decode_head_chunks),
                  static_cast<unsigned>(plan.n_splits));
  KESTREL_LAUNCH(decode, grid, dim3(kAttnThreads), decode_smem, stream, a);
  KESTREL_CUDA_CHECK_LAUNCH();
  if (plan.n_splits > 1) {
    const dim3 reduce_grid(static_cast<unsigned>(plan.part_rows), static_cast<unsigned>(p.n_head));
    KESTREL_LAUNCH(reduce, reduce_grid, dim3(kAttnThreads), 0, stream, a);
    KESTREL_CUDA_CHECK_LAUNCH();
  }
}

// The tensor-core kernels for head_dim D (kFp8: for an FP8 cache).
template <int D, bool kFp8>
void launch_all(const AttentionParams& p, const Plan& plan, const AttnKernelArgs& base, cudaStream_t stream) {
  with_decode_kernel<D, kFp8>(plan.decode_stages, plan.fp8_tile, [&](void (*decode)(AttnKernelArgs), size_t decode_smem) {
    launch_kernels(p, plan, base, &attention_prefill_kernel<D, kFp8>, attn_prefill_smem_bytes<D, kFp8>(), decode,
                   decode_smem, &attention_reduce_kernel<D>, stream);
  });
}

// The SIMT kernel, kSlots = ceil(D / 32) rounded up to a power of two.
template <int kSlots, bool kFp8>
void launch_simt(const AttentionParams& p, const Plan& plan, const AttnKernelArgs& base, cudaStream_t stream) {
  const size_t smem = attn_simt_smem_bytes(p.head_dim);
  launch_kernels(p, plan, base, &attention_simt_kernel<kSlots, false, kFp8>, smem,
                 &attention_simt_kernel<kSlots, true, kFp8>, smem, &attention_reduce_kernel<0>, stream);
}

}  // namespace

bool attention_supports_head_dim(int32_t head_dim) { return head_dim >= 8 && head_dim <= 256 && head_dim % 8 == 0; }

// Either cache type's plan fits: callers size the workspace before they bind a layer's cache
// (cuda_graph_runner's probe has no scales), and the FP8 fragment path's decode kernel fits more
// blocks on an SM than the bf16 one, so it may split more (a larger workspace).
size_t attention_workspace_bytes(const AttentionParams& p) {
  static const float kAnyScale = 1.0f;  // make_plan only asks whether a cache has scales
  AttentionParams other = p;
  other.k_scale = other.v_scale = p.k_scale != nullptr ? nullptr : &kAnyScale;
  return std::max(make_plan(p).total, make_plan(other).total);
}

bool attention_supports_fused_rope(int32_t head_dim) { return MmaHeadDims::contains(head_dim); }

void paged_attention(const AttentionParams& p, cudaStream_t stream) {
  if (p.n_tokens <= 0 || p.n_seqs <= 0) return;
  if (p.uniform_query_len < 0 || (p.uniform_query_len > 0 && (p.n_tokens != p.n_seqs * p.uniform_query_len ||
                                                              p.max_query_len != p.uniform_query_len)))
    throw Error("paged_attention: uniform_query_len " + std::to_string(p.uniform_query_len) + " with " +
                std::to_string(p.n_tokens) + " tokens of " + std::to_string(p.n_seqs) + " sequences, max_query_len " +
                std::to_string(p.max_query_len));
  const Plan plan = make_plan(p);
  if (p.workspace_bytes < plan.total || (plan.total > 0 && p.workspace == nullptr))
    throw Error("paged_attention: workspace of " + std::to_string(p.workspace_bytes) + " bytes, " +
                std::to_string(plan.total) + " needed (attention_workspace_bytes)");
  if (reinterpret_cast<uintptr_t>(p.workspace) % 16 != 0) throw Error("paged_attention: workspace not 16-byte aligned");
  if (p.n_seqs > 0x7fffffff || plan.part_rows > 0x7fffffff || p.n_head_kv * std::max(plan.prefill_head_chunks, plan.decode_head_chunks) > 65535 ||
      plan.n_splits > 65535 || p.n_head > 65535)
    throw Error("paged_attention: batch too large for the launch grid");

  const bool fp8 = p.k_scale != nullptr;
  if (fp8 != (p.v_scale != nullptr)) throw Error("paged_attention: an FP8 cache needs both k_scale and v_scale");
  auto* ws = static_cast<unsigned char*>(p.workspace);
  AttnKernelArgs a{};
  a.q = p.q;
  a.k_cache = p.k_cache;
  a.v_cache = p.v_cache;
  a.k_scale = p.k_scale;
  a.v_scale = p.v_scale;
  a.block_tables = p.block_tables;
  a.query_start = p.query_start;
  a.positions = p.positions;
  a.out = p.out;
  a.n_seqs = p.n_seqs;
  a.max_blocks_per_seq = p.max_blocks_per_seq;
  a.n_head = p.n_head;
  a.n_head_kv = p.n_head_kv;
  a.block_size = p.block_size;
  a.block_shift = (p.block_size & (p.block_size - 1)) == 0 ? __builtin_ctz(static_cast<unsigned>(p.block_size)) : -1;
  a.head_dim = p.head_dim;
  a.window = std::max<int32_t>(p.window, 0);
  a.group = plan.group;
  a.tokens_per_tile = plan.tokens_per_tile;
  a.scale_log2 = p.scale * 1.4426950408889634f;
  a.tiles = reinterpret_cast<const int2*>(ws + plan.tiles_offset);
  a.n_tiles = reinterpret_cast<const int32_t*>(ws + plan.n_tiles_offset);
  a.n_splits = plan.n_splits;
  a.split_min_tiles = plan.split_min_tiles;
  a.decode_rows = plan.decode_rows;
  a.n_part_rows = static_cast<int32_t>(plan.part_rows);
  a.part_lse = plan.n_splits > 1 ? reinterpret_cast<float*>(ws + plan.lse_offset) : nullptr;
  a.part_out = plan.n_splits > 1 ? reinterpret_cast<float*>(ws + plan.out_offset) : nullptr;
  if (p.rope.qkv != nullptr) {
    const auto& r = p.rope;
    if (!plan.mma)
      throw Error("paged_attention: fused RoPE needs a tensor-core head dim, not " + std::to_string(p.head_dim));
    if (p.max_query_len != 1) throw Error("paged_attention: fused RoPE is for decode-only passes (max_query_len 1)");
    if (r.rope_dim < 2 || r.rope_dim > p.head_dim || r.rope_dim % 2 != 0 || r.slot_mapping == nullptr ||
        r.inv_freq == nullptr || r.stride < static_cast<int64_t>(p.n_head + 2 * p.n_head_kv) * p.head_dim ||
        r.stride % 8 != 0 || reinterpret_cast<uintptr_t>(r.qkv) % 16 != 0)
      throw Error("paged_attention: fused RoPE needs an even rope_dim in [2, head_dim], slot_mapping, inv_freq and "
                  "16-byte aligned qkv rows of q, k and v heads");
    a.rope_qkv = r.qkv;
    a.rope_qkv_stride = r.stride;
    a.slot_mapping = r.slot_mapping;
    a.inv_freq = r.inv_freq;
    a.rope_position_scale = r.position_scale;
    a.rope_dim = r.rope_dim;
    a.rope_rotate_half = r.rotate_half;
    a.k_cache_out = const_cast<void*>(p.k_cache);
    a.v_cache_out = const_cast<void*>(p.v_cache);
    a.k_scale_out = const_cast<float*>(p.k_scale);
    a.v_scale_out = const_cast<float*>(p.v_scale);
  }
  if (plan.mma) {
    MmaHeadDims::dispatch(p.head_dim, [&]<int D>() {
      if (fp8) {
        launch_all<D, true>(p, plan, a, stream);
      } else {
        launch_all<D, false>(p, plan, a, stream);
      }
    });
  } else {
    dispatch_simt(p.head_dim, [&]<int kSlots>() {
      if (fp8) {
        launch_simt<kSlots, true>(p, plan, a, stream);
      } else {
        launch_simt<kSlots, false>(p, plan, a, stream);
      }
    });
  }
}

}  // namespace kestrel::cuda
