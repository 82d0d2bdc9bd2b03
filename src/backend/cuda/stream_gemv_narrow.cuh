// Streaming GEMV over INT4 weights (the layout of int4_ops.h) for one or two tokens:
// stream_gemv.cuh's design (one block per SM over a contiguous range of whole rows, a cp.async
// ring of 32 KB stages with 16-byte copies, the first stages requested before
// griddepcontrol.wait, the input in shared memory with the fused SwiGLU or residual + RMSNorm of
// stream_gemv_input), with W counted in bytes instead of elements. (FP8 weights have their own
// kernel, stream_gemv_w8a8.cuh.)
// - A line is 4 KB of the block's byte range (thread t: bytes 16 t .. + 15), a warp's 512 bytes
//   a chunk. Rows are a multiple of 512 bytes (n_in % 1024), so a chunk lies in one row, but a
//   line may hold parts of several rows and a row need not start a line: each warp keeps the row
//   and the chunk's place in it as it walks its chunks.
// - A thread's 16 bytes are 32 INT4 codes of the layout's tile T, lane q (columns 128 T + 32 c +
//   8 q + e, word c, e = 0..7); x comes from shared memory (natural order) at those columns. The
//   order in which a lane walks its four words alternates between neighbouring quads so that a
//   quarter warp's 16-byte shared loads hit 32 distinct banks.
// - The products are summed on the tensor cores (mma.sync m16n8k16, bf16 in, f32 accumulate): a
//   chunk's 8 quads (tiles) are the 8 rows of A (rows 8-15 zero) and x at each tile's columns the
//   8 columns of B, so the diagonal of the 8 x 8 result holds each tile's dot product. A holds
//   q - z exactly as bf16: the {128 + q} pairs of the bf16 exponent trick minus {128 + z}
//   (int4_ops.h); a tile's sum (128 columns of one group: G >= 128) times its group scale. The
//   scale and zero words stream with the codes: a quad's leader copies its tile's meta word into
//   a small ring beside the code ring (4 bytes, cp.async.ca).
// - A stage's 8 lines are computed together (independent mma and shuffle chains); each chunk's 8
//   tile sums are reduced by a fixed butterfly and kept per (row, token, chunk of the row); a
//   row's chunk sums are added in chunk order at the end. A row's value depends on neither the
//   launch nor its place in the block (batch invariant, deterministic).
// Source: PTX ISA 8.x ("cp.async", "Matrix fragments for mma.m16n8k16"); the bf16 exponent trick
// and k permutation as in int4_gemm.cuh.
#pragma once

#include <algorithm>

#include "backend/cuda/int4_decode.cuh"
#include "backend/cuda/stream_gemv.cuh"

namespace kestrel::cuda {

constexpr int kNarrowLineBytes = kGemvThreads * 16;  // 4 KB
constexpr int kNarrowChunkBytes = kWarpSize * 16;    // 512 bytes: one warp's part of a line

// Dynamic shared memory of stream_gemv_narrow_kernel: the code ring, the meta ring (one word per
// line, warp and quad), x [kM][n_in] bf16, the chunk sums [rows][kM][chunks of a row] (at least 32
// floats: the fused norm's block reduction uses them first).
constexpr size_t stream_gemv_narrow_smem_bytes(int m, int stages, int k_lines, int rows_per_block,
                                               int chunks_per_row) {
  return static_cast<size_t>(stages) * kGemvLinesPerStage * kNarrowLineBytes +
         static_cast<size_t>(stages) * kGemvLinesPerStage * (kGemvThreads / 4) * 4 +
         static_cast<size_t>(m) * k_lines * kGemvThreads * 16 +
         static_cast<size_t>(std::max(rows_per_block * m * chunks_per_row, kWarpSize)) * 4;
}

// 4 bytes global -> shared (cp.async.ca: the only form below 16 bytes).
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem) {
#if defined(KESTREL_CUDA_EMULATE)
  emu::async_copy(smem, gmem, 4, 4);
#else
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_u32(smem)), "l"(__cvta_generic_to_global(gmem))
               : "memory");
#endif
}

// w: the layout's words, [n_out, row_bytes = n_in / 2]. scale: the meta words [n_out, n_in / G],
// meta_shift = log2(G / 2)
// (the meta word of code byte b of the matrix is b >> meta_shift), scale_f16 their scale type.
// x, x_stride, kSwiGLU, kNormIn and the norm operands as stream_gemv_kernel; y [kM, n_out] bf16.
// grid: ceil(n_out / rows_per_block) blocks of 256; n_in = k_lines x 2048.
template <int kM, int kStages, bool kSwiGLU, bool kNormIn>
__global__ void __launch_bounds__(kGemvThreads, 1)
    stream_gemv_narrow_kernel(const __nv_bfloat16* __restrict__ x, int64_t x_stride, const uint8_t* __restrict__ w,
                              const void* __restrict__ scale, int meta_shift, bool scale_f16,
                              __nv_bfloat16* __restrict__ y, int n_out, int k_lines, int row_bytes,
                              int rows_per_block, const float* __restrict__ res_in,
                              const __nv_bfloat16* __restrict__ add, const __nv_bfloat16* __restrict__ norm_w,
                              float* __restrict__ res_out, float eps) {
  constexpr int kMetaLine = kGemvThreads / 4;  // meta words of a line: one per quad
  KESTREL_DYNAMIC_SMEM(smem);
  const int t = static_cast<int>(threadIdx.x);
  const int warp = t / kWarpSize, lane = t % kWarpSize;
  uint4* ring = reinterpret_cast<uint4*>(smem);  // [kStages][lines][256]
  uint32_t* meta_ring = reinterpret_cast<uint32_t*>(ring + kStages * kGemvLinesPerStage * kGemvThreads);
  uint4* xs = reinterpret_cast<uint4*>(meta_ring + kStages * kGemvLinesPerStage * kMetaLine);
  float* part = reinterpret_cast<float*>(xs + kM * k_lines * kGemvThreads);  // [rows][kM][chunks]
  const int chunks_per_row = row_bytes / kNarrowChunkBytes;

  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * rows_per_block;
  const int rows = static_cast<int>(n_out - row0 < rows_per_block ? n_out - row0 : rows_per_block);
  const int64_t base = row0 * row_bytes;  // the block's first byte in w
  const int64_t total = static_cast<int64_t>(rows) * row_bytes;
  const int n_lines = static_cast<int>((total + kNarrowLineBytes - 1) / kNarrowLineBytes);
  const int n_stages = (n_lines + kGemvLinesPerStage - 1) / kGemvLinesPerStage;

  // Stage s into ring slot s % kStages; bytes past the block's range are neither copied nor read.
  auto issue = [&](int s) {
    if (s < n_stages) {
      uint4* dst = ring + (s % kStages) * kGemvLinesPerStage * kGemvThreads + t;
#pragma unroll
      for (int j = 0; j < kGemvLinesPerStage; ++j) {
        const int64_t off = static_cast<int64_t>(s * kGemvLinesPerStage + j) * kNarrowLineBytes + 16 * t;
        if (off < total) {
          cp_async16(dst + j * kGemvThreads, w + base + off, true);
          if (lane % 4 == 0)
            cp_async4(meta_ring + ((s % kStages) * kGemvLinesPerStage + j) * kMetaLine + t / 4,
                      static_cast<const uint32_t*>(scale) + ((base + off) >> meta_shift));
        }
      }
    }
    cp_async_commit();
  };
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) issue(s);
  pdl_wait();
  // The input's scratch is `part`: the main loop writes it only after the norm's last barrier.
  stream_gemv_input<kM, kSwiGLU, kNormIn>(xs, part, k_lines, x, x_stride, res_in, add, norm_w, res_out, eps);
  __syncthreads();  // x is read at every thread's columns, not only its own
  pdl_launch_next();

  const __nv_bfloat16* xh = reinterpret_cast<const __nv_bfloat16*>(xs);
  const int n_in = k_lines * kGemvLine;
  const int g = lane / 4, q = lane % 4;  // the lane's tile in the chunk, its place in the tile
  const int swap = g & 1;  // bank spread: neighbouring tiles walk their columns in another order
  // This warp's chunk of line 0: its row and byte offset in the row; each line moves it 4 KB on.
  int row = 0, cb = kNarrowChunkBytes * warp;
  while (cb >= row_bytes) cb -= row_bytes, ++row;
  for (int s = 0; s < n_stages; ++s) {
    issue(s + kStages - 1);
    cp_async_wait<kStages - 1>();  // stage s (this thread's part of it) has landed
    __syncwarp();  // the quad leaders' meta words, for their quads
    const uint4* src = ring + (s % kStages) * kGemvLinesPerStage * kGemvThreads + t;
    int line_row[kGemvLinesPerStage], line_cb[kGemvLinesPerStage];
#pragma unroll
    for (int j = 0; j < kGemvLinesPerStage; ++j) {
      line_row[j] = row, line_cb[j] = cb;
      cb += kNarrowLineBytes;
      while (cb >= row_bytes) cb -= row_bytes, ++row;
    }
    // Every line of the stage at once (independent chains; lines past the block's rows compute on
    // stale bytes and are not stored). Each line: the warp's 8 tiles (a tile: a quad's 64 bytes) as
    // the rows of an mma A operand (rows 8-15 zero), x of the same tiles as the columns of B, so the
    // diagonal of the 8 x 8 result holds each tile's dot product (lane 4 g + g / 2 has tile g's).
    float tile_sum[kGemvLinesPerStage][kM];
#pragma unroll
    for (int j = 0; j < kGemvLinesPerStage; ++j) {
      uint4 wv = src[j * kGemvThreads];
      float c[kM][4];
#pragma unroll
      for (int tok = 0; tok < kM; ++tok) c[tok][0] = c[tok][1] = c[tok][2] = c[tok][3] = 0.0f;
      // Tile T's lane q: word c holds columns 128 T + 32 c + 8 q .. + 7, its pairs {2 p, 2 p + 1}
      // (p = 0..3) q - z exactly; words in the order c = i ^ swap; pairs 0, 1 with x words 0, 1
      // are one mma, pairs 2, 3 with x words 2, 3 another (int4_gemm.cuh's k permutation).
      const int tile = line_cb[j] / 64 + g;
      const uint32_t m = meta_ring[((s % kStages) * kGemvLinesPerStage + j) * kMetaLine + t / 4];
      const uint32_t zz = int4_zero_pair(m);
      const float sc = int4_scale(m, scale_f16);
      if (swap) wv = make_uint4(wv.y, wv.x, wv.w, wv.z);
      const uint32_t words[4] = {wv.x, wv.y, wv.z, wv.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        uint32_t pr[4];
#pragma unroll
        for (int p = 0; p < 4; ++p) pr[p] = bf16x2_sub(((words[i] >> (4 * p)) & 0x000F000Fu) | 0x43004300u, zz);
        const uint32_t a0[4] = {pr[0], 0u, pr[1], 0u}, a1[4] = {pr[2], 0u, pr[3], 0u};
        const int kk = 128 * tile + 32 * (i ^ swap) + 8 * q;
#pragma unroll
        for (int tok = 0; tok < kM; ++tok) {
          const uint4 xv = *reinterpret_cast<const uint4*>(xh + tok * n_in + kk);
          const uint32_t b0[2] = {xv.x, xv.y}, b1[2] = {xv.z, xv.w};
          mma_bf16_16816(c[tok], a0, b0);
          mma_bf16_16816(c[tok], a1, b1);
        }
      }
      const bool diag = q == g / 2;
#pragma unroll
      for (int tok = 0; tok < kM; ++tok) tile_sum[j][tok] = diag ? (g & 1 ? c[tok][1] : c[tok][0]) * sc : 0.0f;
    }
    // Each line's 8 tile sums (the other lanes hold zeros) by a fixed butterfly, into its slot.
#pragma unroll
    for (int j = 0; j < kGemvLinesPerStage; ++j)
#pragma unroll
      for (int tok = 0; tok < kM; ++tok) {
        const float v = warp_reduce_sum(tile_sum[j][tok]);
        if (lane == 0 && line_row[j] < rows)
          part[(line_row[j] * kM + tok) * chunks_per_row + line_cb[j] / kNarrowChunkBytes] = v;
      }
    __syncwarp();  // the leaders' next copy into this slot waits for every read
  }
  cp_async_wait<0>();
  __syncthreads();
  for (int i = t; i < rows * kM; i += kGemvThreads) {
    const int r = i / kM, tok = i % kM;
    float sum = 0.0f;
    for (int c = 0; c < chunks_per_row; ++c) sum += part[i * chunks_per_row + c];
    y[static_cast<int64_t>(tok) * n_out + row0 + r] = __float2bfloat16_rn(sum);
  }
}

}  // namespace kestrel::cuda
