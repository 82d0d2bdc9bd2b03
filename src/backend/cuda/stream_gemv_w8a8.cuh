// Streaming GEMV over FP8 E4M3 weight rows with E4M3 activations (W8A8) for one or two tokens:
// y[t, o] = w_scale[o] * x_scale[t] * sum_k e4m3(w[o, k]) * e4m3(a(x)[t, k] / x_scale[t]), with
// x_scale[t] = max_k |a(x)[t, k]| / 448 (quantize_rows_fp8's per-token scale and rounding, so a
// decode step multiplies as the W8A8 prefill GEMM does). The frame is stream_gemv.cuh's: one block
// per SM over tiles of 8 whole rows (StreamTiles: some fixed, the rest claimed in turn), the
// weights streamed through a cp.async ring
// whose first kStreamPreWaitSlabs stages are requested before griddepcontrol.wait and the rest
// behind the input's loads, the input formed in shared memory (x, SwiGLU or the fused residual +
// RMSNorm of stream_gemv_input), then rounded to E4M3 with the division done by the reciprocal
// (quotient_by_reciprocal: the same codes; at 14,336 columns the divisions had taken two thirds
// of a block's input time).
// What differs is the product:
// - The block walks each of its tiles' n_in in slabs of 2048 columns (16 KB, one ring stage; rows
//   past n_out are zero-filled, not read). In shared memory a
//   slab is row-major, 16-byte chunk c of row r stored at chunk c ^ 4 (r & 1) so that the quarter
//   warps' 16-byte loads below hit 32 distinct banks.
// - Warp w takes columns 256 w .. 256 w + 255 of every slab, four mma.m16n8k32 (E4M3 in, f32
//   out) of 64 columns each. Lane (g, t) loads the 16 codes 16 t .. 16 t + 15 of row g in one
//   load: bytes 0..7 are its A fragment's row g (a[0], a[2]) and bytes 8..15 its row g + 8 (a[1],
//   a[3]). So A's 16 rows are the tile's 8 rows twice, over two halves of the columns, and B's
//   column 2 m + h holds token m's activation codes at the columns of half h (lanes g = 2 m + h
//   load them; a dot product does not care in which order its k come as long as A and B share
//   it): C[g][2 m] + C[g + 8][2 m + 1] is row g's sum for token m, with no product wasted on A.
// - Each mma starts from zero and its four sums are added to f32 registers (the FP8 tensor
//   cores' internal accumulation is narrower than f32; 32 products per mma, then f32 adds); a
//   tile's per-warp sums meet in shared memory and are added in warp order one slab after its
//   last, so a row's value depends on neither the launch nor the block that computes it.
// Source: PTX ISA 8.x ("mma.m16n8k32" fragments, "cvt" e4m3x2, "cp.async"); the per-token dynamic
// activation scale is the FP8 W8A8 scheme of vLLM's and TensorRT-LLM's FP8 linear layers.
#pragma once

#include "backend/cuda/fp8.cuh"
#include "backend/cuda/kv_fp8.cuh"  // cp_async4
#include "backend/cuda/stream_gemv.cuh"
#include "backend/cuda/stream_trace.cuh"

namespace kestrel::cuda {

constexpr int kW8a8SlabRows = 8;
constexpr int kW8a8SlabBytes = kW8a8SlabRows * kGemvLine;  // 16 KB: 8 rows x 2048 codes
constexpr int kW8a8Stages1 = 8;  // ring depth at one token (128 KB, seven slabs in flight)
constexpr int kW8a8Stages2 = 6;  // at two (x and its codes take more)

// Dynamic shared memory of stream_gemv_w8a8_kernel: the ring, x [kM][n_in] bf16, its codes
// [kM][n_in], the per-warp row sums of two tiles [2][8][kM][8], the row scales of the tiles in
// flight [16][8], the claimed tile ids [16], the token scales, and 32 floats of scratch.
// One block per SM: a ring that left room for the next projection's block beside it (six slabs,
// 2 blocks an SM) made the 8B's batch-1 decode slower on the H200 (258.6 against 325.3 tok/s).
constexpr size_t stream_gemv_w8a8_smem_bytes(int m, int stages, int k_lines) {
  return static_cast<size_t>(stages) * kW8a8SlabBytes + static_cast<size_t>(m) * k_lines * kGemvLine * 3 +
         (static_cast<size_t>(2 * kW8a8SlabRows) * m * kGemvWarps + StreamTiles::kIds * (kW8a8SlabRows + 1) + 2 +
          kWarpSize) *
             4;
}

// w [n_out, n_in] E4M3 codes, w_scale [n_out] f32; x, x_stride, kSwiGLU, kNormIn and the norm
// operands as stream_gemv_kernel's; y [kM, n_out] bf16. grid: at most ceil(n_out / 8) blocks of
// 256; n_in = k_lines x 2048. counter: StreamTiles' (null: fixed tiles). pf: the next projection's
// weights (StreamPrefetch).
template <int kM, int kStages, bool kSwiGLU, bool kNormIn>
__global__ void __launch_bounds__(kGemvThreads, 1)
    stream_gemv_w8a8_kernel(const __nv_bfloat16* __restrict__ x, int64_t x_stride, const uint8_t* __restrict__ w,
                            const float* __restrict__ w_scale, __nv_bfloat16* __restrict__ y, int n_out, int k_lines,
                            int* tile_counter, const float* __restrict__ res_in, const __nv_bfloat16* __restrict__ add,
                            const __nv_bfloat16* __restrict__ norm_w, float* __restrict__ res_out, float eps,
                            StreamPrefetch pf) {
  static_assert(kM == 1 || kM == 2, "one or two tokens");
  KESTREL_DYNAMIC_SMEM(smem);
  const int t = static_cast<int>(threadIdx.x);
  const int warp = t / kWarpSize, lane = t % kWarpSize;
  const int n_in = k_lines * kGemvLine;
  StreamTraceMarks trace;
  trace.mark(0);
  constexpr int kPreWait = kStreamPreWait<kStages>;
  static_assert(kPreWait < kStages - 1, "calls between the wait and the main loop claim its first tiles");
  uint8_t* ring = smem;                                                        // [kStages][8][2048]
  uint4* xs = reinterpret_cast<uint4*>(ring + kStages * kW8a8SlabBytes);       // [kM][n_in] bf16
  uint8_t* xq = reinterpret_cast<uint8_t*>(xs + kM * k_lines * kGemvThreads);  // [kM][n_in] codes
  float* part = reinterpret_cast<float*>(xq + kM * n_in);                      // [2][8][kM][warps]
  float* row_scale = part + 2 * kW8a8SlabRows * kM * kGemvWarps;                // [kIds][8]
  int* tile_ids = reinterpret_cast<int*>(row_scale + StreamTiles::kIds * kW8a8SlabRows);  // [kIds]
  float* x_scale = reinterpret_cast<float*>(tile_ids + StreamTiles::kIds);   // [kM]
  float* scratch = x_scale + 2;                                             // [32]

  const int n_tiles = (n_out + kW8a8SlabRows - 1) / kW8a8SlabRows;
  StreamTiles tiles(tile_counter, n_tiles, k_lines, kStages - 1, tile_ids);

  // Slabs are requested in order by a cursor: slab kb of the block's tile n into the next ring slot;
  // thread t copies chunk t % 128 of rows t / 128, + 2, + 4, + 6 of the tile (a warp: 512
  // contiguous bytes of a row), threads 0..7 also the tile's row scales with its first slab.
  const int c = t % 128, r0 = t / 128;
  const int dst_off = r0 * kGemvLine + 16 * (c ^ ((r0 & 1) << 2));  // rows r0 + 2 j: + 2 j lines
  const int64_t row_step = 2 * static_cast<int64_t>(n_in);
  const uint8_t* i_tile = w;  // row r0 of the tile being requested, at column 16 c
  int i_n = 0, i_kb = 0, i_slot = 0, i_rows = 0, i_call = 0;
  bool i_live = false, prefetched = false;
  auto issue_next = [&](bool in_loop) {
    if (i_kb == 0) {  // a tile's first slab: its id (a claim stored a barrier ago)
      const int id = tiles.id(i_n);
      i_live = id < n_tiles;
      if (i_live) {
        i_rows = min(kW8a8SlabRows, n_out - id * kW8a8SlabRows);
        i_tile = w + (static_cast<int64_t>(id) * kW8a8SlabRows + r0) * n_in + 16 * c;
        if (t < kW8a8SlabRows)
          cp_async4(row_scale + (i_n % StreamTiles::kIds) * kW8a8SlabRows + t,
                    w_scale + (t < i_rows ? id * kW8a8SlabRows + t : 0), t < i_rows);
      }
    }
    if (i_call >= kStreamPreWait<kStages>) tiles.on_issue(i_call, in_loop);
    if (i_live) {
      uint8_t* dst = ring + i_slot * kW8a8SlabBytes + dst_off;
      const uint8_t* src = i_tile + i_kb * kGemvLine;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const bool live = r0 + 2 * j < i_rows;
        cp_async16(dst + 2 * j * kGemvLine, live ? src : w, live);
        src += row_step;
      }
    } else if (!prefetched) {
      stream_prefetch_next(pf);
      prefetched = true;
    }
    cp_async_commit();
    ++i_call;
    i_slot = i_slot + 1 == kStages ? 0 : i_slot + 1;
    if (i_live && ++i_kb == k_lines) i_kb = 0, ++i_n;
  };
#pragma unroll
  for (int q = 0; q < kPreWait; ++q) issue_next(false);
  pdl_wait();
  trace.mark(1);
  stream_gemv_input<kM, kSwiGLU, kNormIn>(xs, scratch, k_lines, x, x_stride, res_in, add, norm_w, res_out, eps,
                                          [&] {
#pragma unroll
                                            for (int q = kPreWait; q < kStages - 1; ++q) issue_next(false);
                                          });

  // Per-token scale (the largest |a| over the block's threads, each holding 8 columns a line)
  // and the codes, each thread writing its own columns.
  {
    const __nv_bfloat16* xh = reinterpret_cast<const __nv_bfloat16*>(xs);
    float amax[kM];
#pragma unroll
    for (int m = 0; m < kM; ++m) {
      amax[m] = 0.0f;
      for (int kb = 0; kb < k_lines; ++kb) {
        float f[8];
        unpack_bf16x8(*reinterpret_cast<const uint4*>(xh + m * n_in + kb * kGemvLine + 8 * t), f);
#pragma unroll
        for (int e = 0; e < 8; ++e) amax[m] = fmaxf(amax[m], fabsf(f[e]));
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) amax[m] = fmaxf(amax[m], __shfl_xor_sync(0xffffffffu, amax[m], o));
    }
    __syncthreads();  // the norm's last use of scratch is over
    if (lane == 0)
#pragma unroll
      for (int m = 0; m < kM; ++m) scratch[warp * kM + m] = amax[m];
    __syncthreads();
#pragma unroll
    for (int m = 0; m < kM; ++m) {
      float a = 0.0f;
#pragma unroll
      for (int i = 0; i < kGemvWarps; ++i) a = fmaxf(a, scratch[i * kM + m]);
      const float s = a > 0.0f ? a / kFp8E4m3Max : 1.0f;
      if (t == 0) x_scale[m] = s;
      // f / s, each code as quantize_rows_fp8 makes it (quotient_by_reciprocal).
      const float rs = 1.0f / s;
      const bool by_reciprocal = s >= kQuotientByReciprocalMinScale;
      auto quotient = [&](float f) { return by_reciprocal ? quotient_by_reciprocal(f, s, rs) : f / s; };
      for (int kb = 0; kb < k_lines; ++kb) {
        float f[8];
        unpack_bf16x8(*reinterpret_cast<const uint4*>(xh + m * n_in + kb * kGemvLine + 8 * t), f);
#pragma unroll
        for (int e = 0; e < 8; ++e) f[e] = quotient(f[e]);
        const uint32_t lo = f32x2_to_e4m3x2(f[0], f[1]) | (f32x2_to_e4m3x2(f[2], f[3]) << 16);
        const uint32_t hi = f32x2_to_e4m3x2(f[4], f[5]) | (f32x2_to_e4m3x2(f[6], f[7]) << 16);
        *reinterpret_cast<uint2*>(xq + m * n_in + kb * kGemvLine + 8 * t) = make_uint2(lo, hi);
      }
    }
  }
  __syncthreads();  // every thread's codes are read by others
  pdl_launch_next();
  trace.mark(2);

  const int g = lane / 4, tq = lane % 4;
  const int swz = (g & 1) << 2;
  const bool x_lane = g < 2 * kM;  // lanes g = 2 m + h feed B's column of token m, half h
  const uint8_t* xrow = xq + (x_lane ? g / 2 : 0) * n_in + 8 * (g & 1);
  // Chunk 16 warp + 4 i + tq of the slab: lane (g, tq)'s 16 codes of row g for mma i, and x there.
  int a_off[4], b_off[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int ch = 16 * warp + 4 * i + tq;
    a_off[i] = g * kGemvLine + 16 * (ch ^ swz);
    b_off[i] = 16 * ch;
  }
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // row g's sums for token tq (lanes tq < kM), per mma
  // Tile n's sums, once its part[n % 2] is written and a barrier passed: thread r kM + m adds row r's
  // per-warp sums for token m in warp order.
  auto finish_tile = [&](int n) {
    const int id = tiles.id(n);
    if (t >= kW8a8SlabRows * kM) return;
    const int r = t / kM, m = t % kM, row = id * kW8a8SlabRows + r;
    if (row >= n_out) return;
    const float* p = part + ((n % 2) * kW8a8SlabRows * kM + t) * kGemvWarps;
    float sum = 0.0f;
#pragma unroll
    for (int v = 0; v < kGemvWarps; ++v) sum += p[v];
    const float ws = row_scale[(n % StreamTiles::kIds) * kW8a8SlabRows + r];
    y[static_cast<int64_t>(m) * n_out + row] = __float2bfloat16_rn(sum * x_scale[m] * ws);
  };
  tiles.flush();
  int c_n = 0, c_kb = 0, c_slot = 0;  // the slab computed: its block tile, column line, slot
  int done_n = -1;                    // a tile whose sums are written, not yet added
  for (int q = 0; tiles.id(c_n) < n_tiles; ++q) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // slab q landed for every thread; slab q - 1's slot is free
    if (q == 0) trace.mark(3);
    if (done_n >= 0) finish_tile(done_n), done_n = -1;
    issue_next(true);
    const uint8_t* slab = ring + c_slot * kW8a8SlabBytes;
    const uint8_t* xb = xrow + c_kb * kGemvLine;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint4 a = *reinterpret_cast<const uint4*>(slab + a_off[i]);
      const uint2 b = x_lane ? *reinterpret_cast<const uint2*>(xb + b_off[i]) : make_uint2(0, 0);
      const uint32_t fa[4] = {a.x, a.z, a.y, a.w};
      const uint32_t fb[2] = {b.x, b.y};
      float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      mma_e4m3_16832(d, fa, fb);
      acc[i] += d[0] + d[3];
    }
    c_slot = c_slot + 1 == kStages ? 0 : c_slot + 1;
    if (++c_kb == k_lines) {
      if (tq < kM)
        part[(((c_n % 2) * kW8a8SlabRows + g) * kM + tq) * kGemvWarps + warp] = (acc[0] + acc[1]) + (acc[2] + acc[3]);
      acc[0] = acc[1] = acc[2] = acc[3] = 0.0f;
      done_n = c_n;
      c_kb = 0;
      ++c_n;
    }
  }
  trace.mark(4);
  cp_async_wait<0>();
  __syncthreads();
  if (done_n >= 0) finish_tile(done_n);
  tiles.finish();
  trace.finish(n_out, k_lines);
}

}  // namespace kestrel::cuda
