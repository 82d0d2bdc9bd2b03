// Streaming GEMV over INT4 weights (int4_ops.h's layout, groups of 128 columns) with bf16
// activations (W4A16) for one or two tokens: y[t, o] = sum_T s[o, T] sum_{k in T} a(x)[t, k]
// (q[o, k] - z[o, T]), the products exact (bf16 x small integers), each tile's sum f32 on the
// tensor cores, times its group scale in f32, one rounding to bf16. The frame is stream_gemv.cuh's
// and stream_gemv_w8a8.cuh's: one block per SM over a contiguous range of whole rows, the weights
// streamed through a cp.async ring whose first kStreamPreWaitSlabs stages are requested before
// griddepcontrol.wait and the rest behind the input's loads, the input formed in shared memory
// (x, SwiGLU or the fused residual + RMSNorm of stream_gemv_input), slabs requested by a cursor
// (no division in the loop). The product:
// - The block walks its rows in tiles of 16 and each tile's n_in in slabs of 2048 columns (16 rows
//   x 1 KB of codes, one ring stage, and the rows' 16 meta words each in a small ring beside it;
//   rows past the block's range are zero-filled, not read). In shared memory a slab is row-major,
//   16-byte chunk c of row r stored at chunk c ^ 4 (r & 1), so that a quarter warp's 16-byte loads
//   (two rows, the same 64 bytes of each) hit 32 distinct banks.
// - Warp w takes the 128-column tiles 2 w and 2 w + 1 of every slab (one group each), the slab's
//   rows as two halves of 8. Lane (g, tq) loads the 16 bytes of row g of a half that hold, per
//   word c = 0..3, the 8 columns 32 c + 8 tq .. + 7 of the tile; a shift and a mask of a word give
//   the bf16 pairs {128 + q} of columns {2 p, 2 p + 1} (p = 0..3), less the pair {128 + z}: q - z
//   exactly. One mma.m16n8k16 (bf16 in, f32 out) per word and half: the mma's A rows g and g + 8
//   are both row g of the half, over the word's pairs 0, 1 and 2, 3 respectively, and B's column
//   2 m + h holds token m's x at the columns of pair set h (lanes g = 2 m + h load them, 8 bytes),
//   so C[g][2 m] + C[g + 8][2 m + 1] is row g's sum for token m over the 32 columns the four lanes
//   tq hold, and no weight is loaded or converted twice. A tile's four mma accumulate in f32 from
//   zero; the sum times the group scale is added to the row's f32 sum.
// - A tile row's per-warp sums meet in shared memory and are added in warp order at the end, so a
//   row's value depends on neither the launch nor its place in the block (batch invariant).
// Source: PTX ISA 8.x ("Matrix fragments for mma.m16n8k16", "cp.async"); the bf16 exponent trick
// as in int4_gemm.cuh.
#pragma once

#include "backend/cuda/int4_decode.cuh"
#include "backend/cuda/stream_gemv.cuh"
#include "backend/cuda/stream_trace.cuh"

namespace kestrel::cuda {

constexpr int kW4a16SlabRows = 16;
constexpr int kW4a16RowBytes = kGemvLine / 2;                     // 1 KB: 2048 codes of a row
constexpr int kW4a16SlabBytes = kW4a16SlabRows * kW4a16RowBytes;  // 16 KB
constexpr int kW4a16TileCols = 128;                               // the group size it takes
constexpr int kW4a16SlabMeta = kW4a16SlabRows * (kGemvLine / kW4a16TileCols);  // 256 meta words
// Ring depth: 128 KB of codes, one block an SM. Measured on an H200 for the 8B's projections:
// two blocks an SM with rings of 4 or 5 slabs were no faster (gate|up 24.8-25.8 against 24.3 us)
// and slower in the model (batch-1 decode 381 against 428 tok/s); deeper rings of 10 or 12 slabs
// were no faster either (gate|up 25.3 / 25.8 us; the model 409 tok/s).
constexpr int kW4a16Stages = 8;

// Dynamic shared memory of stream_gemv_w4a16_kernel: the code ring, the meta ring, x [kM][n_in]
// bf16, the per-warp row sums [rows][kM][warps], and 32 floats of scratch.
constexpr size_t stream_gemv_w4a16_smem_bytes(int m, int stages, int k_lines, int rows_per_block) {
  return static_cast<size_t>(stages) * (kW4a16SlabBytes + kW4a16SlabMeta * 4) +
         static_cast<size_t>(m) * k_lines * kGemvLine * 2 +
         (static_cast<size_t>(rows_per_block) * m * kGemvWarps + kWarpSize) * 4;
}

// w: the layout's code words as bytes, [n_out, n_in / 2]; meta: [n_out, n_in / 128] words (scale
// bits as stored, scale_f16 says which, and the bf16 of 128 + z); x, x_stride, kSwiGLU, kNormIn and
// the norm operands as stream_gemv_kernel's; y [kM, n_out] bf16. grid: ceil(n_out /
// rows_per_block) blocks of 256; n_in = k_lines x 2048. pf: the next projection's weights
// (StreamPrefetch).
template <int kM, int kStages, bool kSwiGLU, bool kNormIn>
__global__ void __launch_bounds__(kGemvThreads, 1)
    stream_gemv_w4a16_kernel(const __nv_bfloat16* __restrict__ x, int64_t x_stride, const uint8_t* __restrict__ w,
                             const uint32_t* __restrict__ meta, bool scale_f16, __nv_bfloat16* __restrict__ y,
                             int n_out, int k_lines, int rows_per_block, const float* __restrict__ res_in,
                             const __nv_bfloat16* __restrict__ add, const __nv_bfloat16* __restrict__ norm_w,
                             float* __restrict__ res_out, float eps, StreamPrefetch pf) {
  static_assert(kM == 1 || kM == 2, "one or two tokens");
  constexpr int kTilesPerLine = kGemvLine / kW4a16TileCols;  // 16 meta words of a row per slab
  KESTREL_DYNAMIC_SMEM(smem);
  const int t = static_cast<int>(threadIdx.x);
  const int warp = t / kWarpSize, lane = t % kWarpSize;
  const int n_in = k_lines * kGemvLine;
  const int row_bytes = n_in / 2, n_groups = n_in / kW4a16TileCols;
  StreamTraceMarks trace;
  trace.mark(0);
  constexpr int kPreWait = kStreamPreWait<kStages>;
  uint8_t* ring = smem;                                                                // [kStages][16][1 KB]
  uint32_t* meta_ring = reinterpret_cast<uint32_t*>(ring + kStages * kW4a16SlabBytes);  // [kStages][16][16]
  uint4* xs = reinterpret_cast<uint4*>(meta_ring + kStages * kW4a16SlabMeta);          // [kM][n_in] bf16
  float* part = reinterpret_cast<float*>(xs + kM * k_lines * kGemvThreads);            // [rows][kM][warps]
  float* scratch = part + rows_per_block * kM * kGemvWarps;                            // [32]

  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * rows_per_block;
  const int rows = static_cast<int>(n_out - row0 < rows_per_block ? n_out - row0 : rows_per_block);
  const int n_slabs = (rows + kW4a16SlabRows - 1) / kW4a16SlabRows * k_lines;

  // Slab q (tile q / k_lines, columns 2048 (q % k_lines) ..) into ring slot q % kStages: thread t
  // copies row t / 16 of the tile, its 16-byte chunks t % 16 + 16 j (j = 0..3: a warp's copy is two
  // rows' 256 contiguous bytes), from one source pointer at constant offsets, so a copy costs one
  // instruction; threads 0..63 also copy the 16-byte quarter t % 4 of row t / 4's meta words.
  const int cp_row = t / 16, cp_chunk = t % 16;
  // Chunk cp_chunk + 16 j of the row lands at dst_off + 256 j (the swizzle flips bit 2 of the chunk).
  const int dst_off = cp_row * kW4a16RowBytes + 16 * (cp_chunk ^ ((cp_row & 1) << 2));
  const int m_row = t / 4, m_quarter = t % 4;
  const bool meta_thread = t < kW4a16SlabRows * 4;
  const uint8_t* i_src = w + (row0 + cp_row) * row_bytes + 16 * cp_chunk;  // the next slab's first chunk
  const uint32_t* i_meta = meta + (row0 + (meta_thread ? m_row : 0)) * n_groups + 4 * m_quarter;
  const int64_t src_tile_step = kW4a16SlabRows * static_cast<int64_t>(row_bytes) - k_lines * kW4a16RowBytes;
  const int64_t meta_tile_step = kW4a16SlabRows * static_cast<int64_t>(n_groups) - k_lines * kTilesPerLine;
  bool i_live = cp_row < rows, m_live = meta_thread && m_row < rows;  // rows past the block: zero-filled
  int i_q = 0, i_kb = 0, i_tile_row = 0, i_slot = 0;
  auto issue_next = [&]() {
    if (i_q < n_slabs) {
      uint8_t* dst = ring + i_slot * kW4a16SlabBytes + dst_off;
      const uint8_t* src = i_live ? i_src : w;
#pragma unroll
      for (int j = 0; j < 4; ++j) cp_async16(dst + 256 * j, src + 256 * j, i_live);
      if (meta_thread)
        cp_async16(meta_ring + i_slot * kW4a16SlabMeta + m_row * kTilesPerLine + 4 * m_quarter,
                   m_live ? i_meta : meta, m_live);
    } else if (i_q == n_slabs) {
      stream_prefetch_next(pf);
    }
    cp_async_commit();
    ++i_q;
    i_slot = i_slot + 1 == kStages ? 0 : i_slot + 1;
    i_src += kW4a16RowBytes;
    i_meta += kTilesPerLine;
    if (++i_kb == k_lines) {
      i_kb = 0;
      i_src += src_tile_step;
      i_meta += meta_tile_step;
      i_tile_row += kW4a16SlabRows;
      i_live = i_tile_row + cp_row < rows;
      m_live = meta_thread && i_tile_row + m_row < rows;
    }
  };
#pragma unroll
  for (int q = 0; q < kPreWait; ++q) issue_next();
  pdl_wait();
  trace.mark(1);
  stream_gemv_input<kM, kSwiGLU, kNormIn>(xs, scratch, k_lines, x, x_stride, res_in, add, norm_w, res_out, eps,
                                          [&] {
#pragma unroll
                                            for (int q = kPreWait; q < kStages - 1; ++q) issue_next();
                                          });
  __syncthreads();  // x is read at every thread's columns, not only its own
  pdl_launch_next();
  trace.mark(2);

  const __nv_bfloat16* xh = reinterpret_cast<const __nv_bfloat16*>(xs);
  const int g = lane / 4, tq = lane % 4;
  const int swz = (g & 1) << 2;  // rows g and 8 + g have g's parity
  const bool x_lane = g < 2 * kM;  // lanes g = 2 m + h feed B's column of token m, half h
  // Lane (g, tq)'s x: token g / 2, columns 8 tq + 4 (g & 1) .. + 3 of word c of tile u of the warp.
  const __nv_bfloat16* xrow = xh + (x_lane ? g / 2 : 0) * n_in + 256 * warp + 8 * tq + 4 * (g & 1);
  int a_off[2];  // the lane's 16 bytes of row g in tile 2 warp + u of a slab
#pragma unroll
  for (int u = 0; u < 2; ++u) a_off[u] = g * kW4a16RowBytes + 16 * ((4 * (2 * warp + u) + tq) ^ swz);
  float acc[2] = {0.0f, 0.0f};  // rows g and 8 + g of the tile: token tq's sums (lanes tq < kM)
  // A slab's shared loads of this lane: x of its 2 tiles x 4 words, the 2 x 2 (tile, tile row) meta
  // words and code words. They are loaded one slab ahead of the products (two register sets, the
  // loop unrolled by two so that neither is copied), so that no warp waits on its shared loads.
  struct Frag {
    uint32_t b[2][4][2], m[2][2], w[2][2][4];
  };
  auto load = [&](Frag& f, int slot, int kb) {
    const uint8_t* slab = ring + slot * kW4a16SlabBytes;
    const uint32_t* slab_meta = meta_ring + slot * kW4a16SlabMeta;
    const __nv_bfloat16* xb = xrow + kb * kGemvLine;
#pragma unroll
    for (int u = 0; u < 2; ++u) {
#pragma unroll
      for (int cw = 0; cw < 4; ++cw) {
        const uint2 v = x_lane ? *reinterpret_cast<const uint2*>(xb + 128 * u + 32 * cw) : make_uint2(0, 0);
        f.b[u][cw][0] = v.x, f.b[u][cw][1] = v.y;
      }
#pragma unroll
      for (int rt = 0; rt < 2; ++rt) {
        const uint4 v = *reinterpret_cast<const uint4*>(slab + rt * 8 * kW4a16RowBytes + a_off[u]);
        f.w[u][rt][0] = v.x, f.w[u][rt][1] = v.y, f.w[u][rt][2] = v.z, f.w[u][rt][3] = v.w;
        f.m[u][rt] = slab_meta[(rt * 8 + g) * kTilesPerLine + 2 * warp + u];
      }
    }
  };
  // The four (tile, tile row) chains interleaved word by word: the mma.sync wrapper is volatile, so
  // the order written is the order issued, and each mma follows the other chains', not its own
  // accumulator's.
  auto compute = [&](const Frag& f) {
    float d[2][2][4] = {};
#pragma unroll
    for (int cw = 0; cw < 4; ++cw)
#pragma unroll
      for (int u = 0; u < 2; ++u)
#pragma unroll
        for (int rt = 0; rt < 2; ++rt) {
          const uint32_t word = f.w[u][rt][cw], zz = int4_zero_pair(f.m[u][rt]);
          uint32_t pr[4];
#pragma unroll
          for (int p = 0; p < 4; ++p) pr[p] = bf16x2_sub(int4_bf16_pair(word >> (4 * p)), zz);
          const uint32_t a[4] = {pr[0], pr[2], pr[1], pr[3]};
          mma_bf16_16816(d[u][rt], a, f.b[u][cw]);
        }
#pragma unroll
    for (int rt = 0; rt < 2; ++rt)
#pragma unroll
      for (int u = 0; u < 2; ++u) acc[rt] += (d[u][rt][0] + d[u][rt][3]) * int4_scale(f.m[u][rt], scale_f16);
  };
  int c_kb = 0, c_row = 0, c_slot = 0;  // the slab computed next: its column line, tile row, slot
  int l_kb = 0, l_slot = 0;             // the slab loaded next
  // Slab q + 1 (this thread's copies) landed, then the barrier: every thread's copies of it are
  // visible and every warp's loads of slab q (one iteration earlier) are done, so slab q - 1's
  // slot may take a new slab. Then slab q + 1's loads, then slab q's products.
  auto step = [&](Frag& cur, Frag& nxt, int q) {
    cp_async_wait<kStages - 3>();
    __syncthreads();
    issue_next();
    if (q + 1 < n_slabs) {
      l_slot = l_slot + 1 == kStages ? 0 : l_slot + 1;
      if (++l_kb == k_lines) l_kb = 0;
      load(nxt, l_slot, l_kb);
    }
    compute(cur);
    c_slot = c_slot + 1 == kStages ? 0 : c_slot + 1;
    if (++c_kb == k_lines) {
#pragma unroll
      for (int rt = 0; rt < 2; ++rt) {
        const int row = c_row + rt * 8 + g;
        if (tq < kM && row < rows) part[(row * kM + tq) * kGemvWarps + warp] = acc[rt];
        acc[rt] = 0.0f;
      }
      c_kb = 0;
      c_row += kW4a16SlabRows;
    }
  };
  Frag fa, fb;
  cp_async_wait<kStages - 2>();
  __syncthreads();  // slab 0 landed for every thread
  trace.mark(3);
  load(fa, 0, 0);
  for (int q = 0; q < n_slabs; q += 2) {
    step(fa, fb, q);
    if (q + 1 < n_slabs) step(fb, fa, q + 1);
  }
  trace.mark(4);
  cp_async_wait<0>();
  __syncthreads();
  for (int i = t; i < rows * kM; i += kGemvThreads) {
    const int r = i / kM, mm = i % kM;
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < kGemvWarps; ++j) sum += part[i * kGemvWarps + j];
    y[static_cast<int64_t>(mm) * n_out + row0 + r] = __float2bfloat16_rn(sum);
  }
  trace.finish(n_out, k_lines);
}

}  // namespace kestrel::cuda
