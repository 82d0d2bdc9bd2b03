// Paged causal attention kernels (FlashAttention-2, Dao 2023; flash-decoding split-KV, Dao et al.
// 2023), bf16 in shared memory and on the tensor cores (mma.sync m16n8k16, f32 accumulate),
// softmax in f32 with exp2 (scores pre-multiplied by scale * log2 e).
//
// Templated on the head dimension D, a multiple of 16 (paged_attention.cu instantiates the fast
// head dims it lists; every other head dim of 8..256 goes to the SIMT kernel of
// paged_attention_simt.cuh). One block = 4 warps = 128 threads, over keys in tiles of 64 (32 for
// prefill with D > 128, see kPrefillKeyTile) that cp.async double-buffers in shared memory; each
// tile row is a key's D values, gathered through the block table, so any block size works. When D
// is a multiple of 64, rows of a tile are stored with their 16-byte chunks XOR-swizzled by
// (row % 8); otherwise rows are padded by 16 bytes (D / 8 + 1 chunks, an odd number); either way
// the ldmatrix reads of 8 rows hit 8 different bank groups. Up to D = 128 each warp keeps its Q
// fragments in registers; above, they are re-read from shared memory for each key tile (Q in
// registers would take D / 4 more registers per thread and spill at D = 256).
//
// Prefill kernel (sequences with 2+ query tokens): a block takes 64 query rows = up to 64 / group
//   tokens x the group's query heads of one KV head (GQA packing: K and V are read once per group);
//   each warp owns 16 rows and does S = Q K^T (16 x key tile) and O += P V for the whole tile, with
//   the online softmax in registers. Keys run from 0 to the largest position in the block; tiles
//   past the smallest position are masked per element (key > position -> -inf). The block's
//   (sequence, first token) comes from a tile list that attention_plan_kernel builds on the device.
// Decode kernel (sequences with one query token): paged_attention_decode.cuh.
//
// FP8 cache (kv_fp8.cuh; the kernels' kFp8 form): a stage holds a tile's E4M3 codes and scales
// (half the bytes of a bf16 tile, plus 8 per key), copied by cp.async as the bf16 tiles are; before
// a tile is computed its codes are widened to bf16 (exact) into one bf16 K/V tile, which the mma
// code reads as it reads a bf16 stage, with each key's K scale applied to its score column and its
// V scale to its softmax weight before P V (attend_tile's kScaled), so the arithmetic is the bf16
// kernels' on the dequantized cache up to where the scales are applied. The decode kernel at head
// dims 64 and 128 skips the bf16 tile: paged_attention_fp8.cuh.
#pragma once

#include <climits>

#include "backend/cuda/kv_fp8.cuh"

namespace kestrel::cuda {

constexpr int kAttnThreads = 128;  // 4 warps
constexpr int kKeyTile = 64;       // keys per shared-memory tile
constexpr int kPrefillRows = 64;   // query rows per prefill block (16 per warp)
constexpr int kDecodeRows = 16;    // query heads per decode block

// Keys per prefill tile: 32 above D = 128 halves the K/V buffers (D = 256: 97 KB of shared memory
// instead of 161 KB, so two blocks fit on an SM) and the score registers. Measured on an H200
// (bench_cuda_ops, prefill 1 x 2048 at D = 256): 16/16 heads 361 us with 32-key tiles against
// 424 us with 64; 8/1 heads (fewer, longer blocks) 205 us against 175 us.
template <int D>
constexpr int kPrefillKeyTile = D > 128 ? 32 : kKeyTile;
// Whether a warp keeps its Q fragments in registers (D / 4 registers per thread).
template <int D>
constexpr bool kQInRegisters = D <= 128;
// Elements between consecutive rows of a shared-memory tile (see the header comment).
template <int D>
constexpr int kTileStride = D % 64 == 0 ? D : D + 8;

struct AttnKernelArgs {
  const __nv_bfloat16* q;        // [n_tokens, n_head, D]
  const void* k_cache;           // [n_blocks, n_head_kv, block_size, D] bf16, or E4M3 codes (kFp8)
  const void* v_cache;
  const float* k_scale;          // kFp8: [n_blocks, n_head_kv, block_size] f32
  const float* v_scale;
  const int32_t* block_tables;   // [n_seqs, max_blocks_per_seq]
  const int32_t* query_start;    // [n_seqs + 1]
  const int32_t* positions;      // [n_tokens]
  __nv_bfloat16* out;            // [n_tokens, n_head, D]
  int64_t n_seqs;
  int32_t max_blocks_per_seq, n_head, n_head_kv, block_size;
  int32_t block_shift;           // log2(block_size) when it is a power of two, else -1
  int32_t group;                 // n_head / n_head_kv
  int32_t heads_per_tile;        // query heads of one group per block: min(group, rows per block)
  int32_t head_chunks;           // ceil(group / heads_per_tile): grid.y = n_head_kv * head_chunks
  int32_t tokens_per_tile;       // prefill: kPrefillRows / heads_per_tile
  float scale_log2;              // softmax scale * log2(e)
  const int2* tiles;             // prefill tile list: (sequence, first token), from the plan kernel
  const int32_t* n_tiles;        // its length
  int32_t uniform_query;         // > 0: every sequence has this many query tokens (AttentionParams::
                                 // uniform_query_len); the prefill tiles follow from the block index
  int32_t n_splits;              // decode: split-KV ranges a query may take (grid.z; decode_splits)
  int32_t split_min_tiles;       // decode: key tiles per split at least (decode_splits)
  // > 0: the decode kernels take every query token of a uniform run of decode_rows tokens a sequence
  // (a verify step) as its own item, grid.x = n_tokens (token t of sequence t / decode_rows), so that
  // each row gets the bits a one-token step at its position gets; 0: grid.x = n_seqs, the sequences
  // with one query token.
  int32_t decode_rows;
  int32_t n_part_rows;           // grid.x of the decode kernel: n_seqs, or n_tokens with decode_rows
  float* part_out;               // [n_splits, n_part_rows, n_head, D] f32: per-split normalised outputs
  float* part_lse;               // [n_splits, n_part_rows, n_head] f32: per-split log2-sum-exp2
  int32_t head_dim;              // D (read by the kernels that take it at run time)
  int32_t window;                // sliding window: a query at position p attends keys
                                 // (p - window, p] (first_key); 0 = all keys [0, p]
  // Fused RoPE + KV write (tensor-core decode kernel, decode-only passes; rope_qkv null: off): q is
  // read un-rotated from rope_qkv (rows rope_qkv_stride elements apart: n_head q heads, then
  // n_head_kv k heads, then n_head_kv v heads) and rotated in shared memory; every item's last
  // split rotates the token's k of its KV head and writes k and v to the token's slot of
  // k_cache_out / v_cache_out (the caches read, written through these) before it reads them.
  const __nv_bfloat16* rope_qkv;
  int64_t rope_qkv_stride;
  const int64_t* slot_mapping;   // [n_tokens]; negative: nothing written
  const float* inv_freq;         // [rope_dim / 2]
  float rope_position_scale;
  int32_t rope_dim;              // even, <= D
  bool rope_rotate_half;         // pair i with i + rope_dim / 2 (HF), else 2i with 2i + 1
  void* k_cache_out;
  void* v_cache_out;
  float* k_scale_out;            // kFp8
  float* v_scale_out;
};

// Bytes of an FP8 stage of kKeys keys: K codes, V codes ([kKeys][D] u8 each, rows unswizzled), then
// K scales and V scales ([kKeys] f32 each).
template <int D, int kKeys>
constexpr int kFp8StageBytes = 2 * kKeys * D + 2 * kKeys * 4;

// Element offset of chunk `chunk` (8 bf16) of row `row` in a [rows, D] tile (swizzled or padded).
template <int D>
__device__ __forceinline__ int swz(int row, int chunk) {
  if constexpr (D % 64 == 0) {
    return row * D + ((chunk ^ (row & 7)) << 3);
  } else {
    return row * kTileStride<D> + (chunk << 3);
  }
}

// Bytes of dynamic shared memory of the prefill kernel: Q tile, two K tiles, two V tiles (kFp8:
// one bf16 K tile and V tile, and two FP8 stages), per-row position and output offset.
template <int D, bool kFp8 = false>
constexpr size_t attn_prefill_smem_bytes() {
  constexpr int rows = kPrefillRows, keys = kPrefillKeyTile<D>;
  return static_cast<size_t>(rows) * kTileStride<D> * 2 +
         (kFp8 ? 2 : 4) * static_cast<size_t>(keys) * kTileStride<D> * 2 +
         (kFp8 ? 2 * static_cast<size_t>(kFp8StageBytes<D, keys>) : 0) + rows * (4 + 8);
}

// The first key a query at position pos attends: pos + 1 - window with a sliding window (the
// window holds the query's own key and the window - 1 before it, as transformers' Mistral and
// Gemma 3 masks), else 0.
__device__ __forceinline__ int first_key(int pos, int window) { return window > 0 ? max(0, pos + 1 - window) : 0; }

// The keys [x, y) of split `split` of `n_splits` for a decode query at position n_keys - 1 that
// attends keys from key_lo on: the kKeyTile-key tiles (aligned to multiples of kKeyTile) from the
// one holding key_lo to the one holding n_keys - 1, shared out as evenly as possible (the first
// range may start below key_lo: the kernels mask those keys; the last ends at n_keys); empty
// (x >= y) when there are fewer tiles than splits. The decode kernels and the split-KV reduction
// use this one rule, so they agree on which splits hold a result.
__device__ __forceinline__ int2 split_key_range(int key_lo, int n_keys, int split, int n_splits) {
  const int t0 = key_lo / kKeyTile;
  const int64_t tiles = (n_keys + kKeyTile - 1) / kKeyTile - t0;
  const int begin = static_cast<int>(t0 + tiles * split / n_splits) * kKeyTile;
  const int end = min(static_cast<int>(t0 + tiles * (split + 1) / n_splits) * kKeyTile, n_keys);
  return make_int2(begin, end);
}

// The split-KV ranges of a decode query at position n_keys - 1 attending keys from key_lo on:
// a.n_splits, but never fewer than a.split_min_tiles tiles of its own context a split (at least
// one split). It depends on the query's own context, not on the batch's longest (a.n_splits is
// sized by that), so a sequence's row gets the same ranges, and bits, in any batch whose item
// count gives the same a.n_splits (paged_attention.cu, split_rule).
__device__ __forceinline__ int decode_splits(const AttnKernelArgs& a, int key_lo, int n_keys) {
  const int tiles = (n_keys + kKeyTile - 1) / kKeyTile - key_lo / kKeyTile;
  return max(1, min(a.n_splits, tiles / a.split_min_tiles));
}

// Decode row x of the decode kernels' grid: its sequence and query token; false when that
// sequence is not the decode kernels' (not one query token, without a.decode_rows).
__device__ __forceinline__ bool decode_row(const AttnKernelArgs& a, int x, int& seq, int& token) {
  if (a.decode_rows > 0) {
    token = x;
    seq = x / a.decode_rows;
    return true;
  }
  seq = x;
  token = a.query_start[x];
  return a.query_start[x + 1] - token == 1;
}

// Gathers keys [key0, key0 + kKeys) of one KV head through the block table into a K and a V tile
// (cp.async, not waited for); keys at or past key_end, and before key_lo, are zero-filled (never
// stale NaN, which 0 * NaN would carry into O; and a sliding window's keys before key_lo may lie
// in blocks the sequence has released, whose block-table entries are not blocks).
// (block-table index, offset in the block) of a key. Shifts for the usual power-of-two block
// sizes: an integer division by a run-time divisor is a ~20-instruction sequence, and the tile
// loaders do this per 16-byte chunk (ncu on the decode kernel: issue-bound, not memory-bound).
__device__ __forceinline__ int2 block_of_key(const AttnKernelArgs& a, int key) {
  if (a.block_shift >= 0) return make_int2(key >> a.block_shift, key & (a.block_size - 1));
  const int b = key / a.block_size;
  return make_int2(b, key - b * a.block_size);
}

template <int D, int kKeys = kKeyTile>
__device__ __forceinline__ void load_kv_tile(__nv_bfloat16* sk, __nv_bfloat16* sv, const AttnKernelArgs& a,
                                             const int32_t* block_table, int kvh, int key0, int key_end,
                                             int key_lo = 0) {
  constexpr int kChunks = D / 8;
  static_assert(kKeys * kChunks % kAttnThreads == 0, "whole rounds of 16-byte chunks");
  // A fixed trip count, so that the compiler can issue all the block-table reads before the copies.
#pragma unroll 4
  for (int k = 0; k < kKeys * kChunks / kAttnThreads; ++k) {
    const int i = static_cast<int>(threadIdx.x) + k * kAttnThreads;
    const int r = i / kChunks, c = i % kChunks;
    const int key = key0 + r;
    const bool valid = key < key_end && key >= key_lo;
    int64_t off = 0;
    if (valid) {
      const int2 bk = block_of_key(a, key);
      const int64_t blk = block_table[bk.x];
      off = ((blk * a.n_head_kv + kvh) * a.block_size + bk.y) * D + c * 8;
    }
    cp_async16(sk + swz<D>(r, c), static_cast<const __nv_bfloat16*>(a.k_cache) + off, valid);
    cp_async16(sv + swz<D>(r, c), static_cast<const __nv_bfloat16*>(a.v_cache) + off, valid);
  }
}

// load_kv_tile for an FP8 cache: the tile's codes and scales into `stage` (kFp8StageBytes), with
// the same zero fill (codes 0 and scale 0: value 0). kSwizzled: a row's 16-byte chunk c lands at
// chunk c ^ (row % (D / 16)) (the decode kernel's fragment path, paged_attention_fp8.cuh).
template <int D, int kKeys = kKeyTile, bool kSwizzled = false>
__device__ __forceinline__ void load_kv_tile_fp8(unsigned char* stage, const AttnKernelArgs& a,
                                                 const int32_t* block_table, int kvh, int key0, int key_end,
                                                 int key_lo = 0) {
  constexpr int kChunks = D / 16;
  static_assert(!kSwizzled || (kChunks & (kChunks - 1)) == 0, "the swizzle masks the row");
  const auto* kc = static_cast<const uint8_t*>(a.k_cache);
  const auto* vc = static_cast<const uint8_t*>(a.v_cache);
  auto* ks = reinterpret_cast<float*>(stage + 2 * kKeys * D);
  for (int i = static_cast<int>(threadIdx.x); i < kKeys * (kChunks + 1); i += kAttnThreads) {
    const int r = i < kKeys * kChunks ? i / kChunks : i - kKeys * kChunks;
    const int key = key0 + r;
    const bool valid = key < key_end && key >= key_lo;
    int64_t row = 0;  // (block, kv head, offset) of the key
    if (valid) {
      const int2 bk = block_of_key(a, key);
      row = (static_cast<int64_t>(block_table[bk.x]) * a.n_head_kv + kvh) * a.block_size + bk.y;
    }
    if (i < kKeys * kChunks) {
      const int c = i % kChunks, sc = kSwizzled ? c ^ (r & (kChunks - 1)) : c;
      cp_async16(stage + r * D + sc * 16, kc + row * D + c * 16, valid);
      cp_async16(stage + (kKeys + r) * D + sc * 16, vc + row * D + c * 16, valid);
    } else {
      cp_async4(ks + r, a.k_scale + row, valid);
      cp_async4(ks + kKeys + r, a.v_scale + row, valid);
    }
  }
}

// Widens the codes of tile rows [row0, row0 + n_rows) of an FP8 stage into the bf16 tiles sk and sv
// (swz layout, as load_kv_tile fills them), exactly. Threads t = 0 .. n_threads - 1 share the work.
template <int D, int kKeys = kKeyTile>
__device__ __forceinline__ void widen_kv_rows(const unsigned char* stage, __nv_bfloat16* sk, __nv_bfloat16* sv,
                                              int row0, int n_rows, int t, int n_threads) {
  constexpr int kChunks = D / 16;
  for (int i = t; i < 2 * n_rows * kChunks; i += n_threads) {
    const int which = i / (n_rows * kChunks), j = i % (n_rows * kChunks);
    const int r = row0 + j / kChunks, c = j % kChunks;
    const uint4 codes = *reinterpret_cast<const uint4*>(stage + (which * kKeys + r) * D + c * 16);
    uint4 lo, hi;
    e4m3x16_to_bf16x16(codes, lo, hi);
    __nv_bfloat16* dst = which == 0 ? sk : sv;
    *reinterpret_cast<uint4*>(dst + swz<D>(r, 2 * c)) = lo;
    *reinterpret_cast<uint4*>(dst + swz<D>(r, 2 * c + 1)) = hi;
  }
}

// One warp's online-softmax state: 16 rows x D outputs (mma accumulator layout: lane holds rows
// lane/4 and lane/4 + 8, columns 8 dt + 2 (lane % 4) + {0, 1}), running max m (log2 units) and
// the lane's partial row sums l (summed over the quad at the end).
template <int D>
struct WarpSoftmax {
  float o[D / 8][4];
  float m[2];
  float l[2];
};

// The warp's 16 query rows as mma A fragments (one per 16 dims): in registers up to D = 128,
// else read from the Q tile in shared memory where they are used (load() only records where).
template <int D, bool kInRegisters = kQInRegisters<D>>
struct QFragments {
  uint32_t f[D / 16][4];
  // Loads the warp's 16 query rows starting at row_base.
  __device__ __forceinline__ void load(const __nv_bfloat16* sq, int row_base) {
    const int lane = threadIdx.x % kWarpSize;
    const int row = row_base + (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) ldmatrix_x4(f[kk], sq + swz<D>(row, kk * 2 + (lane >> 4)));
  }
};
template <int D>
struct QFragments<D, false> {
  const __nv_bfloat16* sq;
  int row_base;
  __device__ __forceinline__ void load(const __nv_bfloat16* q_tile, int base) {
    sq = q_tile;
    row_base = base;
  }
  // Fragment kk (dims 16 kk ... 16 kk + 15) from shared memory.
  __device__ __forceinline__ void get(uint32_t (&r)[4], int kk) const {
    const int lane = threadIdx.x % kWarpSize;
    ldmatrix_x4(r, sq + swz<D>(row_base + (lane & 7) + ((lane >> 3) & 1) * 8, kk * 2 + (lane >> 4)));
  }
};

// With D / 16 odd, the last 16 dims of S = Q K^T: one ldmatrix .x4 gives that k-step's B fragments
// of two key groups (nt, nt + 1).
template <int D, int kNK>
__device__ __forceinline__ void scores_last_k16(float (&s)[kNK / 8][4], const uint32_t (&qa)[4],
                                                const __nv_bfloat16* sk, int key_off) {
  constexpr int kk = D / 16 - 1;
  const int lane = threadIdx.x % kWarpSize;
#pragma unroll
  for (int nt = 0; nt < kNK / 8; nt += 2) {
    uint32_t b[4];
    ldmatrix_x4(b, sk + swz<D>(key_off + (nt + (lane >> 4)) * 8 + (lane & 7), kk * 2 + ((lane >> 3) & 1)));
    const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
    mma_bf16_16816(s[nt], qa, b0);
    mma_bf16_16816(s[nt + 1], qa, b1);
  }
}

// S = Q K^T for the warp's 16 rows and kNK keys of the tile starting at tile row key_off.
template <int D, int kNK>
__device__ __forceinline__ void tile_scores(float (&s)[kNK / 8][4], const QFragments<D>& q,
                                            const __nv_bfloat16* sk, int key_off) {
  constexpr int kPairs = D / 16 / 2 * 2;  // k-steps taken two at a time
  const int lane = threadIdx.x % kWarpSize;
  if constexpr (kQInRegisters<D>) {
#pragma unroll
    for (int nt = 0; nt < kNK / 8; ++nt) {
      s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
      const int row = key_off + nt * 8 + (lane & 7);
#pragma unroll
      for (int kk = 0; kk < kPairs; kk += 2) {
        uint32_t b[4];
        ldmatrix_x4(b, sk + swz<D>(row, kk * 2 + (lane >> 3)));
        const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
        mma_bf16_16816(s[nt], q.f[kk], b0);
        mma_bf16_16816(s[nt], q.f[kk + 1], b1);
      }
    }
    if constexpr (kPairs < D / 16) scores_last_k16<D, kNK>(s, q.f[D / 16 - 1], sk, key_off);
  } else {
    // k-steps outside, key groups inside: each Q fragment is read from shared memory once per tile.
#pragma unroll
    for (int nt = 0; nt < kNK / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < kPairs; kk += 2) {
      uint32_t qa[4], qb[4];
      q.get(qa, kk);
      q.get(qb, kk + 1);
#pragma unroll
      for (int nt = 0; nt < kNK / 8; ++nt) {
        uint32_t b[4];
        ldmatrix_x4(b, sk + swz<D>(key_off + nt * 8 + (lane & 7), kk * 2 + (lane >> 3)));
        const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
        mma_bf16_16816(s[nt], qa, b0);
        mma_bf16_16816(s[nt], qb, b1);
      }
    }
    if constexpr (kPairs < D / 16) {
      uint32_t qa[4];
      q.get(qa, D / 16 - 1);
      scores_last_k16<D, kNK>(s, qa, sk, key_off);
    }
  }
}

// The warp's rows against kNK keys of the tile starting at tile row key_off (absolute key index of
// tile row 0: key0). With need_mask, the lane's two rows attend keys [lo0, pos0] and [lo1, pos1]
// only (pos INT_MAX, lo 0: never masked). kScaled (FP8 cache): k_scale / v_scale [tile rows] f32
// scale tile row r's score by k_scale[r] and its softmax weight by v_scale[r] before P V (the row
// sums add the unscaled weights).
template <int D, int kNK, bool kScaled = false>
__device__ __forceinline__ void attend_tile(WarpSoftmax<D>& st, const QFragments<D>& q,
                                            const __nv_bfloat16* sk, const __nv_bfloat16* sv, int key_off, int key0,
                                            bool need_mask, int pos0, int pos1, int lo0, int lo1, float scale_log2,
                                            const float* k_scale = nullptr, const float* v_scale = nullptr) {
  const int lane = threadIdx.x % kWarpSize;
  float s[kNK / 8][4];
  tile_scores<D, kNK>(s, q, sk, key_off);
  const int c2 = (lane & 3) * 2;
  float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int nt = 0; nt < kNK / 8; ++nt)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float v = s[nt][j] * scale_log2;
      if constexpr (kScaled) v = s[nt][j] * (scale_log2 * k_scale[key_off + nt * 8 + c2 + (j & 1)]);
      if (need_mask) {
        const int key = key0 + key_off + nt * 8 + c2 + (j & 1);
        if (key > (j < 2 ? pos0 : pos1) || key < (j < 2 ? lo0 : lo1)) v = -INFINITY;
      }
      s[nt][j] = v;
      mx[j >> 1] = fmaxf(mx[j >> 1], v);
    }
  float base[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
    const float m_new = fmaxf(st.m[r], mx[r]);
    base[r] = m_new == -INFINITY ? 0.0f : m_new;  // a row with no key yet: keep everything at 0
    const float corr = exp2f(st.m[r] - base[r]);
    st.m[r] = m_new;
    st.l[r] *= corr;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      st.o[dt][2 * r] *= corr;
      st.o[dt][2 * r + 1] *= corr;
    }
  }
#pragma unroll
  for (int ks = 0; ks < kNK / 16; ++ks) {
    // P's C-fragment of key tiles 2 ks and 2 ks + 1 is exactly the A fragment of one k16 step.
    uint32_t pa[4];
    if constexpr (kScaled) {
      float p[2][4];  // key groups 2 ks, 2 ks + 1
#pragma unroll
      for (int g = 0; g < 2; ++g)
#pragma unroll
        for (int j = 0; j < 4; ++j) p[g][j] = exp2f(s[2 * ks + g][j] - base[j >> 1]);
      st.l[0] += p[0][0] + p[0][1] + p[1][0] + p[1][1];
      st.l[1] += p[0][2] + p[0][3] + p[1][2] + p[1][3];
      const float* vs = v_scale + key_off + ks * 16 + c2;
      pa[0] = pack_bf16x2(p[0][0] * vs[0], p[0][1] * vs[1]);
      pa[1] = pack_bf16x2(p[0][2] * vs[0], p[0][3] * vs[1]);
      pa[2] = pack_bf16x2(p[1][0] * vs[8], p[1][1] * vs[9]);
      pa[3] = pack_bf16x2(p[1][2] * vs[8], p[1][3] * vs[9]);
    } else {
      pa[0] = pack_bf16x2(exp2f(s[2 * ks][0] - base[0]), exp2f(s[2 * ks][1] - base[0]));
      pa[1] = pack_bf16x2(exp2f(s[2 * ks][2] - base[1]), exp2f(s[2 * ks][3] - base[1]));
      pa[2] = pack_bf16x2(exp2f(s[2 * ks + 1][0] - base[0]), exp2f(s[2 * ks + 1][1] - base[0]));
      pa[3] = pack_bf16x2(exp2f(s[2 * ks + 1][2] - base[1]), exp2f(s[2 * ks + 1][3] - base[1]));
      // The row sums add the bf16-rounded weights that the mma multiplies V by.
      st.l[0] += __uint_as_float(pa[0] << 16) + __uint_as_float(pa[0] & 0xffff0000u) +
                 __uint_as_float(pa[2] << 16) + __uint_as_float(pa[2] & 0xffff0000u);
      st.l[1] += __uint_as_float(pa[1] << 16) + __uint_as_float(pa[1] & 0xffff0000u) +
                 __uint_as_float(pa[3] << 16) + __uint_as_float(pa[3] & 0xffff0000u);
    }
    const int row = key_off + ks * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
    for (int dt = 0; dt < D / 8; dt += 2) {
      uint32_t b[4];
      ldmatrix_x4_trans(b, sv + swz<D>(row, dt + (lane >> 4)));
      const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
      mma_bf16_16816(st.o[dt], pa, b0);
      mma_bf16_16816(st.o[dt + 1], pa, b1);
    }
  }
}

template <int D>
__device__ __forceinline__ void init_softmax(WarpSoftmax<D>& st) {
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt) st.o[dt][0] = st.o[dt][1] = st.o[dt][2] = st.o[dt][3] = 0.0f;
  st.m[0] = st.m[1] = -INFINITY;
  st.l[0] = st.l[1] = 0.0f;
}

// Builds the prefill tile list: for each sequence with 2+ query tokens, ceil(len / tokens_per_tile)
// entries (sequence, first token). One block of 256 threads; n_tiles receives the count.
__global__ void attention_plan_kernel(const int32_t* __restrict__ query_start, int64_t n_seqs, int32_t tokens_per_tile,
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

// The prefill tile of block `b` (its sequence and first query token); false past the last tile.
// With uniform query runs each sequence has ceil(q / tokens_per_tile) tiles, taken in order;
// else the plan kernel's list, last tiles first: within a sequence they attend the most keys, so
// the long blocks start early.
__device__ __forceinline__ bool prefill_tile(const AttnKernelArgs& a, int b, int* seq, int* token0) {
  if (a.uniform_query > 0) {
    const int per_seq = (a.uniform_query + a.tokens_per_tile - 1) / a.tokens_per_tile;
    if (b >= a.n_seqs * per_seq) return false;
    *seq = b / per_seq;
    *token0 = *seq * a.uniform_query + b % per_seq * a.tokens_per_tile;
    return true;
  }
  const int n_tiles = *a.n_tiles;
  if (b >= n_tiles) return false;
  const int2 tile = a.tiles[n_tiles - 1 - b];
  *seq = tile.x;
  *token0 = tile.y;
  return true;
}

// grid (tile-list bound, n_head_kv * head_chunks), 128 threads, attn_prefill_smem_bytes<D, kFp8>().
template <int D, bool kFp8 = false>
__global__ void __launch_bounds__(kAttnThreads) attention_prefill_kernel(AttnKernelArgs a) {
  KESTREL_PDL_ENTRY();
  constexpr int kRows = kPrefillRows, kChunks = D / 8, kKeys = kPrefillKeyTile<D>, kStride = kTileStride<D>;
  int seq = 0, token0 = 0;
  if (!prefill_tile(a, static_cast<int>(blockIdx.x), &seq, &token0)) return;
  KESTREL_DYNAMIC_SMEM(smem);
  constexpr int kBufs = kFp8 ? 1 : 2;     // bf16 K/V tiles: double-buffered, or the one FP8 stages widen into
  constexpr int kFp8Stage = kFp8StageBytes<D, kKeys>;
  auto* sq = reinterpret_cast<__nv_bfloat16*>(smem);
  auto* sk = sq + kRows * kStride;        // [kBufs][kKeys][kStride]
  auto* sv = sk + kBufs * kKeys * kStride;  // [kBufs][kKeys][kStride]
  auto* fp8_stages = reinterpret_cast<unsigned char*>(sv + kBufs * kKeys * kStride);  // kFp8: [2][kFp8Stage]
  auto* row_off = reinterpret_cast<int64_t*>(fp8_stages + (kFp8 ? 2 * kFp8Stage : 0));  // [kRows] q/out offset or -1
  auto* row_pos = reinterpret_cast<int32_t*>(row_off + kRows);         // [kRows]

  const int q_end = a.query_start[seq + 1];
  const int kvh = static_cast<int>(blockIdx.y) / a.head_chunks;
  const int h0 = static_cast<int>(blockIdx.y) % a.head_chunks * a.heads_per_tile;
  const int32_t* block_table = a.block_tables + static_cast<int64_t>(seq) * a.max_blocks_per_seq;
  const int tid = threadIdx.x, warp = tid / kWarpSize, lane = tid % kWarpSize;

  for (int r = tid; r < kRows; r += kAttnThreads) {
    const int tl = r / a.heads_per_tile, hh = h0 + r % a.heads_per_tile;
    const int token = token0 + tl;
    const bool valid = tl < a.tokens_per_tile && token < q_end && hh < a.group;
    row_off[r] = valid ? (static_cast<int64_t>(token) * a.n_head + kvh * a.group + hh) * D : -1;
    row_pos[r] = valid ? a.positions[token] : INT_MAX;
  }
  __syncthreads();
  for (int i = tid; i < kRows * kChunks; i += kAttnThreads) {
    const int r = i / kChunks, c = i % kChunks;
    const int64_t off = row_off[r];
    cp_async16(sq + swz<D>(r, c), a.q + (off >= 0 ? off + c * 8 : 0), off >= 0);
  }
  // Keys [min_lo, max_pos] cover every row's range [first_key(pos), pos]; tiles holding keys past
  // the smallest position or before the largest first key are masked per element.
  int min_pos = INT_MAX, max_pos = 0, min_lo = INT_MAX, max_lo = 0;
  for (int r = 0; r < kRows; ++r) {
    const int p = row_pos[r];
    min_pos = min(min_pos, p);
    if (p != INT_MAX) {
      max_pos = max(max_pos, p);
      min_lo = min(min_lo, first_key(p, a.window));
      max_lo = max(max_lo, first_key(p, a.window));
    }
  }
  const int kv_end = max_pos + 1;
  const int first_tile = min_lo == INT_MAX ? 0 : min_lo / kKeys;
  const int n_kv_tiles = (kv_end + kKeys - 1) / kKeys;
  const int key_lo = min_lo == INT_MAX ? 0 : min_lo;
  // Tile j's K and V loads: into bf16 buffer j % 2, or FP8 stage j % 2.
  auto load_tile = [&](int j) {
    if constexpr (kFp8) {
      load_kv_tile_fp8<D, kKeys>(fp8_stages + (j & 1) * kFp8Stage, a, block_table, kvh, j * kKeys, kv_end, key_lo);
    } else {
      load_kv_tile<D, kKeys>(sk + (j & 1) * kKeys * kStride, sv + (j & 1) * kKeys * kStride, a, block_table, kvh,
                             j * kKeys, kv_end, key_lo);
    }
  };
  load_tile(first_tile);
  cp_async_commit();

  const int pos0 = row_pos[warp * 16 + lane / 4], pos1 = row_pos[warp * 16 + lane / 4 + 8];
  const int lo0 = pos0 == INT_MAX ? 0 : first_key(pos0, a.window);
  const int lo1 = pos1 == INT_MAX ? 0 : first_key(pos1, a.window);
  QFragments<D> qf;
  WarpSoftmax<D> st;
  init_softmax(st);
  for (int j = first_tile; j < n_kv_tiles; ++j) {
    const int buf = j & 1;
    if (j + 1 < n_kv_tiles) {
      load_tile(j + 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    if (j == first_tile) qf.load(sq, warp * 16);
    const int key0 = j * kKeys;
    const bool need_mask = key0 + kKeys - 1 > min_pos || key0 < max_lo;
    if constexpr (kFp8) {
      const unsigned char* stage = fp8_stages + buf * kFp8Stage;
      widen_kv_rows<D, kKeys>(stage, sk, sv, 0, kKeys, tid, kAttnThreads);
      __syncthreads();
      const auto* scales = reinterpret_cast<const float*>(stage + 2 * kKeys * D);
      attend_tile<D, kKeys, true>(st, qf, sk, sv, 0, key0, need_mask, pos0, pos1, lo0, lo1, a.scale_log2, scales,
                                  scales + kKeys);
    } else {
      attend_tile<D, kKeys>(st, qf, sk + buf * kKeys * kStride, sv + buf * kKeys * kStride, 0, key0, need_mask, pos0,
                            pos1, lo0, lo1, a.scale_log2);
    }
    __syncthreads();  // the buffer is refilled in the next iteration
  }

  // Normalise and stage the warp's 16 rows in its own rows of the Q tile, then 16-byte stores.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = st.l[r];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    const int row = warp * 16 + lane / 4 + 8 * r;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt)
      *reinterpret_cast<uint32_t*>(sq + swz<D>(row, dt) + (lane & 3) * 2) =
          pack_bf16x2(st.o[dt][2 * r] * inv, st.o[dt][2 * r + 1] * inv);
  }
  __syncwarp();
  for (int i = lane; i < 16 * kChunks; i += kWarpSize) {
    const int row = warp * 16 + i / kChunks, c = i % kChunks;
    const int64_t off = row_off[row];
    if (off >= 0) *reinterpret_cast<uint4*>(a.out + off + c * 8) = *reinterpret_cast<const uint4*>(sq + swz<D>(row, c));
  }
}

}  // namespace kestrel::cuda
