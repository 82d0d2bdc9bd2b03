// Paged decode attention (sequences with one query token) on the tensor cores, balanced over the
// GPU by splitting the work at tile boundaries ("stream-K": Osama et al. 2023, applied to the keys
// of flash-decoding, Dao et al. 2023), for the head dims of paged_attention.cuh's kernels.
//
// Work: an item is one decode sequence's group of query heads (up to 16 rows, one mma tile,
// padding rows zero) for one KV head (chunk) over the whole context, ceil(context / 64) key tiles;
// items are laid end to end, sequence by sequence, KV head chunk by chunk, into T item tiles
// (attention_decode_plan_kernel counts them on the device: the contexts are device data, and a
// CUDA graph replays the launch for any contexts). The decode grid is the resident block count G
// (SMs x blocks per SM), and block b takes tiles [b T / G, (b + 1) T / G): every block gets the
// same number of tiles, give or take one, however the contexts differ, where one block per item
// (or per split) left most of the GPU idle at the end of a step with a few long items.
//
// A block walks its range as segments, one per item it touches. The 4 warps split each key tile
// (16 keys each) and merge their softmax states through shared memory at the end of a segment.
// The K/V tile pipeline (two cp.async stages) runs on across segments: the next segment's query
// rows and first tile load while the current one's last tile is computed. A segment that is its
// whole item writes the output; one that is a piece (the item started before the block's range, or
// runs past it) writes its normalised output and log2-sum-exp2 into the block's slot 2b (the
// piece at the start of the range) or 2b + 1 (the piece at its end), and
// attention_decode_reduce_kernel combines the pieces of each such item.
#pragma once

#include "backend/cuda/paged_attention.cuh"

namespace kestrel::cuda {

// Shared memory of the decode kernel: two Q tiles (this segment's and the next's), two K/V stages
// (a stage's K tile and V tile are contiguous, so a consumed stage holds the 4-warp merge's
// 4 x 16 x D f32 outputs), and the merge's row max and row sum per warp.
template <int D>
constexpr size_t attn_decode_smem_bytes() {
  return 2 * static_cast<size_t>(kDecodeRows) * kTileStride<D> * 2 +
         2 * 2 * static_cast<size_t>(kKeyTile) * kTileStride<D> * 2 + 2 * 4 * kDecodeRows * sizeof(float);
}
static_assert(2 * kKeyTile * 2 >= 4 * kDecodeRows * 4, "a K/V stage holds the warps' merge outputs");

constexpr int kDecodePlanThreads = 512;

// The decode work before each sequence (a.decode_prefix, [n_seqs + 1], in item tiles: a decode
// sequence at position p has ceil((p + 1) / 64) x n_kvc, a prefill sequence none) and the sequence
// holding each decode block's first tile (a.decode_first_seq). grid 1, kDecodePlanThreads threads.
__global__ void __launch_bounds__(kDecodePlanThreads) attention_decode_plan_kernel(AttnKernelArgs a) {
  KESTREL_PDL_ENTRY();
  __shared__ int32_t scan[kDecodePlanThreads];
  __shared__ int32_t base;
  const int tid = threadIdx.x;
  const int n_kvc = a.n_head_kv * a.head_chunks;
  if (tid == 0) base = 0;
  __syncthreads();
  for (int64_t s0 = 0; s0 < a.n_seqs; s0 += kDecodePlanThreads) {
    const int64_t s = s0 + tid;
    int32_t n = 0;
    if (s < a.n_seqs) {
      const int token = a.query_start[s];
      if (a.query_start[s + 1] - token == 1) n = (a.positions[token] + kKeyTile) / kKeyTile * n_kvc;
    }
    scan[tid] = n;
    __syncthreads();
    for (int off = 1; off < kDecodePlanThreads; off *= 2) {  // inclusive prefix sum
      const int32_t v = tid >= off ? scan[tid - off] : 0;
      __syncthreads();
      scan[tid] += v;
      __syncthreads();
    }
    if (s < a.n_seqs) a.decode_prefix[s] = base + scan[tid] - n;
    __syncthreads();
    if (tid == kDecodePlanThreads - 1) base += scan[tid];
    __syncthreads();
  }
  const int64_t total = base, blocks = a.decode_blocks;
  if (tid == 0) a.decode_prefix[a.n_seqs] = static_cast<int32_t>(total);
  if (total == 0) return;
  __syncthreads();  // this block's prefix writes are visible to its threads
  // Block b starts in sequence s when b T / G (rounded down) falls in [prefix[s], prefix[s + 1]),
  // i.e. for b in [ceil(prefix[s] G / T), ceil(prefix[s + 1] G / T)).
  for (int64_t s = tid; s < a.n_seqs; s += kDecodePlanThreads) {
    const int64_t b0 = (a.decode_prefix[s] * blocks + total - 1) / total;
    const int64_t b1 = (a.decode_prefix[s + 1] * blocks + total - 1) / total;
    for (int64_t b = b0; b < b1; ++b) a.decode_first_seq[b] = static_cast<int32_t>(s);
  }
}

// First item tile of decode block b's range, of G blocks over T tiles.
__device__ __forceinline__ int64_t decode_range_start(int64_t b, int64_t total, int64_t blocks) {
  return b * total / blocks;
}
// The decode block whose range holds item tile g.
__device__ __forceinline__ int64_t decode_block_of(int64_t g, int64_t total, int64_t blocks) {
  return ((g + 1) * blocks - 1) / total;
}

// One segment of a decode block's range: keys [key_begin, key_end) of one item.
struct DecodeSegment {
  int seq = 0, token = 0, pos = 0, kvh = 0, head0 = 0, n_rows = 0, key_begin = 0, key_end = 0;
  int slot = -1;     // -1: the whole item (writes the output); else the partial-result slot
  int64_t end = 0;   // item tile where the segment ends
};

// The segment starting at item tile g (in sequence seq) of block b's range [lo, hi).
__device__ __forceinline__ DecodeSegment decode_segment(const AttnKernelArgs& a, int64_t g, int seq, int64_t lo,
                                                        int64_t hi, int n_kvc) {
  DecodeSegment sg;
  const int64_t p0 = a.decode_prefix[seq], p1 = a.decode_prefix[seq + 1];
  const int64_t tiles = (p1 - p0) / n_kvc;
  const int kvc = static_cast<int>((g - p0) / tiles);
  const int64_t t0 = (g - p0) - kvc * tiles;
  const int64_t item_begin = p0 + kvc * tiles, item_end = item_begin + tiles;
  sg.end = min(item_end, hi);
  sg.seq = seq;
  sg.token = a.query_start[seq];
  sg.pos = a.positions[sg.token];
  sg.kvh = kvc / a.head_chunks;
  const int h0 = kvc % a.head_chunks * a.heads_per_tile;
  sg.n_rows = min(a.heads_per_tile, a.group - h0);
  sg.head0 = sg.kvh * a.group + h0;
  sg.key_begin = static_cast<int>(t0) * kKeyTile;
  sg.key_end = min(static_cast<int>(t0 + sg.end - g) * kKeyTile, sg.pos + 1);
  const int b = blockIdx.x;
  sg.slot = item_begin >= lo && item_end <= hi ? -1 : (g == lo ? 2 * b : 2 * b + 1);
  return sg;
}

// The sequence holding item tile g, from sequence seq on (skipping sequences without decode work).
__device__ __forceinline__ int decode_seq_of(const AttnKernelArgs& a, int64_t g, int seq) {
  while (a.decode_prefix[seq + 1] <= g) ++seq;
  return seq;
}

// The segment's query rows into a Q tile (cp.async, not waited for; padding rows zero-filled).
template <int D>
__device__ __forceinline__ void load_decode_q(__nv_bfloat16* sq, const AttnKernelArgs& a, const DecodeSegment& sg) {
  constexpr int kChunks = D / 8;
  for (int i = threadIdx.x; i < kDecodeRows * kChunks; i += kAttnThreads) {
    const int r = i / kChunks, c = i % kChunks;
    const bool valid = r < sg.n_rows;
    cp_async16(sq + swz<D>(r, c),
               a.q + (valid ? (static_cast<int64_t>(sg.token) * a.n_head + sg.head0 + r) * D + c * 8 : 0), valid);
  }
}

// Float pair `pair` (floats 2 pair, 2 pair + 1) of query row `row` in the merge scratch
// [kWarps][kDecodeRows][D] f32: pairs XOR-swizzled by row within aligned runs of kRun pairs (the
// largest power of two dividing D / 2, at most 32), so that a warp's 64-bit stores of 8 rows x 4
// pairs and its reads of consecutive outputs of one row hit distinct banks.
template <int D>
__device__ __forceinline__ int merge_index(int warp, int row, int pair) {
  constexpr int kHalf = D / 2, kRun = (kHalf & -kHalf) < 32 ? (kHalf & -kHalf) : 32;
  return ((warp * kDecodeRows + row) * kHalf + (pair ^ (((row & 7) << 2) & (kRun - 1)))) * 2;
}

// Merges the 4 warps' softmax states of the segment's valid rows (so: a consumed K/V stage; sml:
// [2][4][16]) and writes the output (a whole item) or the piece's partial result into its slot.
// Ends with the block synchronised.
template <int D>
__device__ __forceinline__ void finish_decode_item(const WarpSoftmax<D>& st, const AttnKernelArgs& a,
                                                   const DecodeSegment& it, float* so, float* sml) {
  constexpr int kRows = kDecodeRows, kWarps = kAttnThreads / kWarpSize;
  const int tid = threadIdx.x, warp = tid / kWarpSize, lane = tid % kWarpSize;
  float* sm = sml;                   // [kWarps][kRows]
  float* sl = sml + kWarps * kRows;  // [kWarps][kRows]
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = st.l[r];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const int row = lane / 4 + 8 * r;
    if (row >= it.n_rows) continue;  // padding rows (GQA groups under 16) are not merged
    if ((lane & 3) == 0) {
      sm[warp * kRows + row] = st.m[r];
      sl[warp * kRows + row] = l;
    }
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt)
      *reinterpret_cast<float2*>(so + merge_index<D>(warp, row, dt * 4 + (lane & 3))) =
          make_float2(st.o[dt][2 * r], st.o[dt][2 * r + 1]);
  }
  __syncthreads();
  for (int i = tid; i < it.n_rows * D; i += kAttnThreads) {
    const int row = i / D, d = i % D;
    float m = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) m = fmaxf(m, sm[w * kRows + row]);
    float l = 0.0f, o = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float mw = sm[w * kRows + row];
      const float e = mw == -INFINITY ? 0.0f : exp2f(mw - m);
      l += sl[w * kRows + row] * e;
      o += so[merge_index<D>(w, row, d / 2) + (d & 1)] * e;
    }
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    if (it.slot < 0) {
      a.out[(static_cast<int64_t>(it.token) * a.n_head + it.head0 + row) * D + d] = __float2bfloat16_rn(o * inv);
    } else {
      const int64_t part = static_cast<int64_t>(it.slot) * kRows + row;
      a.part_out[part * D + d] = o * inv;
      if (d == 0) a.part_lse[part] = l > 0.0f ? m + log2f(l) : -INFINITY;
    }
  }
  __syncthreads();  // the merge scratch is a K/V stage again
}

// grid (decode_blocks: at most the resident blocks), 128 threads, attn_decode_smem_bytes<D>(); at
// most 168 registers for D <= 128, so that three blocks fit on an SM. Runs after
// attention_decode_plan_kernel.
template <int D>
__global__ void __launch_bounds__(kAttnThreads, D <= 128 ? 3 : 1) attention_decode_kernel(AttnKernelArgs a) {
  KESTREL_PDL_ENTRY();
  constexpr int kRows = kDecodeRows, kWarps = kAttnThreads / kWarpSize, kStride = kTileStride<D>;
  constexpr int kStage = 2 * kKeyTile * kStride;  // elements of a K/V stage
  const int n_kvc = a.n_head_kv * a.head_chunks;
  const int64_t total = a.decode_prefix[a.n_seqs], blocks = gridDim.x;
  const int64_t lo = decode_range_start(blockIdx.x, total, blocks);
  const int64_t hi = decode_range_start(blockIdx.x + 1, total, blocks);
  if (lo >= hi) return;

  KESTREL_DYNAMIC_SMEM(smem);
  auto* sq = reinterpret_cast<__nv_bfloat16*>(smem);  // [2][kRows][kStride]
  auto* stages = sq + 2 * kRows * kStride;             // [2][K tile, V tile]
  auto* sml = reinterpret_cast<float*>(stages + 2 * kStage);
  const int warp = threadIdx.x / kWarpSize;

  DecodeSegment cur = decode_segment(a, lo, decode_seq_of(a, lo, a.decode_first_seq[blockIdx.x]), lo, hi, n_kvc);
  load_decode_q<D>(sq, a, cur);
  const int32_t* table = a.block_tables + static_cast<int64_t>(cur.seq) * a.max_blocks_per_seq;
  load_kv_tile<D>(stages, stages + kKeyTile * kStride, a, table, cur.kvh, cur.key_begin, cur.key_end);
  cp_async_commit();
  int qbuf = 0, stage = 0;
  while (true) {
    // The next segment is looked up once, after this segment's next tile has been requested (its
    // loads then wait behind the tile's instead of holding the request back).
    const bool has_next = cur.end < hi;
    DecodeSegment next;
    bool looked_up = false;
    const int n_tiles = (cur.key_end - cur.key_begin + kKeyTile - 1) / kKeyTile;
    QFragments<D> qf;
    WarpSoftmax<D> st;
    init_softmax(st);
    for (int j = 0; j < n_tiles; ++j) {
      // Refill the other stage: this segment's next tile, or the next one's query rows and first tile.
      __nv_bfloat16* other = stages + (stage ^ 1) * kStage;
      if (j + 1 < n_tiles) {
        load_kv_tile<D>(other, other + kKeyTile * kStride, a, table, cur.kvh, cur.key_begin + (j + 1) * kKeyTile,
                        cur.key_end);
      } else if (has_next) {
        if (!looked_up) next = decode_segment(a, cur.end, decode_seq_of(a, cur.end, cur.seq), lo, hi, n_kvc);
        looked_up = true;
        load_decode_q<D>(sq + (qbuf ^ 1) * kRows * kStride, a, next);
        const int32_t* next_table = a.block_tables + static_cast<int64_t>(next.seq) * a.max_blocks_per_seq;
        load_kv_tile<D>(other, other + kKeyTile * kStride, a, next_table, next.kvh, next.key_begin, next.key_end);
      }
      cp_async_commit();
      if (has_next && !looked_up) {
        next = decode_segment(a, cur.end, decode_seq_of(a, cur.end, cur.seq), lo, hi, n_kvc);
        looked_up = true;
      }
      cp_async_wait<1>();
      __syncthreads();
      if (j == 0) qf.load(sq + qbuf * kRows * kStride, 0);
      const __nv_bfloat16* sk = stages + stage * kStage;
      const int key0 = cur.key_begin + j * kKeyTile;
      attend_tile<D, kKeyTile / kWarps>(st, qf, sk, sk + kKeyTile * kStride, warp * (kKeyTile / kWarps), key0,
                                        key0 + kKeyTile - 1 > cur.pos, cur.pos, cur.pos, a.scale_log2);
      __syncthreads();  // this stage is refilled (or merged into) next
      stage ^= 1;
    }
    finish_decode_item<D>(st, a, cur, reinterpret_cast<float*>(stages + (stage ^ 1) * kStage), sml);
    if (!has_next) {
      cp_async_wait<0>();  // the last (empty) group
      break;
    }
    cur = next;
    table = a.block_tables + static_cast<int64_t>(cur.seq) * a.max_blocks_per_seq;
    qbuf ^= 1;
  }
}

// Combines the pieces of the items that decode blocks split: out = sum_i w_i O_i / sum_i w_i with
// w_i = 2^(lse_i - max lse) over the pieces' slots. grid (n_seqs, n_head_kv * head_chunks): one
// item each; 128 threads. Items that one block did whole were written by it: nothing to do.
template <int D>
__global__ void __launch_bounds__(kAttnThreads) attention_decode_reduce_kernel(AttnKernelArgs a) {
  KESTREL_PDL_ENTRY();
  constexpr int kRows = kDecodeRows;
  const int seq = blockIdx.x, kvc = blockIdx.y;
  const int n_kvc = a.n_head_kv * a.head_chunks;
  const int64_t p0 = a.decode_prefix[seq], p1 = a.decode_prefix[seq + 1];
  if (p0 == p1) return;  // a prefill sequence
  const int64_t total = a.decode_prefix[a.n_seqs], blocks = a.decode_blocks;
  const int64_t tiles = (p1 - p0) / n_kvc;
  const int64_t item_begin = p0 + kvc * tiles, item_end = item_begin + tiles;
  const int64_t b0 = decode_block_of(item_begin, total, blocks), b1 = decode_block_of(item_end - 1, total, blocks);
  if (b0 == b1) return;
  // The first piece sits in slot 2 b0 when the item starts block b0's range, else in 2 b0 + 1; the
  // others start their blocks' ranges: slot 2 b. Blocks with empty ranges (fewer tiles than
  // blocks) in between wrote nothing: slot -1.
  const int64_t first_slot = item_begin == decode_range_start(b0, total, blocks) ? 2 * b0 : 2 * b0 + 1;
  const auto slot_of = [&](int64_t b) -> int64_t {
    if (b == b0) return first_slot;
    return decode_range_start(b, total, blocks) == decode_range_start(b + 1, total, blocks) ? -1 : 2 * b;
  };
  const int kvh = kvc / a.head_chunks, h0 = kvc % a.head_chunks * a.heads_per_tile;
  const int n_rows = min(a.heads_per_tile, a.group - h0);
  const int token = a.query_start[seq];
  for (int i = threadIdx.x; i < n_rows * D; i += kAttnThreads) {
    const int row = i / D, d = i % D;
    float m = -INFINITY;
    for (int64_t b = b0; b <= b1; ++b) {
      const int64_t slot = slot_of(b);
      if (slot >= 0) m = fmaxf(m, a.part_lse[slot * kRows + row]);
    }
    float num = 0.0f, den = 0.0f;
    for (int64_t b = b0; b <= b1; ++b) {
      const int64_t slot = slot_of(b);
      if (slot < 0) continue;
      const int64_t part = slot * kRows + row;
      const float lse = a.part_lse[part];
      const float w = lse == -INFINITY ? 0.0f : exp2f(lse - m);
      num += w * a.part_out[part * D + d];
      den += w;
    }
    a.out[(static_cast<int64_t>(token) * a.n_head + kvh * a.group + h0 + row) * D + d] =
        __float2bfloat16_rn(den > 0.0f ? num / den : 0.0f);
  }
}

// Combines the SIMT decode kernel's split-KV partial results of each decode sequence:
// out = sum_s w_s O_s / sum_s w_s with w_s = 2^(lse_s - max lse), over the splits that
// split_key_range gives keys. grid (n_seqs, n_head), 128 threads; head dim a.head_dim.
__global__ void __launch_bounds__(kAttnThreads) attention_split_reduce_kernel(AttnKernelArgs a) {
  KESTREL_PDL_ENTRY();
  const int dim = a.head_dim;
  const int seq = blockIdx.x, head = blockIdx.y;
  const int token = a.query_start[seq];
  if (a.query_start[seq + 1] - token != 1) return;
  const int n_keys = a.positions[token] + 1;
  const int64_t stride = a.n_seqs * a.n_head;  // between splits
  const int64_t first = static_cast<int64_t>(seq) * a.n_head + head;
  float m = -INFINITY;
  for (int s = 0; s < a.n_splits; ++s) {
    const int2 keys = split_key_range(n_keys, s, a.n_splits);
    if (keys.x < keys.y) m = fmaxf(m, a.part_lse[first + s * stride]);
  }
  for (int d = threadIdx.x; d < dim; d += kAttnThreads) {
    float num = 0.0f, den = 0.0f;
    for (int s = 0; s < a.n_splits; ++s) {
      const int2 keys = split_key_range(n_keys, s, a.n_splits);
      if (keys.x >= keys.y) continue;
      const float lse = a.part_lse[first + s * stride];
      const float w = lse == -INFINITY ? 0.0f : exp2f(lse - m);
      num += w * a.part_out[(first + s * stride) * dim + d];
      den += w;
    }
    a.out[(static_cast<int64_t>(token) * a.n_head + head) * dim + d] = __float2bfloat16_rn(den > 0.0f ? num / den : 0.0f);
  }
}

}  // namespace kestrel::cuda
