// Launcher of the MLA attention kernels (mla_attention.cuh): dims dispatch, workspace layout, the
// split-KV count, and the launches (plan + prefill when some sequence has 2+ query tokens, decode,
// and the split reduction when decode splits).
#include "backend/cuda/mla_attention.cuh"

#include <algorithm>
#include <map>
#include <mutex>
#include <string>
#include <utility>

namespace kestrel::cuda {

namespace {

// Splits of a decode context: only while the decode blocks (sequences x head chunks) would fill
// fewer than half of the device's resident blocks; then up to one wave of blocks, each split at
// least kMinSplitTiles tiles (32 keys: at r 512 a split reads 37 KB of latent rows and writes a
// 32 KB partial result, 16 rows x r f32; a block's tiles run one after another, so at batch 1 the
// time is about one tile's when every tile has its own block), and never more than kMaxSplits.
constexpr int64_t kMinSplitTiles = 1;
constexpr int64_t kMaxSplits = kMlaMaxSplits;

// The kernels for (r, R): calls f.template operator()<r, R>(); false for an unsupported pair.
template <class F>
bool dispatch_dims(int32_t r, int32_t rope, F&& f) {
  if (r == 512 && rope == 64) {
    f.template operator()<512, 64>();
    return true;
  }
  if (r == 32 && rope == 8) {
    f.template operator()<32, 8>();
    return true;
  }
  return false;
}

// Blocks of the decode kernel resident on the whole device (the emulation answers 6).
int64_t resident_blocks(int32_t r, int32_t rope) {
#if defined(KESTREL_CUDA_EMULATE)
  (void)r;
  (void)rope;
  return 6;
#else
  static std::mutex mu;
  static std::map<std::pair<int32_t, int32_t>, int64_t> cache;  // one device: the runner's
  const std::lock_guard<std::mutex> lock(mu);
  if (auto it = cache.find({r, rope}); it != cache.end()) return it->second;
  int dev = 0, sms = 0, per_sm = 0;
  KESTREL_CUDA_CHECK(cudaGetDevice(&dev));
  KESTREL_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  dispatch_dims(r, rope, [&]<int kDv, int kRope>() {
    auto* kern = &mla_attention_kernel<kDv, kRope, true>;
    const size_t smem = MlaDims<kDv, kRope>::smem_bytes();
    set_max_dynamic_smem(kern, smem);
    KESTREL_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kern, kMlaThreads, smem));
  });
  const int64_t n = static_cast<int64_t>(std::max(per_sm, 1)) * sms;
  cache.emplace(std::make_pair(r, rope), n);
  return n;
#endif
}

int64_t round_up(int64_t x, int64_t m) { return ceil_div(x, m) * m; }

struct Plan {
  int32_t heads_per_tile = 1, head_chunks = 1, tokens_per_tile = 1;
  int64_t max_tiles = 0;  // bound on the prefill tile list's length
  int32_t n_splits = 1;
  size_t n_tiles_offset = 0, tiles_offset = 0, lse_offset = 0, out_offset = 0, total = 0;
};

void check_dims(int32_t r, int32_t rope) {
  if (!mla_attention_supports(r, rope))
    throw Error("mla_attention: kv_lora_rank " + std::to_string(r) + " with qk_rope_head_dim " + std::to_string(rope) +
                " has no kernel (supported: 512 with 64, 32 with 8)");
}

// The workspace layout for split_rows = n_splits x n_seqs partial rows (0: no split).
void layout(Plan& plan, int64_t split_rows, int32_t n_head, int32_t r) {
  size_t at = 0;
  plan.n_tiles_offset = at;
  at += 16;
  plan.tiles_offset = at;
  at += static_cast<size_t>(plan.max_tiles) * sizeof(int2);
  if (split_rows > 0) {
    at = static_cast<size_t>(round_up(static_cast<int64_t>(at), 256));
    plan.lse_offset = at;
    at += static_cast<size_t>(split_rows * n_head) * sizeof(float);
    at = static_cast<size_t>(round_up(static_cast<int64_t>(at), 256));
    plan.out_offset = at;
    at += static_cast<size_t>(split_rows * n_head) * static_cast<size_t>(r) * sizeof(float);
  }
  plan.total = at;
}

void tile_shape(Plan& plan, int32_t n_head) {
  plan.heads_per_tile = std::min(n_head, kMlaRows);
  plan.head_chunks = static_cast<int32_t>(ceil_div(n_head, plan.heads_per_tile));
  plan.tokens_per_tile = kMlaRows / plan.heads_per_tile;
}

Plan make_plan(const MlaAttentionParams& p) {
  check_dims(p.kv_lora_rank, p.rope_dim);
  if (p.n_head <= 0) throw Error("mla_attention: n_head must be positive");
  if (p.block_size <= 0) throw Error("mla_attention: block_size must be positive");
  Plan plan;
  tile_shape(plan, p.n_head);
  plan.max_tiles = ceil_div(p.n_tokens, plan.tokens_per_tile) + std::min<int64_t>(p.n_seqs, p.n_tokens / 2);
  const int64_t items = p.n_seqs * plan.head_chunks;
  const int64_t key_tiles = ceil_div(std::max<int32_t>(p.max_context, 1), kMlaKeys);
  int64_t splits = 1;
  if (p.n_splits > 0) {
    splits = std::min<int64_t>(p.n_splits, kMaxSplits);
  } else if (items > 0) {
    const int64_t resident = resident_blocks(p.kv_lora_rank, p.rope_dim);
    if (2 * items < resident)
      splits = std::clamp<int64_t>(ceil_div(resident, items), 1,
                                   std::min<int64_t>(kMaxSplits, std::max<int64_t>(1, key_tiles / kMinSplitTiles)));
  }
  plan.n_splits = static_cast<int32_t>(splits);
  layout(plan, plan.n_splits > 1 ? plan.n_splits * p.n_seqs : 0, p.n_head, p.kv_lora_rank);
  return plan;
}

}  // namespace

bool mla_attention_supports(int32_t kv_lora_rank, int32_t rope_dim) {  // the pairs dispatch_dims lists
  return (kv_lora_rank == 512 && rope_dim == 64) || (kv_lora_rank == 32 && rope_dim == 8);
}

size_t mla_attention_workspace_bytes(const MlaAttentionParams& p) { return make_plan(p).total; }

size_t mla_attention_workspace_bound(int64_t n_tokens, int32_t n_head, int32_t kv_lora_rank, int32_t rope_dim) {
  check_dims(kv_lora_rank, rope_dim);
  if (n_head <= 0) throw Error("mla_attention: n_head must be positive");
  const int64_t n = std::max<int64_t>(n_tokens, 1);
  Plan plan;
  tile_shape(plan, n_head);
  plan.max_tiles = ceil_div(n, plan.tokens_per_tile) + n / 2;
  // A chosen split count s > 1 needs 2 x items < resident and s <= ceil(resident / items), items =
  // n_seqs x head chunks >= n_seqs: so s x n_seqs <= resident + n_seqs, and s <= kMaxSplits.
  const int64_t split_rows = std::min(kMaxSplits * n, resident_blocks(kv_lora_rank, rope_dim) + n);
  layout(plan, split_rows, n_head, kv_lora_rank);
  return plan.total;
}

void mla_attention(const MlaAttentionParams& p, cudaStream_t stream) {
  if (p.n_tokens <= 0 || p.n_seqs <= 0) return;
  const Plan plan = make_plan(p);
  if (p.workspace_bytes < plan.total || p.workspace == nullptr)
    throw Error("mla_attention: workspace of " + std::to_string(p.workspace_bytes) + " bytes, " +
                std::to_string(plan.total) + " needed (mla_attention_workspace_bytes)");
  if (reinterpret_cast<uintptr_t>(p.workspace) % 16 != 0) throw Error("mla_attention: workspace not 16-byte aligned");
  if (p.n_seqs > 0x7fffffff || plan.max_tiles > 0x7fffffff || plan.head_chunks > 65535 || plan.n_splits > 65535)
    throw Error("mla_attention: batch too large for the launch grid");

  auto* ws = static_cast<unsigned char*>(p.workspace);
  MlaKernelArgs a{};
  a.q = p.q;
  a.cache = p.cache;
  a.block_tables = p.block_tables;
  a.query_start = p.query_start;
  a.positions = p.positions;
  a.out = p.out;
  a.n_seqs = p.n_seqs;
  a.max_blocks_per_seq = p.max_blocks_per_seq;
  a.n_head = p.n_head;
  a.block_size = p.block_size;
  a.block_shift = (p.block_size & (p.block_size - 1)) == 0 ? __builtin_ctz(static_cast<unsigned>(p.block_size)) : -1;
  a.heads_per_tile = plan.heads_per_tile;
  a.tokens_per_tile = plan.tokens_per_tile;
  a.scale_log2 = p.scale * 1.4426950408889634f;
  a.tiles = reinterpret_cast<const int2*>(ws + plan.tiles_offset);
  a.n_tiles = reinterpret_cast<const int32_t*>(ws + plan.n_tiles_offset);
  a.n_splits = plan.n_splits;
  a.part_lse = plan.n_splits > 1 ? reinterpret_cast<float*>(ws + plan.lse_offset) : nullptr;
  a.part_out = plan.n_splits > 1 ? reinterpret_cast<float*>(ws + plan.out_offset) : nullptr;

  dispatch_dims(p.kv_lora_rank, p.rope_dim, [&]<int kDv, int kRope>() {
    const size_t smem = MlaDims<kDv, kRope>::smem_bytes();
    if (p.max_query_len <= 0 || p.max_query_len > 1) {
      auto* plan_kernel = &mla_plan_kernel;
      KESTREL_LAUNCH(plan_kernel, dim3(1), dim3(256), 0, stream, p.query_start, p.n_seqs, plan.tokens_per_tile,
                     const_cast<int2*>(a.tiles), const_cast<int32_t*>(a.n_tiles));
      KESTREL_CUDA_CHECK_LAUNCH();
      auto* prefill = &mla_attention_kernel<kDv, kRope, false>;
      set_max_dynamic_smem(prefill, smem);
      KESTREL_LAUNCH(prefill, dim3(static_cast<unsigned>(plan.max_tiles), static_cast<unsigned>(plan.head_chunks)),
                     dim3(kMlaThreads), smem, stream, a);
      KESTREL_CUDA_CHECK_LAUNCH();
    }
    auto* decode = &mla_attention_kernel<kDv, kRope, true>;
    set_max_dynamic_smem(decode, smem);
    KESTREL_LAUNCH(decode,
                   dim3(static_cast<unsigned>(p.n_seqs), static_cast<unsigned>(plan.head_chunks),
                        static_cast<unsigned>(plan.n_splits)),
                   dim3(kMlaThreads), smem, stream, a);
    KESTREL_CUDA_CHECK_LAUNCH();
    if (plan.n_splits > 1) {
      auto* reduce = &mla_reduce_kernel<kDv>;
      KESTREL_LAUNCH(reduce, dim3(static_cast<unsigned>(p.n_seqs), static_cast<unsigned>(p.n_head)),
                     dim3(kMlaThreads), 0, stream, a);
      KESTREL_CUDA_CHECK_LAUNCH();
    }
  });
}

}  // namespace kestrel::cuda
