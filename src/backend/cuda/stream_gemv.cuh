// Streaming GEMV for one or two tokens: y[n_tokens, n_out] = a(x)[n_tokens, n_in] . W^T, where the
// time is one pass over W and every byte in flight counts.
//
// Design:
// - One block per SM (the grid is the SM count, or n_out if smaller), each owning a contiguous
//   range of whole rows of W, i.e. one contiguous byte range: the SMs stream about the same number
//   of bytes (ceil(n_out / blocks) rows each, the last block fewer), with no second wave.
// - What the previous kernel wrote (x, or the norm's residual and add) is read after the wait with
//   ld_dependent16 (coherent loads), never through the read-only path (see device_common.cuh).
// - The range is cut into lines of kGemvLine = 2048 elements (n_in % 2048 == 0, so a line lies in
//   one row); thread t always handles the 16 bytes t of a line, i.e. the same 8 k of every row,
//   so it needs only those k of x (kept in shared memory in its own slots, with SwiGLU formed there
//   once per block when the input is [gate | up]).
// - W goes global -> shared memory with cp.async in stages of kGemvLinesPerStage lines (32 KB),
//   kStages - 1 stages in flight. A thread reads back only the bytes its own cp.async wrote, so a
//   thread's own cp.async.wait_group is the only synchronisation of the main loop (no barrier).
// - PDL: the first kStages - 1 stages of W (written by no kernel) are requested before
//   griddepcontrol.wait, so on the SMs the previous kernel leaves free (all but a few at batch 1:
//   RoPE, attention, norms) the weights stream while it runs; x is read after the wait.
// - When a row's last line is done, each warp reduces its 32 partial sums (shuffles) into a
//   per-warp slot; the 8 warps' slots are summed in a fixed order at the end (deterministic), in
//   f32, and rounded once.
// - Fused input norm (kNormIn): the input is h = RMSNorm(residual_in + add) * norm_w rounded to
//   bf16, with the arithmetic of add_rms_norm (f32 add, f32 sum of squares, x * inv * w; the sum
//   of squares added in another order, so h may differ from add_rms_norm's by a bf16 ulp), computed
//   by every block for its own k (the block's threads cover all of n_in, so one block reduction
//   gives the row's sum of squares); block 0 writes residual_in + add to residual_out, which must
//   be another buffer (the other blocks are still reading residual_in). That takes the residual
//   add + RMSNorm kernel out of a decode step; the caller alternates two residual buffers.
// Source: the cp.async multistage pipeline of CUTLASS-style GEMMs (PTX ISA 8.x, "cp.async"),
// applied to a GEMV with the CUDA Programming Guide's programmatic dependent launch.
#pragma once

#include "backend/cuda/cuda_ops.h"
#include "backend/cuda/device_common.cuh"
#include "backend/cuda/silu_mul.cuh"

namespace kestrel::cuda {

constexpr int kGemvThreads = 256;
constexpr int kGemvLine = kGemvThreads * 8;  // elements of W per line: 16 bytes per thread
constexpr int kGemvLinesPerStage = 8;         // 32 KB of W per stage
constexpr int kGemvWarps = kGemvThreads / kWarpSize;
// Slabs of the FP8 and INT4 streaming GEMVs' rings requested before griddepcontrol.wait; the
// rest go out right behind the input's loads (stream_gemv_input's after_loads), so that those
// loads do not queue behind a whole ring of weight requests. Batch-1 decode of the 8B shape on an
// H100, tok/s FP8 / INT4: the whole ring (7) 287 / 375, 5: 294 / 381, 3: 295 / 389, 1: 292 / 391.
constexpr int kStreamPreWaitSlabs = 3;
// ... of a ring of kStages slabs (kStages - 1 in flight): at most all of them.
template <int kStages>
constexpr int kStreamPreWait = kStreamPreWaitSlabs < kStages - 1 ? kStreamPreWaitSlabs : kStages - 1;
constexpr int kGemvMaxKLines = 8;             // n_in up to 16384 (kStreamGemvMaxIn)

// Dynamic shared memory of stream_gemv_kernel<kM, kStages, ...>: the W ring, x (this block's k of
// every token), and the per-warp row sums.
constexpr size_t stream_gemv_smem_bytes(int m, int stages, int k_lines, int rows_per_block) {
  return static_cast<size_t>(stages) * kGemvLinesPerStage * kGemvThreads * 16 +
         static_cast<size_t>(m) * k_lines * kGemvThreads * 16 + static_cast<size_t>(rows_per_block) * m * kGemvWarps * 4;
}

// This block's share of p (StreamPrefetch) into L2, a 128-byte line a thread at a time. Called by
// every thread of the block once, when its last weight bytes have been requested.
__device__ __forceinline__ void stream_prefetch_next(const StreamPrefetch& p) {
  if (p.base == nullptr) return;
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * p.block_stride;
  const int64_t end = begin + p.bytes < p.total ? begin + p.bytes : p.total;
  const char* base = static_cast<const char*>(p.base);
  for (int64_t off = begin + 128 * static_cast<int64_t>(threadIdx.x); off < end; off += 128 * kGemvThreads)
    prefetch_l2(base + off);
}

// The input of a streaming GEMV into shared memory, after pdl_wait(): xs [kM][k_lines * 2048] bf16
// (natural order: uint4 (tok * k_lines + kb) * 256 + t holds elements kb * 2048 + 8 t .. + 7 of
// token tok), each thread loading and writing only its own 8 k of every line. The input is x, or
// with kSwiGLU silu(gate) * up rounded to bf16, or with kNormIn RMSNorm(res_in + add) * norm_w
// (block 0 also writing res_in + add to res_out). scratch: one float a warp of shared memory (the
// norm's block reduction, whose closing barrier ends its use). Called by all 256 threads of the
// block; ends with no barrier (a thread reads back only its own slots unless the caller syncs).
// after_loads() runs once the first token's loads are issued, before any is used: a caller's
// further weight requests go out behind the input's loads instead of ahead of them.
struct StreamNoRequests {
  __device__ __forceinline__ void operator()() const {}
};
template <int kM, bool kSwiGLU, bool kNormIn, class AfterLoads = StreamNoRequests>
__device__ __forceinline__ void stream_gemv_input(uint4* xs, float* scratch, int k_lines,
                                                  const __nv_bfloat16* __restrict__ x, int64_t x_stride,
                                                  const float* __restrict__ res_in,
                                                  const __nv_bfloat16* __restrict__ add,
                                                  const __nv_bfloat16* __restrict__ norm_w,
                                                  float* __restrict__ res_out, float eps,
                                                  const AfterLoads& after_loads = AfterLoads()) {
  const int t = static_cast<int>(threadIdx.x);
  const int64_t n_in = static_cast<int64_t>(k_lines) * kGemvLine;
  if constexpr (kNormIn) {
    // h = RMSNorm(res_in + add) * norm_w for this thread's k, with add_rms_norm's arithmetic (the
    // sum of squares in another order). The norm weights are requested with the first token's
    // operands, not after its sum: one round trip to L2 instead of two.
    uint4 wv[kGemvMaxKLines];
#pragma unroll
    for (int tok = 0; tok < kM; ++tok) {
      float r[kGemvMaxKLines][8];
      uint4 av[kGemvMaxKLines];
      float ss = 0.0f;
      // Every load first (one round trip), then the sums.
#pragma unroll
      for (int kb = 0; kb < kGemvMaxKLines; ++kb) {
        if (kb < k_lines) {
          const int64_t off = tok * n_in + kb * kGemvLine + t * 8;
          const uint4 lo = ld_dependent16(res_in + off), hi = ld_dependent16(res_in + off + 4);
          r[kb][0] = __uint_as_float(lo.x), r[kb][1] = __uint_as_float(lo.y);
          r[kb][2] = __uint_as_float(lo.z), r[kb][3] = __uint_as_float(lo.w);
          r[kb][4] = __uint_as_float(hi.x), r[kb][5] = __uint_as_float(hi.y);
          r[kb][6] = __uint_as_float(hi.z), r[kb][7] = __uint_as_float(hi.w);
          if (add != nullptr) av[kb] = ld_dependent16(add + off);
          if (tok == 0) wv[kb] = ld_stream16(norm_w + kb * kGemvLine + t * 8);
        }
      }
      if (tok == 0) after_loads();
#pragma unroll
      for (int kb = 0; kb < kGemvMaxKLines; ++kb) {
        if (kb < k_lines) {
          const int64_t off = tok * n_in + kb * kGemvLine + t * 8;
          if (add != nullptr) {
            float a[8];
            unpack_bf16x8(av[kb], a);
#pragma unroll
            for (int e = 0; e < 8; ++e) r[kb][e] += a[e];
          }
          if (blockIdx.x == 0) {
            *reinterpret_cast<float4*>(res_out + off) = make_float4(r[kb][0], r[kb][1], r[kb][2], r[kb][3]);
            *reinterpret_cast<float4*>(res_out + off + 4) = make_float4(r[kb][4], r[kb][5], r[kb][6], r[kb][7]);
          }
#pragma unroll
          for (int e = 0; e < 8; ++e) ss += r[kb][e] * r[kb][e];
        }
      }
      ss = block_reduce_sum(ss, scratch);
      const float inv = rsqrtf(ss / static_cast<float>(n_in) + eps);
#pragma unroll
      for (int kb = 0; kb < kGemvMaxKLines; ++kb) {
        if (kb < k_lines) {
          float wn[8], h[8];
          unpack_bf16x8(wv[kb], wn);
#pragma unroll
          for (int e = 0; e < 8; ++e) h[e] = r[kb][e] * inv * wn[e];
          xs[(tok * k_lines + kb) * kGemvThreads + t] = pack_bf16x8(h);
        }
      }
    }
  } else {
    // This thread's k of x, as the activation the rows are multiplied by: every load issued before
    // any is used (one round trip, not one per line of a row).
#pragma unroll
    for (int tok = 0; tok < kM; ++tok) {
      uint4 v[kGemvMaxKLines], up[kSwiGLU ? kGemvMaxKLines : 1];
      const __nv_bfloat16* xr = x + tok * x_stride + t * 8;
#pragma unroll
      for (int kb = 0; kb < kGemvMaxKLines; ++kb) {
        if (kb < k_lines) {
          v[kb] = ld_dependent16(xr + kb * kGemvLine);
          if constexpr (kSwiGLU) up[kb] = ld_dependent16(xr + n_in + kb * kGemvLine);
        }
      }
      if (tok == 0) after_loads();
#pragma unroll
      for (int kb = 0; kb < kGemvMaxKLines; ++kb) {
        if (kb < k_lines) {
          if constexpr (kSwiGLU) {
            float g[8], u[8], a[8];
            unpack_bf16x8(v[kb], g);
            unpack_bf16x8(up[kb], u);
#pragma unroll
            for (int e = 0; e < 8; ++e) a[e] = silu(g[e]) * u[e];
            v[kb] = pack_bf16x8(a);
          }
          xs[(tok * k_lines + kb) * kGemvThreads + t] = v[kb];
        }
      }
    }
  }
}

// x: [kM, *] rows x_stride elements apart, 16-byte aligned; with kSwiGLU row t's gate is
// x[t, 0 .. n_in) and its up x[t, n_in .. 2 n_in). w [n_out, n_in] with n_in = k_lines x 2048;
// y [kM, n_out], f32 when kF32Out else bf16. grid: ceil(n_out / rows_per_block) blocks of 256.
// kNormIn: x unused; res_in [kM, n_in] f32, add [kM, n_in] bf16 or null, norm_w [n_in] bf16,
// res_out [kM, n_in] f32 (not res_in), eps.
// kStages 3 asks for two blocks per SM (at most 128 registers a thread): with a 96 KB ring, the
// next projection's block can be resident, and requesting its first stages, while this one ends.
template <int kM, int kStages, bool kSwiGLU, bool kF32Out, bool kNormIn>
__global__ void __launch_bounds__(kGemvThreads, kStages == 3 ? 2 : 1)
    stream_gemv_kernel(const __nv_bfloat16* __restrict__ x, int64_t x_stride, const __nv_bfloat16* __restrict__ w,
                       void* __restrict__ y, int n_out, int k_lines, int rows_per_block,
                       const float* __restrict__ res_in, const __nv_bfloat16* __restrict__ add,
                       const __nv_bfloat16* __restrict__ norm_w, float* __restrict__ res_out, float eps) {
  KESTREL_DYNAMIC_SMEM(smem);
  const int t = static_cast<int>(threadIdx.x);
  const int warp = t / kWarpSize, lane = t % kWarpSize;
  uint4* ring = reinterpret_cast<uint4*>(smem);                              // [kStages][lines][256]
  uint4* xs = ring + kStages * kGemvLinesPerStage * kGemvThreads;            // [kM][k_lines][256]
  float* part = reinterpret_cast<float*>(xs + kM * k_lines * kGemvThreads);  // [rows][kM][warps]

  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * rows_per_block;
  const int rows = static_cast<int>(n_out - row0 < rows_per_block ? n_out - row0 : rows_per_block);
  const int64_t n_in = static_cast<int64_t>(k_lines) * kGemvLine;
  const __nv_bfloat16* wb = w + row0 * n_in + t * 8;
  const int total = rows * k_lines;  // lines of this block
  const int n_stages = (total + kGemvLinesPerStage - 1) / kGemvLinesPerStage;

  // Stage s of W into ring slot s % kStages (nothing past the last stage), then a commit, so that
  // the group count stays uniform.
  auto issue = [&](int s) {
    if (s < n_stages) {
      uint4* dst = ring + (s % kStages) * kGemvLinesPerStage * kGemvThreads + t;
#pragma unroll
      for (int j = 0; j < kGemvLinesPerStage; ++j) {
        const int line = s * kGemvLinesPerStage + j;
        if (line < total) cp_async16(dst + j * kGemvThreads, wb + static_cast<int64_t>(line) * kGemvLine, true);
      }
    }
    cp_async_commit();
  };
  // Two stages before the wait, the third behind the input's loads (kStreamPreWaitSlabs' reason).
  // Batch-1 bf16 decode of the 8B shape on an H100: 184.4 / 184.4 tok/s against 182.9 / 182.7 with
  // the whole ring before the wait and 182.5 / 182.3 with one stage; batch 2 level (345).
  constexpr int kPreWait = kStages - 1 < 2 ? kStages - 1 : 2;
#pragma unroll
  for (int s = 0; s < kPreWait; ++s) issue(s);
  pdl_wait();
  // The input's scratch is `part`: the main loop writes it only after the norm's last barrier.
  stream_gemv_input<kM, kSwiGLU, kNormIn>(xs, part, k_lines, x, x_stride, res_in, add, norm_w, res_out, eps, [&] {
#pragma unroll
    for (int s = kPreWait; s < kStages - 1; ++s) issue(s);
  });
  pdl_launch_next();

  float acc[kM];
#pragma unroll
  for (int tok = 0; tok < kM; ++tok) acc[tok] = 0.0f;
  int kb = 0, row = 0;
  for (int s = 0; s < n_stages; ++s) {
    issue(s + kStages - 1);
    cp_async_wait<kStages - 1>();  // stage s (this thread's part of it) has landed
    const uint4* src = ring + (s % kStages) * kGemvLinesPerStage * kGemvThreads + t;
#pragma unroll
    for (int j = 0; j < kGemvLinesPerStage; ++j) {
      if (s * kGemvLinesPerStage + j >= total) break;  // the same for every thread
      float wf[8];
      unpack_bf16x8(src[j * kGemvThreads], wf);
#pragma unroll
      for (int tok = 0; tok < kM; ++tok) {
        float xf[8];
        unpack_bf16x8(xs[(tok * k_lines + kb) * kGemvThreads + t], xf);
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[tok] = fmaf(wf[e], xf[e], acc[tok]);
      }
      if (++kb == k_lines) {  // row done: the warp's sum into its slot
#pragma unroll
        for (int tok = 0; tok < kM; ++tok) {
          const float v = warp_reduce_sum(acc[tok]);
          if (lane == 0) part[(row * kM + tok) * kGemvWarps + warp] = v;
          acc[tok] = 0.0f;
        }
        kb = 0;
        ++row;
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();
  for (int i = t; i < rows * kM; i += kGemvThreads) {
    const int r = i / kM, tok = i % kM;
    float s = 0.0f;
#pragma unroll
    for (int v = 0; v < kGemvWarps; ++v) s += part[i * kGemvWarps + v];
    const int64_t at = static_cast<int64_t>(tok) * n_out + row0 + r;
    if constexpr (kF32Out)
      static_cast<float*>(y)[at] = s;
    else
      static_cast<__nv_bfloat16*>(y)[at] = __float2bfloat16_rn(s);
  }
}

}  // namespace kestrel::cuda
