// The paged attention kernel for head dims the tensor-core kernels of paged_attention.cuh are not
// instantiated for (any multiple of 8 up to 256; stories260K's 8, or 24, 40, ...): plain f32 FMA
// ("SIMT") with the same online softmax (exp2, scores pre-multiplied by scale * log2 e), the same
// causal rule (a query at position p attends keys [0, p]) and the same work split as those
// kernels, so the launcher plans both alike: a prefill block takes the tile list's (sequence,
// first token) and kSimtRows query rows (up to kSimtRows / group tokens x the group's query heads
// of one KV head: GQA packing, K and V are read once per group); a decode block takes one
// token's group of query heads for one KV head and one split-KV range (split_key_range; one block
// per (sequence, KV head chunk, split), not persistent), writing either the output or the split's
// normalised output and log-sum-exp for attention_reduce_kernel.
//
// One block = 4 warps; each warp owns kSimtRows / 4 rows (one row's softmax state per warp, the
// output dims spread over the lanes: lane l holds dims l, l + 32, ...). Keys go through shared
// memory in tiles of 32, one key per lane: lane j computes the scores of key j for the warp's rows
// (K rows padded to head_dim + 2 elements, an odd number of 4-byte words, so the 32 lanes read 32
// different banks), then each row's weights go through a per-warp scratch row in shared memory and
// every lane accumulates its dims over the 32 keys. Scores, weights and sums stay f32 (the tensor-
// core kernels round the weights to bf16 for the mma).
// FP8 cache (kFp8, kv_fp8.cuh): the tile loads widen the codes to bf16 (exact) and fetch the keys'
// scales; a key's K scale multiplies its scores, its V scale its weights in P V (not the row sums).
#pragma once

#include <climits>

#include "backend/cuda/paged_attention.cuh"

namespace kestrel::cuda {

constexpr int kSimtRows = 16;  // query rows per block
constexpr int kSimtKeys = 32;  // keys per shared-memory tile: one per lane
constexpr int kSimtRowsPerWarp = kSimtRows / (kAttnThreads / kWarpSize);

// Bytes of dynamic shared memory for head_dim d: row offsets and positions, Q rows (f32, scaled),
// a K tile (bf16, rows padded to d + 2), a V tile (bf16), the per-warp weight scratch and the
// tile's K and V scales (FP8 cache).
inline size_t attn_simt_smem_bytes(int d) {
  return kSimtRows * (8 + 4) + static_cast<size_t>(kSimtRows) * d * 4 + static_cast<size_t>(kSimtKeys) * (d + 2) * 2 +
         static_cast<size_t>(kSimtKeys) * d * 2 + static_cast<size_t>(kSimtRows) * kSimtKeys * 4 + 2 * kSimtKeys * 4;
}

// grid: prefill (tile-list bound, n_head_kv * head_chunks); decode (n_part_rows: sequences or,
// with decode_rows, tokens; n_head_kv * head_chunks, n_splits). 128 threads, attn_simt_smem_bytes(head_dim). kSlots: head_dim <= 32 * kSlots.
template <int kSlots, bool kDecode, bool kFp8 = false>
__global__ void __launch_bounds__(kAttnThreads) attention_simt_kernel(AttnKernelArgs a) {
  KESTREL_PDL_ENTRY();
  const int D = a.head_dim, kChunks = D / 8;
  const int tid = threadIdx.x, warp = tid / kWarpSize, lane = tid % kWarpSize;
  const int kvh = static_cast<int>(blockIdx.y) / a.head_chunks;
  const int h0 = static_cast<int>(blockIdx.y) % a.head_chunks * a.heads_per_tile;

  // Which rows, and which keys [key_begin, key_end), this block does.
  int seq, token0, key_begin = 0, split = 0, split_end = 0, key_lo = 0, n_splits = 1;
  if constexpr (kDecode) {
    if (!decode_row(a, static_cast<int>(blockIdx.x), seq, token0)) return;  // a prefill sequence: the prefill launch's
    split = blockIdx.z;
    const int pos = a.positions[token0];
    key_lo = first_key(pos, a.window);
    n_splits = decode_splits(a, key_lo, pos + 1);
    if (split >= n_splits) return;
    const int2 keys = split_key_range(key_lo, pos + 1, split, n_splits);
    if (keys.x >= keys.y) return;  // the context has fewer key tiles than splits
    key_begin = keys.x;
    split_end = keys.y;
  } else {
    if (!prefill_tile(a, static_cast<int>(blockIdx.x), &seq, &token0)) return;
  }
  const int q_end = a.query_start[seq + 1];
  const int32_t* block_table = a.block_tables + static_cast<int64_t>(seq) * a.max_blocks_per_seq;

  KESTREL_DYNAMIC_SMEM(smem);
  auto* row_off = reinterpret_cast<int64_t*>(smem);                  // [kSimtRows] q/out offset or -1
  auto* row_pos = reinterpret_cast<int32_t*>(row_off + kSimtRows);   // [kSimtRows] position or -1
  auto* sq = reinterpret_cast<float*>(row_pos + kSimtRows);          // [kSimtRows][D]
  auto* sk = reinterpret_cast<__nv_bfloat16*>(sq + kSimtRows * D);   // [kSimtKeys][D + 2]
  auto* sv = sk + kSimtKeys * (D + 2);                               // [kSimtKeys][D]
  auto* sp = reinterpret_cast<float*>(sv + kSimtKeys * D);           // [kSimtRows][kSimtKeys] weights
  auto* s_kscale = sp + kSimtRows * kSimtKeys;                       // kFp8: [kSimtKeys] K scales, then V

  for (int r = tid; r < kSimtRows; r += kAttnThreads) {
    const int tl = kDecode ? 0 : r / a.heads_per_tile;
    const int hh = h0 + (kDecode ? r : r % a.heads_per_tile);
    const int token = token0 + tl;
    const bool valid = (kDecode ? r < a.heads_per_tile : tl < a.tokens_per_tile) && token < q_end && hh < a.group;
    row_off[r] = valid ? (static_cast<int64_t>(token) * a.n_head + kvh * a.group + hh) * D : -1;
    row_pos[r] = valid ? a.positions[token] : -1;  // -1: every key masked, nothing written
  }
  __syncthreads();
  int max_pos = 0, min_lo = INT_MAX;
  for (int r = 0; r < kSimtRows; ++r) {
    max_pos = max(max_pos, row_pos[r]);
    if (row_pos[r] >= 0) min_lo = min(min_lo, first_key(row_pos[r], a.window));
  }
  int key_end = max_pos + 1;
  if constexpr (kDecode) {
    key_end = min(key_end, split_end);
  } else if (min_lo != INT_MAX) {
    key_begin = key_lo = min_lo;  // no row attends an earlier key (sliding window)
  }
  for (int i = tid; i < kSimtRows * D; i += kAttnThreads) {
    const int64_t off = row_off[i / D];
    sq[i] = off >= 0 ? __bfloat162float(a.q[off + i % D]) * a.scale_log2 : 0.0f;
  }

  // The warp's rows: online-softmax state (m in log2 units; l the lane's partial sum) and outputs.
  float m[kSimtRowsPerWarp], l[kSimtRowsPerWarp], o[kSimtRowsPerWarp][kSlots];
  int pos[kSimtRowsPerWarp], lo[kSimtRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kSimtRowsPerWarp; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.0f;
    pos[r] = row_pos[warp * kSimtRowsPerWarp + r];
    lo[r] = pos[r] >= 0 ? first_key(pos[r], a.window) : 0;
#pragma unroll
    for (int i = 0; i < kSlots; ++i) o[r][i] = 0.0f;
  }
  int warp_max_pos = -1;
#pragma unroll
  for (int r = 0; r < kSimtRowsPerWarp; ++r) warp_max_pos = max(warp_max_pos, pos[r]);
  float* wp = sp + warp * kSimtRowsPerWarp * kSimtKeys;  // this warp's weights [rows][keys]

  for (int key0 = key_begin; key0 < key_end; key0 += kSimtKeys) {
    __syncthreads();  // the previous tile has been read (and, the first time, sq written)
    for (int i = tid; i < kSimtKeys * kChunks; i += kAttnThreads) {
      const int r = i / kChunks, c = i % kChunks;
      const int key = key0 + r;
      // Past the end or before the window: zeros (never stale NaN; keys before the window may lie
      // in released blocks).
      uint4 kx = make_uint4(0, 0, 0, 0), vx = kx;
      if (key < key_end && key >= key_lo) {
        const int2 bk = block_of_key(a, key);
        const int64_t row = (static_cast<int64_t>(block_table[bk.x]) * a.n_head_kv + kvh) * a.block_size + bk.y;
        if constexpr (kFp8) {  // 8 codes widened to 8 bf16
          const uint2 kc = *reinterpret_cast<const uint2*>(static_cast<const uint8_t*>(a.k_cache) + row * D + c * 8);
          const uint2 vc = *reinterpret_cast<const uint2*>(static_cast<const uint8_t*>(a.v_cache) + row * D + c * 8);
          e4m3x4_to_bf16x2(kc.x, kx.x, kx.y);
          e4m3x4_to_bf16x2(kc.y, kx.z, kx.w);
          e4m3x4_to_bf16x2(vc.x, vx.x, vx.y);
          e4m3x4_to_bf16x2(vc.y, vx.z, vx.w);
          if (c == 0) {
            s_kscale[r] = a.k_scale[row];
            s_kscale[kSimtKeys + r] = a.v_scale[row];
          }
        } else {
          kx = *reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(a.k_cache) + row * D + c * 8);
          vx = *reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(a.v_cache) + row * D + c * 8);
        }
      } else if (kFp8 && c == 0) {
        s_kscale[r] = 0.0f;
        s_kscale[kSimtKeys + r] = 0.0f;
      }
      auto* kw = reinterpret_cast<uint32_t*>(sk + r * (D + 2) + c * 8);  // 4-byte aligned only
      kw[0] = kx.x;
      kw[1] = kx.y;
      kw[2] = kx.z;
      kw[3] = kx.w;
      *reinterpret_cast<uint4*>(sv + r * D + c * 8) = vx;
    }
    __syncthreads();
    if (key0 > warp_max_pos) continue;  // no row of this warp sees these keys (warp-uniform)

    // Scores of key key0 + lane against the warp's rows.
    float s[kSimtRowsPerWarp];
#pragma unroll
    for (int r = 0; r < kSimtRowsPerWarp; ++r) s[r] = 0.0f;
    const uint32_t* krow = reinterpret_cast<const uint32_t*>(sk + lane * (D + 2));
    const float* qw = sq + warp * kSimtRowsPerWarp * D;
    for (int d = 0; d < D; d += 2) {
      const uint32_t k2 = krow[d / 2];
      const float k0 = __uint_as_float(k2 << 16), k1 = __uint_as_float(k2 & 0xffff0000u);
#pragma unroll
      for (int r = 0; r < kSimtRowsPerWarp; ++r) s[r] += qw[r * D + d] * k0 + qw[r * D + d + 1] * k1;
    }
    const int key = key0 + lane;
    const float k_scale = kFp8 ? s_kscale[lane] : 1.0f, v_scale = kFp8 ? s_kscale[kSimtKeys + lane] : 1.0f;
#pragma unroll
    for (int r = 0; r < kSimtRowsPerWarp; ++r) {
      const float v = key <= pos[r] && key >= lo[r] && key < key_end ? (kFp8 ? s[r] * k_scale : s[r]) : -INFINITY;
      float mx = v;
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      const float m_new = fmaxf(m[r], mx);
      const float base = m_new == -INFINITY ? 0.0f : m_new;  // a row with no key yet stays at 0
      const float corr = exp2f(m[r] - base);
      const float p = exp2f(v - base);
      m[r] = m_new;
      l[r] = l[r] * corr + p;
#pragma unroll
      for (int i = 0; i < kSlots; ++i) o[r][i] *= corr;
      wp[r * kSimtKeys + lane] = kFp8 ? p * v_scale : p;
    }
    __syncwarp();
    // O += P V over the keys any row of the warp sees.
    const int n_keys = min(kSimtKeys, min(key_end, warp_max_pos + 1) - key0);
    for (int j = 0; j < n_keys; ++j) {
      const __nv_bfloat16* vrow = sv + j * D;
      float w[kSimtRowsPerWarp];
#pragma unroll
      for (int r = 0; r < kSimtRowsPerWarp; ++r) w[r] = wp[r * kSimtKeys + j];
#pragma unroll
      for (int i = 0; i < kSlots; ++i) {
        const int d = lane + i * kWarpSize;
        if (d < D) {
          const float v = __bfloat162float(vrow[d]);
#pragma unroll
          for (int r = 0; r < kSimtRowsPerWarp; ++r) o[r][i] += w[r] * v;
        }
      }
    }
    __syncwarp();  // the weights have been read before the next tile's are written
  }

  // Normalise and write: the output, or this partition's share for the split-KV reduction.
#pragma unroll
  for (int r = 0; r < kSimtRowsPerWarp; ++r) {
    float sum = l[r];
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    const int64_t off = row_off[warp * kSimtRowsPerWarp + r];
    if (off < 0) continue;
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    if (!kDecode || n_splits == 1) {
#pragma unroll
      for (int i = 0; i < kSlots; ++i) {
        const int d = lane + i * kWarpSize;
        if (d < D) a.out[off + d] = __float2bfloat16_rn(o[r][i] * inv);
      }
    } else {
      const int64_t head = off / D - static_cast<int64_t>(token0) * a.n_head;
      const int64_t part = (static_cast<int64_t>(split) * a.n_part_rows + blockIdx.x) * a.n_head + head;
#pragma unroll
      for (int i = 0; i < kSlots; ++i) {
        const int d = lane + i * kWarpSize;
        if (d < D) a.part_out[part * D + d] = o[r][i] * inv;
      }
      if (lane == 0) a.part_lse[part] = sum > 0.0f ? m[r] + log2f(sum) : -INFINITY;
    }
  }
}

}  // namespace kestrel::cuda
