// Paged decode attention (sequences with one query token, or each token of a verify step's
// uniform runs: AttnKernelArgs::decode_rows) on the tensor cores, and the split-KV reduction
// (flash-decoding, Dao et al. 2023), for the head dims of paged_attention.cuh's kernels.
//
// One block per work item (query token, KV head and head chunk, split): the token's group of query
// heads (up to 16 rows, one mma tile, padding rows zero) for one KV head over one split of the
// context (split_key_range: whole 64-key tiles shared out evenly). The 4 warps split each key tile
// (16 keys each; 32 of a 128-key stage, and items of up to 8 heads, on the FP8 fragment path of
// paged_attention_fp8.cuh), with two or three cp.async stages, and merge their softmax states through
// shared memory at the end (only the group's valid rows). The item's metadata (its token, position
// and key range, and the block-table entries of its first tile) is read before
// griddepcontrol.wait: those arrays are written before the forward pass, not by the kernel this
// one follows, so under programmatic dependent launch the block's start overlaps that kernel's end.
// With more than one split for its query (decode_splits: from the query's own context, so that a
// row's bits do not depend on the batch's longest context) each item writes its normalised output
// and log2-sum-exp2 for attention_reduce_kernel; else it writes the output. Fused RoPE (AttnKernelArgs::rope_qkv, decode-
// only passes): q is read un-rotated from the QKV rows and rotated in shared memory before the
// first tile, and each item's last split, which holds the token's own key, rotates k and writes k
// and v to the token's slot before it reads its tiles (what rope_write_kv_fused did, in the same
// bits).
//
// Measured against alternatives on an H200 (docs/performance.md, "H200: decode attention
// kernels"): a persistent version of this kernel (resident blocks taking items in turn, the next
// item's first tile loading during the current one's last) and a stream-K one (the batch's key
// tiles shared out evenly over the resident blocks, items split between blocks and reduced) were
// no faster at 64 sequences x 576 keys and slower at 400 x 1000-2000 keys, so one block per item
// it is.
#pragma once

#include <type_traits>

#include "backend/cuda/paged_attention_fp8.cuh"

namespace kestrel::cuda {

// Shared memory of the decode kernel: the Q tile, kStages K/V stages (a stage's K tile and V tile
// are contiguous, so a consumed stage holds the 4-warp merge's 4 x 16 x D f32 outputs), and the
// merge's row max and row sum per warp.
// The last region also holds the fused RoPE's cos / sin table (D floats at most) until the merge.
// kFp8: the stages hold codes and scales (kFp8StageBytes); at the head dims of the fragment path
// (paged_attention_fp8.cuh) the stages together hold the merge outputs; at the others one bf16 K/V
// tile follows them, each warp's 16 rows widened there by the warp, and it holds the merge outputs.
// kFp8Tile: the keys of a fragment-path stage (kFp8KeyTile, or 64).
template <int D, int kStages = 2, bool kFp8 = false, int kFp8Tile = kFp8KeyTile>
constexpr size_t attn_decode_smem_bytes() {
  constexpr size_t merge = 2 * 4 * kDecodeRows * sizeof(float), rope = D * sizeof(float);
  constexpr size_t tile = 2 * static_cast<size_t>(kKeyTile) * kTileStride<D> * 2;  // a bf16 K/V stage
  constexpr size_t fp8_stages =
      kStages * static_cast<size_t>(kFp8StageBytes<D, kFp8Fragments<D> ? kFp8Tile : kKeyTile>);
  return static_cast<size_t>(kDecodeRows) * kTileStride<D> * 2 +
         (kFp8 ? fp8_stages + (kFp8Fragments<D> ? 0 : tile) : kStages * tile) + (merge > rope ? merge : rope);
}
static_assert(2 * kKeyTile * 2 >= 4 * kDecodeRows * 4, "a K/V stage holds the warps' merge outputs");
static_assert(2 * kFp8StageBytes<128, 64> >= 4 * kDecodeRows * 128 * 4 &&
                  2 * kFp8StageBytes<64, 64> >= 4 * kDecodeRows * 64 * 4,
              "two FP8 fragment-path stages (of 64 keys or more) hold the warps' merge outputs");

// K/V stages the decode kernel is instantiated with: 2 and 3 (the FP8 fragment path's stages hold
// 128 keys, about the bytes of a 64-key bf16 stage, or 64). Blocks per SM its registers are bounded
// for (D <= 128): 3 with 2 stages (d128: 66-72 KB of shared memory a block), else 2; 4 for the
// fragment path's 64-key stages (d128: 38 / 55 KB a block with 2 / 3 stages).
template <int D, int kStages, bool kFp8>
constexpr bool kDecodeStagesSupported = kStages == 2 || kStages == 3;
template <int D, int kStages, bool kFp8, int kFp8Tile = kFp8KeyTile>
constexpr int kDecodeMinBlocks = D > 128                                      ? 1
                                 : kFp8 && kFp8Fragments<D> && kFp8Tile == 64 ? 4
                                 : kStages == 2                               ? 3
                                                                              : 2;

// One decode work item.
// row: the grid row (decode_row); n_splits: the query's split count (decode_splits).
struct DecodeItem {
  int row = 0, seq = 0, split = 0, n_splits = 1, token = 0, pos = 0, kvh = 0, head0 = 0, n_rows = 0, key_begin = 0,
      key_end = 0;
};

// Float pair `pair` (floats 2 pair, 2 pair + 1) of query row `row` in the merge scratch
// [kWarps][kDecodeRows][D] f32: pairs XOR-swizzled by row within aligned runs of kRun pairs (the
// largest power of two dividing D / 2, at most 32), so that a warp's 64-bit stores of 8 rows x 4
// pairs and its reads of consecutive outputs of one row hit distinct banks.
template <int D>
__device__ __forceinline__ int merge_index(int warp, int row, int pair) {
  constexpr int kHalf = D / 2, kRun = (kHalf & -kHalf) < 32 ? (kHalf & -kHalf) : 32;
  return ((warp * kDecodeRows + row) * kHalf + (pair ^ (((row & 7) << 2) & (kRun - 1)))) * 2;
}

// Merges the 4 warps' softmax states, stored by store_warp_state (so: [4][16][D] f32 in
// merge_index's layout; sml: row max [4][16], then row sum [4][16]), of the item's valid rows and
// writes the output or the split's partial result.
template <int D>
__device__ __forceinline__ void combine_decode_item(const AttnKernelArgs& a, const DecodeItem& it, const float* so,
                                                    const float* sml) {
  constexpr int kRows = kDecodeRows, kWarps = kAttnThreads / kWarpSize;
  const float* sm = sml;
  const float* sl = sml + kWarps * kRows;
  __syncthreads();
  for (int i = threadIdx.x; i < it.n_rows * D; i += kAttnThreads) {
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
      o += so[(d & 1) + merge_index<D>(w, row, d / 2)] * e;
    }
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    const int head = it.head0 + row;
    if (it.n_splits == 1) {
      a.out[(static_cast<int64_t>(it.token) * a.n_head + head) * D + d] = __float2bfloat16_rn(o * inv);
    } else {
      const int64_t part = (static_cast<int64_t>(it.split) * a.n_part_rows + it.row) * a.n_head + head;
      a.part_out[part * D + d] = o * inv;
      if (d == 0) a.part_lse[part] = l > 0.0f ? m + log2f(l) : -INFINITY;
    }
  }
}

// The warp's softmax state of the item's valid rows into the merge scratch (combine_decode_item).
template <int D>
__device__ __forceinline__ void store_warp_state(const WarpSoftmax<D>& st, const DecodeItem& it, float* so,
                                                 float* sml) {
  constexpr int kRows = kDecodeRows, kWarps = kAttnThreads / kWarpSize;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  float* sm = sml;
  float* sl = sml + kWarps * kRows;
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
}

// The FP8 fragment path's O^T state (WarpSoftmaxT: heads as columns, dims as fp8_output_dim) into
// the same scratch, multiplied by 2^rho (v_exp: attend_tile_fp8).
template <int D>
__device__ __forceinline__ void store_warp_state(const WarpSoftmaxT<D>& st, int v_exp, const DecodeItem& it, float* so,
                                                 float* sml) {
  constexpr int kRows = kDecodeRows, kWarps = kAttnThreads / kWarpSize;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize, g = lane / 4, q = lane % 4;
  const float up = __uint_as_float(static_cast<uint32_t>(v_exp + 1) << 23);  // 2^rho = 2^(v_exp - 126)
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    float l = st.l[j];
#pragma unroll
    for (int off = 4; off < kWarpSize; off *= 2) l += __shfl_xor_sync(0xffffffffu, l, off);  // the head's 8 lanes
    const int head = 2 * q + j;
    if (head >= it.n_rows) continue;  // padding columns (groups under 8) are not merged
    if (g == 0) {
      sml[warp * kRows + head] = st.m[j];
      sml[(kWarps + warp) * kRows + head] = l;
    }
    // Rows g and g + 8 of tile mt are dims fp8_output_dim(g, mt, 0) and + 1: one float pair.
#pragma unroll
    for (int mt = 0; mt < D / 16; ++mt)
      *reinterpret_cast<float2*>(so + merge_index<D>(warp, head, fp8_output_dim<D>(g, mt, 0) / 2)) =
          make_float2(st.o[mt][j] * up, st.o[mt][2 + j] * up);
  }
}

// grid (n_seqs, n_head_kv * head_chunks, n_splits), 128 threads, attn_decode_smem_bytes<D,
// kStages, kFp8, kFp8Tile>(). kStages K/V tiles in flight or computed at once: 2 (one loads while one
// is computed; at most 168 registers for D <= 128, so that three blocks fit on an SM) or 3 (two
// load while one is computed; two blocks per SM by shared memory). kFp8Tile: keys of a
// fragment-path stage (128, or 64 with four blocks an SM).
template <int D, int kStages = 2, bool kFp8 = false, int kFp8Tile = kFp8KeyTile>
__global__ void __launch_bounds__(kAttnThreads, (kDecodeMinBlocks<D, kStages, kFp8, kFp8Tile>))
    attention_decode_kernel(AttnKernelArgs a) {
  static_assert(kDecodeStagesSupported<D, kStages, kFp8>, "an instantiated stage count");
  constexpr bool kFragments = kFp8 && kFp8Fragments<D>;  // paged_attention_fp8.cuh
  static_assert(kFp8Tile == kFp8KeyTile || (kFragments && kFp8Tile == 64), "64-key stages: the fragment path only");
  constexpr int kRows = kDecodeRows, kChunks = D / 8, kWarps = kAttnThreads / kWarpSize, kStride = kTileStride<D>;
  constexpr int kStage = 2 * kKeyTile * kStride;  // elements of a bf16 K/V stage (kFp8: of the widened tile)
  constexpr int kTile = kFragments ? kFp8Tile : kKeyTile;  // keys of a stage
  constexpr int kFp8Stage = kFp8StageBytes<D, kTile>;
  // Before griddepcontrol.wait: only arrays written before the forward pass.
  DecodeItem it;
  it.row = blockIdx.x;
  it.split = blockIdx.z;
  const bool decode = decode_row(a, it.row, it.seq, it.token);  // else a prefill sequence: the other kernel's
  it.pos = decode ? a.positions[it.token] : 0;
  const int key_lo = first_key(it.pos, a.window);
  it.n_splits = decode_splits(a, key_lo, it.pos + 1);
  const int2 keys = split_key_range(key_lo, it.pos + 1, it.split, it.n_splits);
  // Nothing to do: a prefill sequence, a split past the query's count, or an empty split (fewer key
  // tiles than splits).
  if (!decode || it.split >= it.n_splits || keys.x >= keys.y) {
    // Still wait: the next kernel's griddepcontrol.wait covers this grid only, so this grid may
    // not complete before the one it follows (a pass without decodes has no block that waits).
    pdl_wait();
    pdl_launch_next();
    return;
  }
  it.key_begin = keys.x;
  it.key_end = keys.y;
  it.kvh = static_cast<int>(blockIdx.y) / a.head_chunks;
  const int h0 = static_cast<int>(blockIdx.y) % a.head_chunks * a.heads_per_tile;
  it.n_rows = min(a.heads_per_tile, a.group - h0);
  it.head0 = it.kvh * a.group + h0;
  const int32_t* table = a.block_tables + static_cast<int64_t>(it.seq) * a.max_blocks_per_seq;
  prefetch_l1(table + block_of_key(a, min(it.key_begin + static_cast<int>(threadIdx.x) % kKeyTile, it.key_end - 1)).x);
  KESTREL_DYNAMIC_SMEM(smem);
  auto* sq = reinterpret_cast<__nv_bfloat16*>(smem);  // [kRows][kStride]
  auto* stages = sq + kRows * kStride;                 // [kStages][K tile, V tile] (kFp8: [kStages][kFp8Stage] bytes)
  auto* fp8_stages = reinterpret_cast<unsigned char*>(stages);
  // kFp8: the widened K, V tile (none on the fragment path, whose stage 0 stands in for the fused RoPE's rows)
  auto* wide = kFp8 && !kFragments ? reinterpret_cast<__nv_bfloat16*>(fp8_stages + kStages * kFp8Stage) : stages;
  auto* sml = reinterpret_cast<float*>(kFragments ? fp8_stages + kStages * kFp8Stage
                                       : kFp8     ? reinterpret_cast<unsigned char*>(wide + kStage)
                                                  : reinterpret_cast<unsigned char*>(stages + kStages * kStage));
  const int warp = threadIdx.x / kWarpSize;
  // Fused RoPE: the token's cos / sin table (in the merge scratch, free until the merge), from the
  // positions and inverse frequencies (written before the pass), before the wait.
  const bool fused_rope = a.rope_qkv != nullptr;
  float* rope_cs = sml;
  float* rope_sn = sml + D / 2;
  if (fused_rope)
    for (int i = threadIdx.x; i < a.rope_dim / 2; i += kAttnThreads)
      rope_cos_sin(it.pos, a.rope_position_scale, a.inv_freq[i], rope_cs[i], rope_sn[i]);
  pdl_wait();
  pdl_launch_next();

  if (fused_rope && it.split == it.n_splits - 1) {
    // The last split (never empty) holds the token's own key: it writes the token's k (rotated)
    // and v to the cache before any of its tiles is read. Every head chunk's last split writes
    // the same bits, so chunks of one KV head need no ordering between them.
    const int64_t slot = a.slot_mapping[it.token];
    const __nv_bfloat16* kx = a.rope_qkv + static_cast<int64_t>(it.token) * a.rope_qkv_stride + (a.n_head + it.kvh) * D;
    const __nv_bfloat16* vx = kx + static_cast<int64_t>(a.n_head_kv) * D;
    __nv_bfloat16* kv_row = wide;  // [2][D]: the token's k and v, in K/V stage 0 (the widened tile) before any tile
    for (int i = threadIdx.x; i < 2 * kChunks; i += kAttnThreads)
      cp_async16(kv_row + i * 8, (i < kChunks ? kx : vx) + (i % kChunks) * 8, true);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    if (slot >= 0) {
      const int64_t off = kv_slot_offset(slot, it.kvh, a.n_head_kv, a.block_size, D);
      if constexpr (kFp8) {
        // Warp 0 quantizes the rotated k, warp 1 the v (rope_write_kv_fused_fp8's rows).
        if (warp < 2) {
          constexpr int kPer = (D + kWarpSize - 1) / kWarpSize;
          const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
          float v[kPer];
#pragma unroll
          for (int i = 0; i < kPer; ++i) {
            const int e = lane + i * kWarpSize;
            v[i] = e >= D       ? 0.0f
                   : warp == 0 ? __bfloat162float(__float2bfloat16_rn(
                                     rope_element(kv_row, e, a.rope_dim, a.rope_rotate_half, rope_cs, rope_sn)))
                               : __bfloat162float(kv_row[D + e]);
          }
          const int64_t soff = kv_scale_offset(slot, it.kvh, a.n_head_kv, a.block_size);
          warp_quantize_row_e4m3(v, D, static_cast<uint8_t*>(warp == 0 ? a.k_cache_out : a.v_cache_out) + off,
                                 (warp == 0 ? a.k_scale_out : a.v_scale_out) + soff);
        }
      } else {
        auto* kc = static_cast<__nv_bfloat16*>(a.k_cache_out);
        auto* vc = static_cast<__nv_bfloat16*>(a.v_cache_out);
        for (int e = threadIdx.x; e < D; e += kAttnThreads) {
          kc[off + e] = __float2bfloat16_rn(rope_element(kv_row, e, a.rope_dim, a.rope_rotate_half, rope_cs, rope_sn));
          vc[off + e] = kv_row[D + e];
        }
      }
      __threadfence();  // the writes reach L2, where this block's cp.async reads them
    }
    __syncthreads();
  }
  const __nv_bfloat16* q_rows = fused_rope ? a.rope_qkv + static_cast<int64_t>(it.token) * a.rope_qkv_stride
                                           : a.q + static_cast<int64_t>(it.token) * a.n_head * D;
  for (int i = threadIdx.x; i < kRows * kChunks; i += kAttnThreads) {
    const int r = i / kChunks, c = i % kChunks;
    const bool valid = r < it.n_rows;
    cp_async16(sq + swz<D>(r, c), q_rows + (valid ? static_cast<int64_t>(it.head0 + r) * D + c * 8 : 0), valid);
  }
  // Tile j's K and V loads, into stage j % kStages.
  auto load_tile = [&](int j) {
    if constexpr (kFp8) {
      load_kv_tile_fp8<D, kTile, kFragments>(fp8_stages + j % kStages * kFp8Stage, a, table, it.kvh,
                                             it.key_begin + j * kTile, it.key_end, key_lo);
    } else {
      __nv_bfloat16* sk = stages + j % kStages * kStage;
      load_kv_tile<D>(sk, sk + kKeyTile * kStride, a, table, it.kvh, it.key_begin + j * kKeyTile, it.key_end, key_lo);
    }
  };
  // Tiles 0 .. kStages - 2 (the first with Q), one commit group each.
  const int n_tiles = (it.key_end - it.key_begin + kTile - 1) / kTile;
#pragma unroll
  for (int j = 0; j < kStages - 1; ++j) {
    if (j < n_tiles) load_tile(j);
    cp_async_commit();
  }
  std::conditional_t<kFragments, QFragmentsF16<D>, QFragments<D>> qf;
  int v_exp = 0;  // kFragments: the V exponent rho (attend_tile_fp8)
  std::conditional_t<kFragments, WarpSoftmaxT<D>, WarpSoftmax<D>> st;
  if constexpr (kFragments) {
    st.init();
  } else {
    init_softmax(st);
  }
  for (int j = 0; j < n_tiles; ++j) {
    // Refill the stage computed in the previous iteration with tile j + kStages - 1 (every
    // iteration commits a group, maybe empty, so that tile j's is always kStages - 1 groups back).
    if (j + kStages - 1 < n_tiles) load_tile(j + kStages - 1);
    cp_async_commit();
    cp_async_wait<kStages - 1>();
    __syncthreads();
    if (j == 0) {
      if (fused_rope) {
        // Rotate the group's q rows in place: one pair per thread and step, as rope_write_kv does.
        const int half = a.rope_dim / 2;
        for (int i = threadIdx.x; i < it.n_rows * half; i += kAttnThreads) {
          const int r = i / half, p = i % half;
          const int e0 = a.rope_rotate_half ? p : 2 * p, e1 = a.rope_rotate_half ? p + half : 2 * p + 1;
          __nv_bfloat16* x0 = sq + swz<D>(r, e0 >> 3) + (e0 & 7);
          __nv_bfloat16* x1 = sq + swz<D>(r, e1 >> 3) + (e1 & 7);
          float y0, y1;
          rope_rotate(__bfloat162float(*x0), __bfloat162float(*x1), rope_cs[p], rope_sn[p], y0, y1);
          *x0 = __float2bfloat16_rn(y0);
          *x1 = __float2bfloat16_rn(y1);
        }
        __syncthreads();
      }
      if constexpr (kFragments) {
        qf.load(sq, a.scale_log2);
      } else {
        qf.load(sq, 0);
      }
    }
    const int key0 = it.key_begin + j * kTile;
    constexpr int kWarpKeys = kTile / kWarps;  // each warp's keys of the tile
    static_assert(!kFragments || kWarpKeys == 16 || kWarpKeys == 32);
    // The fragment path's 64- or 128-key tile may run past a split's end (split ranges are whole 64-key
    // tiles), so it masks keys from key_end on; the 64-key tiles end at a split's end or hold pos.
    const bool need_mask = (kFragments ? key0 + kTile > it.key_end : key0 + kTile - 1 > it.pos) || key0 < key_lo;
    if constexpr (kFragments) {
      attend_tile_fp8<D, kWarpKeys>(st, v_exp, qf, fp8_stages + j % kStages * kFp8Stage, warp * kWarpKeys, key0, need_mask,
                         it.key_end, key_lo);
    } else if constexpr (kFp8) {
      // The warp widens its own rows only, so a warp barrier suffices.
      const unsigned char* stage = fp8_stages + j % kStages * kFp8Stage;
      widen_kv_rows<D>(stage, wide, wide + kKeyTile * kStride, warp * kWarpKeys, kWarpKeys,
                       static_cast<int>(threadIdx.x) % kWarpSize, kWarpSize);
      __syncwarp();
      const auto* scales = reinterpret_cast<const float*>(stage + 2 * kKeyTile * D);
      attend_tile<D, kWarpKeys, true>(st, qf, wide, wide + kKeyTile * kStride, warp * kWarpKeys, key0, need_mask,
                                      it.pos, it.pos, key_lo, key_lo, a.scale_log2, scales, scales + kKeyTile);
    } else {
      const __nv_bfloat16* sk = stages + j % kStages * kStage;
      attend_tile<D, kWarpKeys>(st, qf, sk, sk + kKeyTile * kStride, warp * kWarpKeys, key0, need_mask, it.pos,
                                it.pos, key_lo, key_lo, a.scale_log2);
    }
    __syncthreads();  // this stage is refilled (or merged into) next
  }
  cp_async_wait<0>();  // only empty groups are left
  if constexpr (kFragments) {
    float* merge = reinterpret_cast<float*>(fp8_stages);  // every stage is consumed
    store_warp_state<D>(st, v_exp, it, merge, sml);
    combine_decode_item<D>(a, it, merge, sml);
  } else {
    float* merge = reinterpret_cast<float*>(kFp8 ? wide : stages + (n_tiles - 1) % kStages * kStage);
    store_warp_state<D>(st, it, merge, sml);
    combine_decode_item<D>(a, it, merge, sml);
  }
}

// Combines the split-KV partial results of each decode row: out = sum_s w_s O_s / sum_s w_s with
// w_s = 2^(lse_s - max lse), over the splits that split_key_range gives keys (of the row's
// decode_splits; a row with one split was written by the decode kernel). grid (n_part_rows,
// n_head), 128 threads. D = 0: a.head_dim (the SIMT kernel's head dims).
template <int D>
__global__ void __launch_bounds__(kAttnThreads) attention_reduce_kernel(AttnKernelArgs a) {
  KESTREL_PDL_ENTRY();
  const int dim = D > 0 ? D : a.head_dim;
  const int row = blockIdx.x, head = blockIdx.y;
  int seq = 0, token = 0;
  if (!decode_row(a, row, seq, token)) return;
  const int n_keys = a.positions[token] + 1;
  const int key_lo = first_key(n_keys - 1, a.window);
  const int n_splits = decode_splits(a, key_lo, n_keys);
  if (n_splits == 1) return;
  const int64_t stride = static_cast<int64_t>(a.n_part_rows) * a.n_head;  // between splits
  const int64_t first = static_cast<int64_t>(row) * a.n_head + head;
  float m = -INFINITY;
  for (int s = 0; s < n_splits; ++s) {
    const int2 keys = split_key_range(key_lo, n_keys, s, n_splits);
    if (keys.x < keys.y) m = fmaxf(m, a.part_lse[first + s * stride]);
  }
  for (int d = threadIdx.x; d < dim; d += kAttnThreads) {
    float num = 0.0f, den = 0.0f;
    for (int s = 0; s < n_splits; ++s) {
      const int2 keys = split_key_range(key_lo, n_keys, s, n_splits);
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
