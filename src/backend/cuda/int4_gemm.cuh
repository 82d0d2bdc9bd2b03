// INT4 kernels (int4_ops.h has the device layout): the W4A16 skinny GEMM for decode, the
// dequantization to bf16 for cuBLASLt, and the act-order column gather.
//
// Skinny GEMM design: skinny_gemm.cuh's (groups of 16 rows of W per block, warps splitting n_in, W
// straight from global memory into mma.sync A fragments, tokens on the N side; here kR row groups
// per block share each x load), where a lane's 16-byte load
// of W holds a 128-column tile's 32 codes: word c (chunk c of 32 columns) holds the 8 columns
// 32 c + 8 t .. + 7 that lane t's 16-byte load of x holds, as in the bf16 kernel. For a word w,
// ((w >> 4 s) & 0x000F000F) | 0x43004300 is the bf16 pair {128 + q[8 t + 2 s], 128 + q[8 t + 2 s + 1]}
// (s = 0..3); subtracting the pair {128 + z, 128 + z} leaves q - z exactly. Pairs s = 0, 1 are
// the first mma's A registers of the chunk (x words 0, 1 its B registers), s = 2, 3 the second's:
// the same k permutation for A and B, so the dot product is unchanged. Each chunk's two mmas
// accumulate from zero and the sum is multiplied by the chunk's group scale (G >= 32, so a chunk
// lies in one group) and added to the f32 accumulators.
// Source: the fragment layouts are PTX ISA 8.x, "Matrix fragments for mma.m16n8k16"; the int to
// float conversion by OR-ing into the mantissa is the well-known exponent trick (as in Kim et al.
// 2022, "Who Says Elephants Can't Run", and Marlin, Frantar et al. 2024), written here for bf16.
#pragma once

#include "backend/cuda/device_common.cuh"
#include "backend/cuda/int4_decode.cuh"
#include "backend/cuda/silu_mul.cuh"
#include "backend/cuda/skinny_gemm.cuh"

namespace kestrel::cuda {

// The loads of one warp iteration (kU tiles of kR row groups), double buffered across
// iterations: the codes and meta words, and x where it fits the registers (kPrefetchX: x of at
// most 8 tokens without SwiGLU, or 16 rows of input counting gate and up: a tile's x is 4 times
// its codes per row group); otherwise x is loaded at the start of its own iteration.
template <int kNT, int kU, int kR, int kGpt, bool kSwiGLU>
struct SkinnyInt4Frag {
  static constexpr bool kPrefetchX = kNT * (kSwiGLU ? 2 : 1) <= 2;
  struct Weights {
    uint4 w[kR][2][kU];              // rows 16 r + g and 16 r + g + 8: one 128-column tile each
    uint32_t m[kR][2][kU][kGpt];     // their meta words: the tile's kGpt groups
  } wm;
  struct Inputs {
    uint4 x[kNT][kU][4];             // tokens 8 j + g: chunk c's columns 32 c + 8 t .. + 7
    uint4 up[kSwiGLU ? kNT : 1][kSwiGLU ? kU : 1][kSwiGLU ? 4 : 1];
  } in;
};

// x [n_tokens, *] bf16 rows x_stride apart ([gate | up] for kSwiGLU), codes [n_out, n_in / 8],
// meta [n_out, n_groups], y [n_tokens, n_out] bf16. kGpt: groups per 128-column tile (4: G = 32,
// 2: G = 64, 1: G >= 128 or one group per row; group of column k: k >> group_shift). A block owns
// 16 kR rows (kR row groups share each x load). grid: ceil(n_out / (16 kR)) blocks of kWarps warps.
// At most 128 registers a thread (16 warps an SM): the memory-bound stream needs the warps more
// than the compiler's extra hoisted loads.
template <int kNT, int kU, int kR, int kWarps, int kGpt, bool kSwiGLU>
__global__ void __launch_bounds__(kWarps * 32, 16 / kWarps)
    skinny_gemm_int4_kernel(const __nv_bfloat16* __restrict__ x, int64_t x_stride, const uint32_t* __restrict__ codes,
                            const uint32_t* __restrict__ meta, int n_groups, int group_shift, bool scale_f16,
                            __nv_bfloat16* __restrict__ y, int n_tokens, int n_in, int n_out) {
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int g = lane / 4, t = lane % 4;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kSkinnyRows * kR;
  const int64_t last = n_out - 1;  // rows past n_out load the last row; their sums are never stored
  const uint32_t* c_row[kR][2];
  const uint32_t* m_row[kR][2];
#pragma unroll
  for (int r = 0; r < kR; ++r)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t want = row0 + 16 * r + g + 8 * h, row = want < last ? want : last;
      c_row[r][h] = codes + row * (n_in / 8);
      m_row[r][h] = meta + row * n_groups;
    }
  const __nv_bfloat16* x_row[kNT];
  bool x_live[kNT];
#pragma unroll
  for (int j = 0; j < kNT; ++j) {
    const int tok = 8 * j + g;
    x_live[j] = tok < n_tokens;
    x_row[j] = x + static_cast<int64_t>(x_live[j] ? tok : 0) * x_stride;
  }
  const int n_tiles = n_in / 128;
  const int n_iter_total = (n_tiles + kU - 1) / kU;
  using Frag = SkinnyInt4Frag<kNT, kU, kR, kGpt, kSwiGLU>;
  const uint4 zero = make_uint4(0, 0, 0, 0);
  auto load_w = [&](int it, Frag& f) {
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int tile = it * kU + u;
      const bool live = tile < n_tiles;
      const int gi = live ? (tile * 128) >> group_shift : 0;
#pragma unroll
      for (int r = 0; r < kR; ++r)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          f.wm.w[r][h][u] = live ? ld_stream16(c_row[r][h] + 16 * tile + 4 * t) : zero;
          uint32_t* m = f.wm.m[r][h][u];
          if constexpr (kGpt == 4) {
            const uint4 a = live ? ld_stream16(m_row[r][h] + gi) : zero;
            m[0] = a.x, m[1] = a.y, m[2] = a.z, m[3] = a.w;
          } else if constexpr (kGpt == 2) {
            const uint2 a = live ? ld_stream8(m_row[r][h] + gi) : make_uint2(0, 0);
            m[0] = a.x, m[1] = a.y;
          } else {
            m[0] = live ? ld_stream4(m_row[r][h] + gi) : 0u;
          }
        }
    }
  };
  auto load_x = [&](int it, Frag& f) {
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int tile = it * kU + u;
#pragma unroll
      for (int j = 0; j < kNT; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const bool live = tile < n_tiles && x_live[j];
          const int k = tile * 128 + 32 * c + 8 * t;
          f.in.x[j][u][c] = live ? ld_dependent16(x_row[j] + k) : zero;
          if constexpr (kSwiGLU) f.in.up[j][u][c] = live ? ld_dependent16(x_row[j] + n_in + k) : zero;
        }
    }
  };
  auto activation = [&](const Frag& f, int j, int u, int c) -> uint4 {
    if constexpr (kSwiGLU) {
      float gt[8], up[8], a[8];
      unpack_bf16x8(f.in.x[j][u][c], gt);
      unpack_bf16x8(f.in.up[j][u][c], up);
#pragma unroll
      for (int e = 0; e < 8; ++e) a[e] = silu(gt[e]) * up[e];
      return pack_bf16x8(a);
    } else {
      return f.in.x[j][u][c];
    }
  };

  float acc[kR * kNT][4] = {};
  Frag cur, nxt;
  int it = warp;
  if (it < n_iter_total) load_w(it, cur);
  pdl_wait();  // the weights were written by no kernel; x may come from the previous one
  pdl_launch_next();
  if (Frag::kPrefetchX && it < n_iter_total) load_x(it, cur);
  for (; it < n_iter_total; it += kWarps) {
    if (it + kWarps < n_iter_total) {
      load_w(it + kWarps, nxt);
      if constexpr (Frag::kPrefetchX) load_x(it + kWarps, nxt);
    }
    if constexpr (!Frag::kPrefetchX) load_x(it, cur);
#pragma unroll
    for (int u = 0; u < kU; ++u)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        uint4 b[kNT];
#pragma unroll
        for (int j = 0; j < kNT; ++j) b[j] = activation(cur, j, u, c);
#pragma unroll
        for (int r = 0; r < kR; ++r) {
          const int mi = c * kGpt / 4;
          const uint32_t mg = cur.wm.m[r][0][u][mi], mh = cur.wm.m[r][1][u][mi];
          const float sg = int4_scale(mg, scale_f16), sh = int4_scale(mh, scale_f16);
          const uint32_t zg = int4_zero_pair(mg), zh = int4_zero_pair(mh);
          const uint4 w4g = cur.wm.w[r][0][u], w4h = cur.wm.w[r][1][u];
          const uint32_t wg = c == 0 ? w4g.x : c == 1 ? w4g.y : c == 2 ? w4g.z : w4g.w;
          const uint32_t wh = c == 0 ? w4h.x : c == 1 ? w4h.y : c == 2 ? w4h.z : w4h.w;
          uint32_t ag[4], ah[4];
#pragma unroll
          for (int s = 0; s < 4; ++s) {
            ag[s] = bf16x2_sub(((wg >> (4 * s)) & 0x000F000Fu) | 0x43004300u, zg);
            ah[s] = bf16x2_sub(((wh >> (4 * s)) & 0x000F000Fu) | 0x43004300u, zh);
          }
          const uint32_t fa[4] = {ag[0], ah[0], ag[1], ah[1]};
          const uint32_t fb[4] = {ag[2], ah[2], ag[3], ah[3]};
#pragma unroll
          for (int j = 0; j < kNT; ++j) {
            const uint32_t b0[2] = {b[j].x, b[j].y};
            const uint32_t b1[2] = {b[j].z, b[j].w};
            float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            mma_bf16_16816(part, fa, b0);
            mma_bf16_16816(part, fb, b1);
            float* a = acc[r * kNT + j];
            a[0] += sg * part[0];
            a[1] += sg * part[1];
            a[2] += sh * part[2];
            a[3] += sh * part[3];
          }
        }
      }
    cur.wm = nxt.wm;
    if constexpr (Frag::kPrefetchX) cur.in = nxt.in;
  }

  // acc[r kNT + j][e]: row 16 r + g + 8 (e >= 2), token 8 j + 2 t + (e & 1). Sum over the warps.
  __shared__ SkinnyPartials<kR * kNT, kWarps> partial;
  partial.put(warp, lane, acc);
  __syncthreads();
  for (int i = static_cast<int>(threadIdx.x); i < kR * kNT * kWarpSize * 4; i += kWarps * kWarpSize) {
    const int jj = i / (kWarpSize * 4), l = (i / 4) % kWarpSize, e = i % 4;
    const int r = jj / kNT, j = jj % kNT;
    const int64_t row = row0 + 16 * r + l / 4 + (e >= 2 ? 8 : 0);
    const int tok = 8 * j + 2 * (l % 4) + (e & 1);
    if (row >= n_out || tok >= n_tokens) continue;
    y[static_cast<int64_t>(tok) * n_out + row] = __float2bfloat16_rn(partial.sum(jj, l, e));
  }
}

// One thread per code word: out [n_out, n_in] bf16, the word's 8 columns at perm[k] (or k).
__global__ void dequantize_int4_kernel(const uint32_t* __restrict__ codes, const uint32_t* __restrict__ meta,
                                       const int32_t* __restrict__ perm, int64_t n_in, int64_t n_out,
                                       int64_t n_groups, int group_shift, bool scale_f16,
                                       __nv_bfloat16* __restrict__ out) {
  KESTREL_PDL_ENTRY();  // out may still be read by the previous kernel
  const int64_t words = n_in / 8;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= words * n_out) return;
  const int64_t row = i / words, wi = i % words;
  const int64_t k0 = 128 * (wi / 16) + 32 * (wi % 4) + 8 * ((wi % 16) / 4);
  const uint32_t w = codes[i];
  const uint32_t m = meta[row * n_groups + (k0 >> group_shift)];
  const float s = int4_scale(m, scale_f16);
  const int z = static_cast<int>((m >> 16) & 0x7Fu);  // bf16 128 + z: z is the mantissa (exponent 2^7)
  float v[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const int q = static_cast<int>((w >> (4 * (4 * (e % 2) + e / 2))) & 0xFu);
    v[e] = s * static_cast<float>(q - z);
  }
  __nv_bfloat16* o = out + row * n_in;
  if (perm == nullptr) {
    *reinterpret_cast<uint4*>(o + k0) = pack_bf16x8(v);
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e) o[perm[k0 + e]] = __float2bfloat16_rn(v[e]);
  }
}

// xp [n_tokens, n_in] = a(x)[:, perm]; one thread per output element.
template <bool kSwiGLU>
__global__ void int4_gather_columns_kernel(const __nv_bfloat16* __restrict__ x, int64_t x_stride,
                                           const int32_t* __restrict__ perm, int64_t n_tokens, int64_t n_in,
                                           __nv_bfloat16* __restrict__ xp) {
  KESTREL_PDL_ENTRY();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n_tokens * n_in) return;
  const int64_t tok = i / n_in, k = i % n_in;
  const __nv_bfloat16* row = x + tok * x_stride;
  const int32_t src = perm[k];
  if constexpr (kSwiGLU) {
    const float gt = __bfloat162float(row[src]);
    xp[i] = __float2bfloat16_rn(silu(gt) * __bfloat162float(row[n_in + src]));
  } else {
    xp[i] = row[src];
  }
}

}  // namespace kestrel::cuda
