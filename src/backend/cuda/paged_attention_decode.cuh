// Paged decode attention (sequences with one query token) on the tensor cores, and the split-KV
// reduction (flash-decoding, Dao et al. 2023), for the head dims of paged_attention.cuh's kernels.
//
// Work items: (sequence, KV head and head chunk, split). An item takes the token's group of query
// heads (up to 16 rows, one mma tile, padding rows zero) for one KV head and one split of the
// context (split_key_range: whole 64-key tiles shared out evenly), and the 4 warps split each key
// tile (16 keys each); their softmax states are merged through shared memory at the end.
//
// The kernel is persistent: a grid of at most (SMs x resident blocks per SM) blocks, block b taking
// items b, b + gridDim.x, ... in turn. The K/V tile pipeline (two cp.async stages) runs on across
// items: while a block computes an item's last tile, its next item's query rows and first tile are
// already loading, so the latency of an item's start (query_start -> position -> block table ->
// first tile, ~9 us on an H200 when each item was a block of its own) is paid once per block
// instead of once per item. Items with nothing to do (a prefill sequence, an empty split) are
// skipped. With n_splits > 1 each item writes its normalised output and log2-sum-exp2 for
// attention_reduce_kernel; else it writes the output.
#pragma once

#include "backend/cuda/paged_attention.cuh"

namespace kestrel::cuda {

// Shared memory of the decode kernel: two Q tiles (this item's and the next's), two K/V stages
// (a stage's K tile and V tile are contiguous, so a consumed stage holds the 4-warp merge's
// 4 x 16 x D f32 outputs), and the merge's row max and row sum per warp.
template <int D>
constexpr size_t attn_decode_smem_bytes() {
  return 2 * static_cast<size_t>(kDecodeRows) * kTileStride<D> * 2 +
         2 * 2 * static_cast<size_t>(kKeyTile) * kTileStride<D> * 2 + 2 * 4 * kDecodeRows * sizeof(float);
}
static_assert(2 * kKeyTile * 2 >= 4 * kDecodeRows * 4, "a K/V stage holds the warps' merge outputs");

// One decode work item; token < 0: nothing to do.
struct DecodeItem {
  int token = -1;
  int seq = 0, split = 0, kvh = 0, head0 = 0, n_rows = 0, key_begin = 0, key_end = 0, pos = 0;
};

// Item `item` (KV-head chunk fastest, then sequence, then split) of n_seqs x n_kvc x n_splits.
__device__ __forceinline__ DecodeItem decode_item(const AttnKernelArgs& a, int64_t item, int n_kvc) {
  DecodeItem it;
  const int kvc = static_cast<int>(item % n_kvc);
  const int64_t rest = item / n_kvc;
  const int seq = static_cast<int>(rest % a.n_seqs);
  const int split = static_cast<int>(rest / a.n_seqs);
  const int token = a.query_start[seq];
  if (a.query_start[seq + 1] - token != 1) return it;  // a prefill sequence: the prefill kernel's
  const int pos = a.positions[token];
  const int2 keys = split_key_range(pos + 1, split, a.n_splits);
  if (keys.x >= keys.y) return it;
  it.token = token;
  it.seq = seq;
  it.split = split;
  it.kvh = kvc / a.head_chunks;
  const int h0 = kvc % a.head_chunks * a.heads_per_tile;
  it.n_rows = min(a.heads_per_tile, a.group - h0);
  it.head0 = it.kvh * a.group + h0;
  it.key_begin = keys.x;
  it.key_end = keys.y;
  it.pos = pos;
  return it;
}

// The first item from `item` on (stepping by the grid) with work; n_items when there is none.
__device__ __forceinline__ int64_t next_decode_item(const AttnKernelArgs& a, int64_t item, int64_t n_items, int n_kvc,
                                                    DecodeItem& it) {
  for (; item < n_items; item += gridDim.x) {
    it = decode_item(a, item, n_kvc);
    if (it.token >= 0) return item;
  }
  return n_items;
}

// The item's query rows into a Q tile (cp.async, not waited for; padding rows zero-filled).
template <int D>
__device__ __forceinline__ void load_decode_q(__nv_bfloat16* sq, const AttnKernelArgs& a, const DecodeItem& it) {
  constexpr int kChunks = D / 8;
  for (int i = threadIdx.x; i < kDecodeRows * kChunks; i += kAttnThreads) {
    const int r = i / kChunks, c = i % kChunks;
    const bool valid = r < it.n_rows;
    cp_async16(sq + swz<D>(r, c),
               a.q + (valid ? (static_cast<int64_t>(it.token) * a.n_head + it.head0 + r) * D + c * 8 : 0), valid);
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

// Merges the 4 warps' softmax states of the item's valid rows (so: a consumed K/V stage; sml:
// [2][4][16]) and writes the output or the split's partial result. Ends with the block
// synchronised.
template <int D>
__device__ __forceinline__ void finish_decode_item(const WarpSoftmax<D>& st, const AttnKernelArgs& a,
                                                   const DecodeItem& it, float* so, float* sml) {
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
    const int head = it.head0 + row;
    if (a.n_splits == 1) {
      a.out[(static_cast<int64_t>(it.token) * a.n_head + head) * D + d] = __float2bfloat16_rn(o * inv);
    } else {
      const int64_t part = (static_cast<int64_t>(it.split) * a.n_seqs + it.seq) * a.n_head + head;
      a.part_out[part * D + d] = o * inv;
      if (d == 0) a.part_lse[part] = l > 0.0f ? m + log2f(l) : -INFINITY;
    }
  }
  __syncthreads();  // the merge scratch is a K/V stage again
}

// grid (min(items, resident blocks)), 128 threads, attn_decode_smem_bytes<D>(); at most 168
// registers for D <= 128, so that three blocks fit on an SM.
template <int D>
__global__ void __launch_bounds__(kAttnThreads, D <= 128 ? 3 : 1) attention_decode_kernel(AttnKernelArgs a) {
  KESTREL_PDL_ENTRY();
  constexpr int kRows = kDecodeRows, kWarps = kAttnThreads / kWarpSize, kStride = kTileStride<D>;
  constexpr int kStage = 2 * kKeyTile * kStride;  // elements of a K/V stage
  const int n_kvc = a.n_head_kv * a.head_chunks;
  const int64_t n_items = a.n_seqs * n_kvc * a.n_splits;
  DecodeItem cur;
  int64_t item = next_decode_item(a, blockIdx.x, n_items, n_kvc, cur);
  if (item >= n_items) return;

  KESTREL_DYNAMIC_SMEM(smem);
  auto* sq = reinterpret_cast<__nv_bfloat16*>(smem);  // [2][kRows][kStride]
  auto* stages = sq + 2 * kRows * kStride;             // [2][K tile, V tile]
  auto* sml = reinterpret_cast<float*>(stages + 2 * kStage);
  const int warp = threadIdx.x / kWarpSize;

  load_decode_q<D>(sq, a, cur);
  const int32_t* table = a.block_tables + static_cast<int64_t>(cur.seq) * a.max_blocks_per_seq;
  load_kv_tile<D>(stages, stages + kKeyTile * kStride, a, table, cur.kvh, cur.key_begin, cur.key_end);
  cp_async_commit();
  int qbuf = 0, stage = 0;
  while (true) {
    // The next item is looked up once per item, after this item's next tile has been requested
    // (its loads then wait behind the tile's instead of holding the request back).
    DecodeItem next;
    int64_t next_index = -1;
    const int n_tiles = (cur.key_end - cur.key_begin + kKeyTile - 1) / kKeyTile;
    QFragments<D> qf;
    WarpSoftmax<D> st;
    init_softmax(st);
    for (int j = 0; j < n_tiles; ++j) {
      // Refill the other stage: this item's next tile, or the next item's query rows and first tile.
      __nv_bfloat16* other = stages + (stage ^ 1) * kStage;
      if (j + 1 < n_tiles) {
        load_kv_tile<D>(other, other + kKeyTile * kStride, a, table, cur.kvh, cur.key_begin + (j + 1) * kKeyTile,
                        cur.key_end);
      } else {
        if (next_index < 0) next_index = next_decode_item(a, item + gridDim.x, n_items, n_kvc, next);
        if (next_index < n_items) {
          load_decode_q<D>(sq + (qbuf ^ 1) * kRows * kStride, a, next);
          const int32_t* next_table = a.block_tables + static_cast<int64_t>(next.seq) * a.max_blocks_per_seq;
          load_kv_tile<D>(other, other + kKeyTile * kStride, a, next_table, next.kvh, next.key_begin, next.key_end);
        }
      }
      cp_async_commit();
      if (next_index < 0) next_index = next_decode_item(a, item + gridDim.x, n_items, n_kvc, next);
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
    if (next_index >= n_items) {
      cp_async_wait<0>();  // the last (empty) group
      break;
    }
    cur = next;
    item = next_index;
    table = a.block_tables + static_cast<int64_t>(cur.seq) * a.max_blocks_per_seq;
    qbuf ^= 1;
  }
}

// Combines the split-KV partial results of each decode sequence: out = sum_s w_s O_s / sum_s w_s
// with w_s = 2^(lse_s - max lse), over the splits that split_key_range gives keys. grid (n_seqs,
// n_head), 128 threads. D = 0: a.head_dim (the SIMT kernel's head dims).
template <int D>
__global__ void __launch_bounds__(kAttnThreads) attention_reduce_kernel(AttnKernelArgs a) {
  KESTREL_PDL_ENTRY();
  const int dim = D > 0 ? D : a.head_dim;
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
