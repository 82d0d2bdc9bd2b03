// Streaming GEMV over FP8 E4M3 weight rows with E4M3 activations (W8A8) for one or two tokens:
// y[t, o] = w_scale[o] * x_scale[t] * sum_k e4m3(w[o, k]) * e4m3(a(x)[t, k] / x_scale[t]), with
// x_scale[t] = max_k |a(x)[t, k]| / 448 (quantize_rows_fp8's per-token scale and rounding, so a
// decode step multiplies as the W8A8 prefill GEMM does). The frame is stream_gemv.cuh's: one block
// per SM over a contiguous range of whole rows, the weights streamed through a cp.async ring
// whose first kStreamPreWaitSlabs stages are requested before griddepcontrol.wait and the rest
// behind the input's loads, the input formed in shared memory (x, SwiGLU or the fused residual +
// RMSNorm of stream_gemv_input), then rounded to E4M3 with the division done by the reciprocal
// (quotient_by_reciprocal: the same codes; at 14,336 columns the divisions had taken two thirds
// of a block's input time).
// What differs is the product:
// - The block walks its rows in tiles of 8 and each tile's n_in in slabs of 2048 columns (16 KB,
//   one ring stage; rows past the block's range are zero-filled, not read). In shared memory a
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
//   tile's per-warp sums meet in shared memory and are added in warp order at the end, so a row's
//   value depends on neither the launch nor its place in the block.
// Source: PTX ISA 8.x ("mma.m16n8k32" fragments, "cvt" e4m3x2, "cp.async"); the per-token dynamic
// activation scale is the FP8 W8A8 scheme of vLLM's and TensorRT-LLM's FP8 linear layers.
#pragma once

#include "backend/cuda/fp8.cuh"
#include "backend/cuda/stream_gemv.cuh"
#include "backend/cuda/stream_trace.cuh"

namespace kestrel::cuda {

constexpr int kW8a8SlabRows = 8;
constexpr int kW8a8SlabBytes = kW8a8SlabRows * kGemvLine;  // 16 KB: 8 rows x 2048 codes
constexpr int kW8a8Stages1 = 8;  // ring depth at one token (128 KB, seven slabs in flight)
constexpr int kW8a8Stages2 = 6;  // at two (x and its codes take more)

// Dynamic shared memory of stream_gemv_w8a8_kernel: the ring, x [kM][n_in] bf16, its codes
// [kM][n_in], the per-warp row sums [rows][kM][8], the token scales, and 32 floats of scratch.
// One block per SM: a ring that left room for the next projection's block beside it (six slabs,
// 2 blocks an SM) made the 8B's batch-1 decode slower on the H200 (258.6 against 325.3 tok/s).
constexpr size_t stream_gemv_w8a8_smem_bytes(int m, int stages, int k_lines, int rows_per_block) {
  return static_cast<size_t>(stages) * kW8a8SlabBytes + static_cast<size_t>(m) * k_lines * kGemvLine * 3 +
         (static_cast<size_t>(rows_per_block) * m * kGemvWarps + 2 + kWarpSize) * 4;
}

// w [n_out, n_in] E4M3 codes, w_scale [n_out] f32; x, x_stride, kSwiGLU, kNormIn and the norm
// operands as stream_gemv_kernel's; y [kM, n_out] bf16. grid: ceil(n_out / rows_per_block)
// blocks of 256; n_in = k_lines x 2048; at most 256 rows a block. pf: the next projection's
// weights (StreamPrefetch).
template <int kM, int kStages, bool kSwiGLU, bool kNormIn>
__global__ void __launch_bounds__(kGemvThreads, 1)
    stream_gemv_w8a8_kernel(const __nv_bfloat16* __restrict__ x, int64_t x_stride, const uint8_t* __restrict__ w,
                            const float* __restrict__ w_scale, __nv_bfloat16* __restrict__ y, int n_out, int k_lines,
                            int rows_per_block, const float* __restrict__ res_in, const __nv_bfloat16* __restrict__ add,
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
  uint8_t* ring = smem;                                                        // [kStages][8][2048]
  uint4* xs = reinterpret_cast<uint4*>(ring + kStages * kW8a8SlabBytes);       // [kM][n_in] bf16
  uint8_t* xq = reinterpret_cast<uint8_t*>(xs + kM * k_lines * kGemvThreads);  // [kM][n_in] codes
  float* part = reinterpret_cast<float*>(xq + kM * n_in);                      // [rows][kM][warps]
  float* x_scale = part + rows_per_block * kM * kGemvWarps;                  // [kM]
  float* scratch = x_scale + 2;                                             // [32]

  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * rows_per_block;
  const int rows = static_cast<int>(n_out - row0 < rows_per_block ? n_out - row0 : rows_per_block);
  const int n_slabs = (rows + kW8a8SlabRows - 1) / kW8a8SlabRows * k_lines;
  // The scales of the outputs this thread writes at the end (output i = t + 256 j is row i / kM),
  // loaded now, before the wait (no kernel writes them): loaded at the end they would add a round
  // trip to memory after the last slab.
  float out_scale[kM];
#pragma unroll
  for (int j = 0; j < kM; ++j) {
    const int i = t + j * kGemvThreads;
    out_scale[j] = i < rows * kM ? __uint_as_float(ld_stream4(w_scale + row0 + i / kM)) : 0.0f;
  }

  // Slabs are requested in order by a cursor (no division in the loop): slab q (tile q / k_lines,
  // columns 2048 (q % k_lines) ..) into ring slot q % kStages; thread t copies chunk t % 128 of
  // rows t / 128, + 2, + 4, + 6 of the tile (a warp: 512 contiguous bytes of a row).
  const int c = t % 128, r0 = t / 128;
  const int dst_off = r0 * kGemvLine + 16 * (c ^ ((r0 & 1) << 2));  // rows r0 + 2 j: + 2 j lines
  const int64_t row_step = 2 * static_cast<int64_t>(n_in);
  const uint8_t* i_tile = w + (row0 + r0) * n_in + 16 * c;  // row r0 of the tile being requested
  int i_q = 0, i_kb = 0, i_row = r0, i_slot = 0;
  auto issue_next = [&]() {
    if (i_q < n_slabs) {
      uint8_t* dst = ring + i_slot * kW8a8SlabBytes + dst_off;
      const uint8_t* src = i_tile + i_kb * kGemvLine;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const bool live = i_row + 2 * j < rows;
        cp_async16(dst + 2 * j * kGemvLine, live ? src : w, live);
        src += row_step;
      }
    } else if (i_q == n_slabs) {
      stream_prefetch_next(pf);
    }
    cp_async_commit();
    ++i_q;
    i_slot = i_slot + 1 == kStages ? 0 : i_slot + 1;
    if (++i_kb == k_lines) i_kb = 0, i_tile += kW8a8SlabRows * static_cast<int64_t>(n_in), i_row += kW8a8SlabRows;
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
      // f / s, each code as quantize_rows_fp8 makes it.
      const E4m3Divisor div(s);
      for (int kb = 0; kb < k_lines; ++kb) {
        float f[8];
        unpack_bf16x8(*reinterpret_cast<const uint4*>(xh + m * n_in + kb * kGemvLine + 8 * t), f);
        *reinterpret_cast<uint2*>(xq + m * n_in + kb * kGemvLine + 8 * t) = div.codes8(f);
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
  int c_kb = 0, c_row = 0, c_slot = 0;     // the slab computed: its column line, tile row, slot
  for (int q = 0; q < n_slabs; ++q) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // slab q landed for every thread; slab q - 1's slot is free
    if (q == 0) trace.mark(3);
    issue_next();
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
      const int row = c_row + g;
      if (tq < kM && row < rows) part[(row * kM + tq) * kGemvWarps + warp] = (acc[0] + acc[1]) + (acc[2] + acc[3]);
      acc[0] = acc[1] = acc[2] = acc[3] = 0.0f;
      c_kb = 0;
      c_row += kW8a8SlabRows;
    }
  }
  trace.mark(4);
  cp_async_wait<0>();
  __syncthreads();
#pragma unroll
  for (int j = 0; j < kM; ++j) {
    const int i = t + j * kGemvThreads;
    if (i >= rows * kM) break;
    const int r = i / kM, m = i % kM;
    float sum = 0.0f;
#pragma unroll
    for (int v = 0; v < kGemvWarps; ++v) sum += part[i * kGemvWarps + v];
    y[static_cast<int64_t>(m) * n_out + row0 + r] = __float2bfloat16_rn(sum * x_scale[m] * out_scale[j]);
  }
  trace.finish(n_out, k_lines);
}

}  // namespace kestrel::cuda
