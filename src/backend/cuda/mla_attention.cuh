// Paged multi-head latent attention kernels (mla_ops.h, mla_attention): every query row attends
// over rows [c_KV | k_R] of width kDk = r + R shared by all heads, the value being the first r
// (kDv) elements of the same row; FlashAttention-2-style online softmax in f32 (exp2, scores
// pre-multiplied by scale * log2 e), bf16 on the tensor cores (mma.sync m16n8k16).
//
// One block = 4 warps = 128 threads and 16 query rows: for a decode sequence 16 heads of its
// token (the latent rows are read once per 16 heads: FlashMLA's "heads along M"), for a prefill
// chunk 16 / heads_per_tile tokens x heads_per_tile heads. Keys go through shared memory in tiles
// of 32 latent rows (cp.async, two stages), gathered through the block table. Per tile:
//   1. scores: warp w computes the 16 x 32 partial scores over its quarter of the kDk dims (its Q
//      fragments stay in registers for the whole block), into shared memory;
//   2. softmax: warp w takes rows 4w .. 4w+3, lane j key j: the four partial sums, the causal mask,
//      the running max and sum, and the weights rounded to bf16 into a P tile;
//   3. P V: warp w accumulates its quarter of the kDv output dims over the 32 keys (V read from
//      the same latent tile with ldmatrix .trans), after scaling them by the row's correction.
// So the K tile is read from shared memory once for the scores and once (its first kDv dims) for
// P V, and no warp holds more than a quarter of the 16 x kDv outputs (kDv 512: 64 f32 registers).
// Rows of padded width kDkp (kDk rounded up to 16, zeros past kDk) with 16-byte chunks
// XOR-swizzled by row % 8 when kDkp is a multiple of 64, else padded by one chunk (an odd count).
//
// Decode: grid (n_seqs, head chunks, n_splits); a split takes whole 32-key tiles of the context
// (mla_split_range); with n_splits > 1 each block writes its normalised output and log2-sum-exp2
// per row and mla_reduce_kernel combines them. Prefill: grid (tile list bound, head chunks), the
// tile list (sequence, first token) built by mla_plan_kernel; keys from 0 to the largest position
// of the block's rows, masked per row (key > position: -inf).
#pragma once

#include <climits>

#include "backend/cuda/device_common.cuh"
#include "backend/cuda/mla_ops.h"

namespace kestrel::cuda {

constexpr int kMlaThreads = 128;
constexpr int kMlaWarps = kMlaThreads / kWarpSize;
constexpr int kMlaRows = 16;  // query rows per block
constexpr int kMlaKeys = 32;  // latent rows per shared-memory tile
constexpr int kMlaScoreStride = kMlaKeys + 8;  // f32 partial-score rows, padded against bank conflicts
constexpr int kMlaPStride = kMlaKeys + 8;      // bf16 weight rows (80 bytes: 8 rows, 8 bank groups)

template <int kDv, int kRope>
struct MlaDims {
  static constexpr int kDk = kDv + kRope;
  static constexpr int kDkp = (kDk + 15) / 16 * 16;
  static constexpr int kChunks = kDkp / 8;      // 16-byte chunks per padded row
  static constexpr int kDataChunks = kDk / 8;   // chunks holding data (the rest are zeros)
  static constexpr bool kSwizzle = kDkp % 64 == 0;
  static constexpr int kStride = kSwizzle ? kDkp : kDkp + 8;
  static constexpr int kKSteps = kDkp / 16;
  static constexpr int kKStepsPerWarp = (kKSteps + kMlaWarps - 1) / kMlaWarps;
  static constexpr int kVTilesPerWarp = kDv / 8 / kMlaWarps;  // 8-dim output tiles of each warp
  static_assert(kDk % 8 == 0 && kDv % 32 == 0, "whole 16-byte chunks; whole output tiles per warp");

  static __device__ __forceinline__ int swz(int row, int chunk) {
    if constexpr (kSwizzle) {
      return row * kDkp + ((chunk ^ (row & 7)) << 3);
    } else {
      return row * kStride + (chunk << 3);
    }
  }
  // Dynamic shared memory: Q tile, two latent tiles, partial scores, weights, row state.
  static constexpr size_t smem_bytes() {
    return static_cast<size_t>(kMlaRows + 2 * kMlaKeys) * kStride * 2 +
           static_cast<size_t>(kMlaWarps) * kMlaRows * kMlaScoreStride * 4 + kMlaRows * kMlaPStride * 2 +
           kMlaRows * (4 * 4 + 8);
  }
};

struct MlaKernelArgs {
  const __nv_bfloat16* q;      // [n_tokens, n_head, kDk]
  const __nv_bfloat16* cache;  // [n_blocks, block_size, kDk]
  const int32_t* block_tables;
  const int32_t* query_start;
  const int32_t* positions;
  __nv_bfloat16* out;          // [n_tokens, n_head, kDv]
  int64_t n_seqs;
  int32_t max_blocks_per_seq, n_head, block_size;
  int32_t block_shift;         // log2(block_size) when a power of two, else -1
  int32_t heads_per_tile;      // min(n_head, kMlaRows)
  int32_t tokens_per_tile;     // prefill: kMlaRows / heads_per_tile
  float scale_log2;
  const int2* tiles;           // prefill tile list (sequence, first token)
  const int32_t* n_tiles;
  int32_t n_splits;
  float* part_out;             // [n_splits, n_seqs, n_head, kDv]
  float* part_lse;             // [n_splits, n_seqs, n_head]
};

__device__ __forceinline__ float mla_warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Keys [x, y) of split `split` of n_splits for a context of n_keys: whole kMlaKeys tiles shared
// out evenly, the last range ending at n_keys; empty when there are fewer tiles than splits.
__device__ __forceinline__ int2 mla_split_range(int n_keys, int split, int n_splits) {
  const int64_t tiles = (n_keys + kMlaKeys - 1) / kMlaKeys;
  const int begin = static_cast<int>(tiles * split / n_splits) * kMlaKeys;
  const int end = min(static_cast<int>(tiles * (split + 1) / n_splits) * kMlaKeys, n_keys);
  return make_int2(begin, end);
}

// Gathers latent rows [key0, key0 + kMlaKeys) through the block table (cp.async, not waited for);
// rows at or past key_end, and the padding chunks, are zero-filled.
template <int kDv, int kRope>
__device__ __forceinline__ void mla_load_tile(__nv_bfloat16* sk, const MlaKernelArgs& a, const int32_t* table,
                                              int key0, int key_end) {
  using D = MlaDims<kDv, kRope>;
  for (int i = threadIdx.x; i < kMlaKeys * D::kChunks; i += kMlaThreads) {
    const int row = i / D::kChunks, c = i % D::kChunks;
    const int key = key0 + row;
    const bool valid = key < key_end && c < D::kDataChunks;
    const __nv_bfloat16* src = a.cache;
    if (valid) {
      int b, off;
      if (a.block_shift >= 0) {
        b = key >> a.block_shift;
        off = key & (a.block_size - 1);
      } else {
        b = key / a.block_size;
        off = key - b * a.block_size;
      }
      src = a.cache + (static_cast<int64_t>(table[b]) * a.block_size + off) * D::kDk + c * 8;
    }
    cp_async16(sk + D::swz(row, c), src, valid);
  }
}

// Builds the prefill tile list: for each sequence with 2+ query tokens, ceil(len / tokens_per_tile)
// entries (sequence, first token). One block of 256 threads; n_tiles receives the count.
__global__ void mla_plan_kernel(const int32_t* __restrict__ query_start, int64_t n_seqs, int32_t tokens_per_tile,
                                int2* __restrict__ tiles, int32_t* __restrict__ n_tiles) {
  KESTREL_PDL_ENTRY();
  constexpr int kThreads = 256;
  __shared__ int32_t scan[kThreads];
  __shared__ int32_t base;
  const int tid = threadIdx.x;
  if (tid == 0) base = 0;
  __syncthreads();
  for (int64_t s0 = 0; s0 < n_seqs; s0 += kThreads) {
    const int64_t s = s0 + tid;
    int32_t n = 0, qs = 0;
    if (s < n_seqs) {
      qs = query_start[s];
      const int32_t len = query_start[s + 1] - qs;
      n = len > 1 ? (len + tokens_per_tile - 1) / tokens_per_tile : 0;
    }
    scan[tid] = n;
    __syncthreads();
    for (int off = 1; off < kThreads; off *= 2) {  // inclusive prefix sum
      const int32_t v = tid >= off ? scan[tid - off] : 0;
      __syncthreads();
      scan[tid] += v;
      __syncthreads();
    }
    const int32_t first = base + scan[tid] - n;
    for (int32_t j = 0; j < n; ++j) tiles[first + j] = make_int2(static_cast<int>(s), qs + j * tokens_per_tile);
    __syncthreads();
    if (tid == kThreads - 1) base += scan[tid];
    __syncthreads();
  }
  if (tid == 0) *n_tiles = base;
}

// Decode: grid (n_seqs, head chunks, n_splits); prefill: grid (tile list bound, head chunks).
// kMlaThreads threads, MlaDims<kDv, kRope>::smem_bytes() of dynamic shared memory.
template <int kDv, int kRope, bool kDecode>
__global__ void __launch_bounds__(kMlaThreads) mla_attention_kernel(MlaKernelArgs a) {
  using D = MlaDims<kDv, kRope>;
  KESTREL_PDL_ENTRY();
  const int tid = threadIdx.x, warp = tid / kWarpSize, lane = tid % kWarpSize;
  const int h0 = static_cast<int>(blockIdx.y) * a.heads_per_tile;

  // The block's rows and keys [key_begin, key_end).
  int seq, token0, key_begin = 0, split = 0, split_end = INT_MAX;
  if constexpr (kDecode) {
    seq = blockIdx.x;
    token0 = a.query_start[seq];
    if (a.query_start[seq + 1] - token0 != 1) return;  // a prefill sequence: the other launch's
    split = blockIdx.z;
    const int2 keys = mla_split_range(a.positions[token0] + 1, split, a.n_splits);
    if (keys.x >= keys.y) return;  // fewer key tiles than splits
    key_begin = keys.x;
    split_end = keys.y;
  } else {
    const int n_tiles = *a.n_tiles;
    if (static_cast<int>(blockIdx.x) >= n_tiles) return;
    const int2 tile = a.tiles[n_tiles - 1 - static_cast<int>(blockIdx.x)];  // last (longest) tiles first
    seq = tile.x;
    token0 = tile.y;
  }
  const int q_end = a.query_start[seq + 1];
  const int32_t* table = a.block_tables + static_cast<int64_t>(seq) * a.max_blocks_per_seq;

  KESTREL_DYNAMIC_SMEM(smem);
  auto* sq = reinterpret_cast<__nv_bfloat16*>(smem);                  // [kMlaRows][kStride]
  auto* sk = sq + kMlaRows * D::kStride;                               // [2][kMlaKeys][kStride]
  auto* ss = reinterpret_cast<float*>(sk + 2 * kMlaKeys * D::kStride); // [warps][kMlaRows][kMlaScoreStride]
  auto* sp = reinterpret_cast<__nv_bfloat16*>(ss + kMlaWarps * kMlaRows * kMlaScoreStride);  // [rows][kMlaPStride]
  auto* row_m = reinterpret_cast<float*>(sp + kMlaRows * kMlaPStride);  // running max (log2 units)
  auto* row_l = row_m + kMlaRows;                                       // running sum
  auto* row_c = row_l + kMlaRows;                                       // this tile's correction
  auto* row_pos = reinterpret_cast<int32_t*>(row_c + kMlaRows);         // position, -1: no row
  auto* row_idx = reinterpret_cast<int64_t*>(row_pos + kMlaRows);       // token * n_head + head, or -1

  if (tid < kMlaRows) {
    const int r = tid;
    const int tl = kDecode ? 0 : r / a.heads_per_tile;
    const int head = h0 + (kDecode ? r : r % a.heads_per_tile);
    const int token = token0 + tl;
    const bool valid =
        (kDecode ? r < a.heads_per_tile : tl < a.tokens_per_tile) && token < q_end && head < a.n_head;
    row_idx[r] = valid ? static_cast<int64_t>(token) * a.n_head + head : -1;
    row_pos[r] = valid ? a.positions[token] : -1;
    row_m[r] = -INFINITY;
    row_l[r] = 0.0f;
  }
  __syncthreads();
  int max_pos = -1;
  for (int r = 0; r < kMlaRows; ++r) max_pos = max(max_pos, row_pos[r]);
  const int key_end = min(max_pos + 1, split_end);
  for (int i = tid; i < kMlaRows * D::kChunks; i += kMlaThreads) {
    const int r = i / D::kChunks, c = i % D::kChunks;
    const int64_t idx = row_idx[r];
    const bool valid = idx >= 0 && c < D::kDataChunks;
    cp_async16(sq + D::swz(r, c), valid ? a.q + idx * D::kDk + c * 8 : a.q, valid);
  }
  const int n_tiles = key_end > key_begin ? (key_end - key_begin + kMlaKeys - 1) / kMlaKeys : 0;
  if (n_tiles > 0) mla_load_tile<kDv, kRope>(sk, a, table, key_begin, key_end);
  cp_async_commit();

  uint32_t qf[D::kKStepsPerWarp][4];
  float o[D::kVTilesPerWarp][4];
#pragma unroll
  for (int vt = 0; vt < D::kVTilesPerWarp; ++vt) o[vt][0] = o[vt][1] = o[vt][2] = o[vt][3] = 0.0f;
  const int g = lane / 4, c2 = (lane % 4) * 2;
  for (int j = 0; j < n_tiles; ++j) {
    const int buf = j & 1;
    if (j + 1 < n_tiles) {
      mla_load_tile<kDv, kRope>(sk + (buf ^ 1) * kMlaKeys * D::kStride, a, table, key_begin + (j + 1) * kMlaKeys,
                                key_end);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    if (j == 0) {
      const int row = (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
      for (int i = 0; i < D::kKStepsPerWarp; ++i) {
        const int kk = warp * D::kKStepsPerWarp + i;
        if (kk < D::kKSteps) ldmatrix_x4(qf[i], sq + D::swz(row, kk * 2 + (lane >> 4)));
      }
    }
    const __nv_bfloat16* kt = sk + buf * kMlaKeys * D::kStride;
    const int key0 = key_begin + j * kMlaKeys;

    // 1. Partial scores of the warp's dims: 16 rows x 32 keys (4 key groups of 8).
    float s[kMlaKeys / 8][4];
#pragma unroll
    for (int nt = 0; nt < kMlaKeys / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
    for (int i = 0; i < D::kKStepsPerWarp; ++i) {
      const int kk = warp * D::kKStepsPerWarp + i;
      if (kk >= D::kKSteps) break;
#pragma unroll
      for (int nt = 0; nt < kMlaKeys / 8; nt += 2) {
        uint32_t b[4];
        ldmatrix_x4(b, kt + D::swz((nt + (lane >> 4)) * 8 + (lane & 7), kk * 2 + ((lane >> 3) & 1)));
        const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
        mma_bf16_16816(s[nt], qf[i], b0);
        mma_bf16_16816(s[nt + 1], qf[i], b1);
      }
    }
    float* sw = ss + warp * kMlaRows * kMlaScoreStride;
#pragma unroll
    for (int nt = 0; nt < kMlaKeys / 8; ++nt) {
      *reinterpret_cast<float2*>(sw + g * kMlaScoreStride + nt * 8 + c2) = make_float2(s[nt][0], s[nt][1]);
      *reinterpret_cast<float2*>(sw + (g + 8) * kMlaScoreStride + nt * 8 + c2) = make_float2(s[nt][2], s[nt][3]);
    }
    __syncthreads();

    // 2. Softmax: warp w, rows 4w .. 4w + 3; lane = key.
#pragma unroll
    for (int rr = 0; rr < kMlaRows / kMlaWarps; ++rr) {
      const int row = warp * (kMlaRows / kMlaWarps) + rr;
      float v = 0.0f;
#pragma unroll
      for (int w = 0; w < kMlaWarps; ++w) v += ss[(w * kMlaRows + row) * kMlaScoreStride + lane];
      const int key = key0 + lane;
      v = key < key_end && key <= row_pos[row] ? v * a.scale_log2 : -INFINITY;
      const float mx = mla_warp_max(v);
      const float m_old = row_m[row];
      const float m_new = fmaxf(m_old, mx);
      const float base = m_new == -INFINITY ? 0.0f : m_new;  // a row with no key yet: everything stays 0
      const __nv_bfloat16 p = __float2bfloat16_rn(exp2f(v - base));
      sp[row * kMlaPStride + lane] = p;
      // The sum adds the bf16-rounded weights that the mma multiplies V by.
      const float psum = warp_reduce_sum(__bfloat162float(p));
      __syncwarp();
      if (lane == 0) {
        const float corr = exp2f(m_old - base);
        row_m[row] = m_new;
        row_l[row] = row_l[row] * corr + psum;
        row_c[row] = corr;
      }
    }
    __syncthreads();

    // 3. O = O * corr + P V over the warp's output dims.
    const float corr0 = row_c[g], corr1 = row_c[g + 8];
#pragma unroll
    for (int vt = 0; vt < D::kVTilesPerWarp; ++vt) {
      o[vt][0] *= corr0;
      o[vt][1] *= corr0;
      o[vt][2] *= corr1;
      o[vt][3] *= corr1;
    }
    uint32_t pa[kMlaKeys / 16][4];
#pragma unroll
    for (int ks = 0; ks < kMlaKeys / 16; ++ks)
      ldmatrix_x4(pa[ks], sp + ((lane & 7) + ((lane >> 3) & 1) * 8) * kMlaPStride + (ks * 2 + (lane >> 4)) * 8);
#pragma unroll
    for (int vt = 0; vt < D::kVTilesPerWarp; ++vt) {
      const int dt = warp * D::kVTilesPerWarp + vt;  // 8-dim chunk of the value
      uint32_t b[4];
      ldmatrix_x4_trans(b, kt + D::swz((lane & 7) + (lane >> 3) * 8, dt));
      const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
      mma_bf16_16816(o[vt], pa[0], b0);
      mma_bf16_16816(o[vt], pa[1], b1);
    }
    __syncthreads();  // the stage, the scores and the weights are rewritten next
  }
  cp_async_wait<0>();  // nothing left in flight when there were no tiles

  // Normalise and write: the output, or the split's share for mla_reduce_kernel.
  const bool partial = kDecode && a.n_splits > 1;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = g + 8 * r;
    const int64_t idx = row_idx[row];
    if (idx < 0) continue;
    const float l = row_l[row];
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    if (!partial) {
      __nv_bfloat16* y = a.out + idx * kDv;
#pragma unroll
      for (int vt = 0; vt < D::kVTilesPerWarp; ++vt) {
        const int d = (warp * D::kVTilesPerWarp + vt) * 8 + c2;
        *reinterpret_cast<uint32_t*>(y + d) = pack_bf16x2(o[vt][2 * r] * inv, o[vt][2 * r + 1] * inv);
      }
    } else {
      const int64_t part = (static_cast<int64_t>(split) * a.n_seqs + seq) * a.n_head + (h0 + row);
      float* y = a.part_out + part * kDv;
#pragma unroll
      for (int vt = 0; vt < D::kVTilesPerWarp; ++vt) {
        const int d = (warp * D::kVTilesPerWarp + vt) * 8 + c2;
        *reinterpret_cast<float2*>(y + d) = make_float2(o[vt][2 * r] * inv, o[vt][2 * r + 1] * inv);
      }
      if (warp == 0 && (lane & 3) == 0) a.part_lse[part] = l > 0.0f ? row_m[row] + log2f(l) : -INFINITY;
    }
  }
}

// Combines the split-KV partial results of each decode sequence: out = sum_s (w_s / sum_t w_t) O_s
// with w_s = 2^(lse_s - max lse), over the splits that mla_split_range gives keys (at most
// kMlaMaxSplits: warp 0 weighs them, two per lane, once per block; then each thread sums whole
// 4-float chunks of the rows). grid (n_seqs, n_head), kMlaThreads threads.
constexpr int kMlaMaxSplits = 2 * kWarpSize;
template <int kDv>
__global__ void __launch_bounds__(kMlaThreads) mla_reduce_kernel(MlaKernelArgs a) {
  KESTREL_PDL_ENTRY();
  __shared__ float s_w[kMlaMaxSplits];
  const int seq = blockIdx.x, head = blockIdx.y, tid = threadIdx.x;
  const int token = a.query_start[seq];
  if (a.query_start[seq + 1] - token != 1) return;
  const int n_keys = a.positions[token] + 1;
  const int64_t stride = a.n_seqs * a.n_head;  // between splits
  const int64_t first = static_cast<int64_t>(seq) * a.n_head + head;
  if (tid < kWarpSize) {
    float lse[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int s = tid + i * kWarpSize;
      lse[i] = -INFINITY;
      if (s < a.n_splits) {
        const int2 keys = mla_split_range(n_keys, s, a.n_splits);
        if (keys.x < keys.y) lse[i] = a.part_lse[first + s * stride];
      }
    }
    const float m = mla_warp_max(fmaxf(lse[0], lse[1]));
    float w[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) w[i] = lse[i] == -INFINITY ? 0.0f : exp2f(lse[i] - m);
    const float den = warp_reduce_sum(w[0] + w[1]);
    const float inv = den > 0.0f ? 1.0f / den : 0.0f;
#pragma unroll
    for (int i = 0; i < 2; ++i) s_w[tid + i * kWarpSize] = w[i] * inv;
  }
  __syncthreads();
  const int n_splits = min(a.n_splits, kMlaMaxSplits);
  for (int c = tid; c < kDv / 4; c += kMlaThreads) {
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int s = 0; s < n_splits; ++s) {
      const float w = s_w[s];
      if (w == 0.0f) continue;
      const float4 v = reinterpret_cast<const float4*>(a.part_out + (first + s * stride) * kDv)[c];
      acc.x += w * v.x;
      acc.y += w * v.y;
      acc.z += w * v.z;
      acc.w += w * v.w;
    }
    __nv_bfloat16* y = a.out + (static_cast<int64_t>(token) * a.n_head + head) * kDv + c * 4;
    reinterpret_cast<uint32_t*>(y)[0] = pack_bf16x2(acc.x, acc.y);
    reinterpret_cast<uint32_t*>(y)[1] = pack_bf16x2(acc.z, acc.w);
  }
}

}  // namespace kestrel::cuda
