// GGUF blocks in place (gguf_ops.h has the layout): the values of one lane's part of a 32-column
// unit, the decode GEMV over them, the dequantization to bf16 and the embedding lookup.
//
// A unit is 32 consecutive columns of a row: a Q4_0 / Q4_1 / Q5_0 / Q8_0 block, or a 32-element
// sub-block of a K-quant super-block. Lane t (t = lane % 4) of a row takes the unit's elements
// 4 t .. 4 t + 3 and 16 + 4 t .. 16 + 4 t + 3: in every format these sit in one aligned 32-bit word
// per source (Q4_0 / Q4_1 / Q5_0 / K-quant nibbles: bytes 4 t .. + 3 and, for elements from 16,
// the high nibbles of the same bytes or the next 16 bytes; Q8_0 two words; Q5_0's fifth bits:
// bits 4 t .. and 16 + 4 t .. of qh; Q5_K's / Q6_K's high bits: bytes 4 t .. of qh), so each
// lane loads whole words and the 4 lanes of a row read a unit's quants once.
//
// GEMV design (skinny_gemm.cuh's, a GEMV on the tensor cores): a block owns 16 rows (mma.sync
// m16n8k16's M side: lane (g, t) rows g and g + 8), its warps take the units of a row in turn, kU
// at a time, double buffered; the tokens (up to 8) are the N side. The lane's 8 values of a unit
// are its A fragment pairs: elements 4 t, 4 t + 1 are logical k 2 t, 2 t + 1 and 4 t + 2, 4 t + 3
// are 2 t + 8, 2 t + 9 of the first mma, elements 16 + 4 t .. the second's; x is loaded in the
// same order (two 8-byte loads per unit), so the dot product is unchanged. Each value is formed
// in f32 as cpu::dequantize_row forms it and rounded to bf16 before the mma (the bf16 upload's
// values), so the result equals the bf16 path up to the order of the f32 sums. The weights are
// requested before griddepcontrol.wait (no kernel writes them), x after it with coherent loads.
// Source: block layouts of ggml (ggml-common.h, as core/dtype.h documents them); fragment
// layouts: PTX ISA 8.x, "Matrix fragments for mma.m16n8k16".
#pragma once

#include "backend/cuda/device_common.cuh"
#include "backend/cuda/gguf_ops.h"
#include "backend/cuda/int4_decode.cuh"
#include "backend/cuda/silu_mul.cuh"
#include "backend/cuda/skinny_gemm.cuh"

namespace kestrel::cuda {

template <GgufQuant T>
constexpr int kGgufUnitsPerBlock = (T == GgufQuant::Q4_K || T == GgufQuant::Q5_K || T == GgufQuant::Q6_K) ? 8 : 1;
template <GgufQuant T>
constexpr int kGgufBody = T == GgufQuant::Q4_0 ? 16
                          : T == GgufQuant::Q4_1 ? 20
                          : T == GgufQuant::Q5_0 ? 20
                          : T == GgufQuant::Q8_0 ? 32
                          : T == GgufQuant::Q4_K ? 144
                          : T == GgufQuant::Q5_K ? 176
                                                 : 208;

// 2 bytes of a weight stream (an f16 scale), zero-extended; may come before pdl_wait().
__device__ __forceinline__ uint32_t ld_stream2(const void* p) {
#if defined(KESTREL_CUDA_EMULATE)
  uint16_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
#else
  unsigned short v;
  asm("ld.global.nc.L1::no_allocate.u16 %0, [%1];\n" : "=h"(v) : "l"(p));
  return v;
#endif
}
// 8 bytes that the preceding grid wrote (x), read after pdl_wait() (ld_dependent16's rule).
__device__ __forceinline__ uint2 ld_dependent8(const void* p) {
#if defined(KESTREL_CUDA_EMULATE)
  uint2 v;
  std::memcpy(&v, p, sizeof v);
  return v;
#else
  uint2 v;
  asm volatile("ld.global.cg.v2.u32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "l"(p) : "memory");
  return v;
#endif
}

// q as f32 for 0 <= q < 2^23, minus `bias` (exact for the small integers used here): q in the
// mantissa of 2^23, then one subtraction.
__device__ __forceinline__ float gguf_int(uint32_t q, float bias) { return __uint_as_float(0x4B000000u | q) - (8388608.0f + bias); }
__device__ __forceinline__ float gguf_f16(uint32_t h) { return int4_scale(h & 0xFFFFu, true); }

// The raw words of lane t's part of unit `unit` of a row (body, d: the row's arrays).
template <GgufQuant T>
__device__ __forceinline__ void gguf_load_unit(const uint8_t* body, const uint16_t* d, int unit, int t,
                                               uint32_t (&r)[8]) {
  if constexpr (kGgufUnitsPerBlock<T> == 1) {
    const uint8_t* b = body + static_cast<int64_t>(unit) * kGgufBody<T>;
    if constexpr (T == GgufQuant::Q4_0) {
      r[0] = ld_stream4(b + 4 * t);
      r[1] = ld_stream2(d + unit);
    } else if constexpr (T == GgufQuant::Q4_1 || T == GgufQuant::Q5_0) {
      r[0] = ld_stream4(b);  // Q4_1: d | m << 16; Q5_0: qh
      r[1] = ld_stream4(b + 4 + 4 * t);
      if constexpr (T == GgufQuant::Q5_0) r[2] = ld_stream2(d + unit);
    } else {  // Q8_0
      r[0] = ld_stream4(b + 4 * t);
      r[1] = ld_stream4(b + 16 + 4 * t);
      r[2] = ld_stream2(d + unit);
    }
  } else {
    const int blk = unit / 8, s = unit % 8;
    const uint8_t* b = body + static_cast<int64_t>(blk) * kGgufBody<T>;
    if constexpr (T == GgufQuant::Q6_K) {
      const int h = s / 4, k = s % 4;
      const uint8_t* ql = b + 64 * h + 32 * (k & 1);
      r[0] = ld_stream4(ql + 4 * t);
      r[1] = ld_stream4(ql + 16 + 4 * t);
      r[2] = ld_stream4(b + 128 + 32 * h + 4 * t);
      r[3] = ld_stream4(b + 128 + 32 * h + 16 + 4 * t);
      r[4] = ld_stream2(b + 192 + 8 * h + 2 * k);  // the two 16-element sub-blocks' int8 scales
      r[5] = ld_stream2(d + blk);
    } else {  // Q4_K, Q5_K: d | dmin << 16, the 12 scale bytes, then (Q5_K) qh, then qs
      r[0] = ld_stream4(b);
      r[1] = ld_stream4(b + 4);
      r[2] = ld_stream4(b + 8);
      r[3] = ld_stream4(b + 12);
      const uint8_t* qs = b + (T == GgufQuant::Q5_K ? 48 : 16) + 32 * (s / 2);
      r[4] = ld_stream4(qs + 4 * t);
      r[5] = ld_stream4(qs + 16 + 4 * t);
      if constexpr (T == GgufQuant::Q5_K) {
        r[6] = ld_stream4(b + 16 + 4 * t);
        r[7] = ld_stream4(b + 16 + 16 + 4 * t);
      }
    }
  }
}

// Byte j (0..11) of a K-quant's scales from its three words r[1..3].
__device__ __forceinline__ int gguf_kscale_byte(const uint32_t (&r)[8], int j) {
  return static_cast<int>((r[1 + j / 4] >> (8 * (j % 4))) & 0xFFu);
}

// Lane t's 8 values of the unit (v[0..3]: elements 4 t .., v[4..7]: 16 + 4 t ..) in f32, each as
// cpu::dequantize_row computes it.
template <GgufQuant T>
__device__ __forceinline__ void gguf_decode_unit(const uint32_t (&r)[8], int unit, int t, float (&v)[8]) {
  if constexpr (T == GgufQuant::Q4_0) {
    const float d = gguf_f16(r[1]);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[i] = d * gguf_int((r[0] >> (8 * i)) & 0xFu, 8.0f);
      v[4 + i] = d * gguf_int((r[0] >> (8 * i + 4)) & 0xFu, 8.0f);
    }
  } else if constexpr (T == GgufQuant::Q4_1) {
    const float d = gguf_f16(r[0]), m = gguf_f16(r[0] >> 16);
    // d q is exact in f32 (11 x 4 bits), so a contracted fma rounds as the CPU's mul then add.
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[i] = d * gguf_int((r[1] >> (8 * i)) & 0xFu, 0.0f) + m;
      v[4 + i] = d * gguf_int((r[1] >> (8 * i + 4)) & 0xFu, 0.0f) + m;
    }
  } else if constexpr (T == GgufQuant::Q5_0) {
    const float d = gguf_f16(r[2]);
    const uint32_t h = r[0];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t lo = ((r[1] >> (8 * i)) & 0xFu) | (((h >> (4 * t + i)) & 1u) << 4);
      const uint32_t hi = ((r[1] >> (8 * i + 4)) & 0xFu) | (((h >> (16 + 4 * t + i)) & 1u) << 4);
      v[i] = d * gguf_int(lo, 16.0f);
      v[4 + i] = d * gguf_int(hi, 16.0f);
    }
  } else if constexpr (T == GgufQuant::Q8_0) {
    const float d = gguf_f16(r[2]);
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // int8 q + 128 as an unsigned byte
      v[i] = d * gguf_int(((r[0] >> (8 * i)) & 0xFFu) ^ 0x80u, 128.0f);
      v[4 + i] = d * gguf_int(((r[1] >> (8 * i)) & 0xFFu) ^ 0x80u, 128.0f);
    }
  } else if constexpr (T == GgufQuant::Q6_K) {
    const int k = (unit % 8) % 4;
    const float d = gguf_f16(r[5]);
    const float s0 = d * static_cast<float>(static_cast<int8_t>(r[4] & 0xFFu));
    const float s1 = d * static_cast<float>(static_cast<int8_t>((r[4] >> 8) & 0xFFu));
    const int nib = 4 * (k >> 1);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t lo = ((r[0] >> (8 * i + nib)) & 0xFu) | (((r[2] >> (8 * i + 2 * k)) & 3u) << 4);
      const uint32_t hi = ((r[1] >> (8 * i + nib)) & 0xFu) | (((r[3] >> (8 * i + 2 * k)) & 3u) << 4);
      v[i] = s0 * gguf_int(lo, 32.0f);  // (d sc) q, in the CPU's order
      v[4 + i] = s1 * gguf_int(hi, 32.0f);
    }
  } else {  // Q4_K, Q5_K: sub-block s: (d sc_s) q - dmin m_s, with d sc_s q exact in f32
    const int s = unit % 8;
    int sc, m;
    if (s < 4) {
      sc = gguf_kscale_byte(r, s) & 63;
      m = gguf_kscale_byte(r, s + 4) & 63;
    } else {
      sc = (gguf_kscale_byte(r, s + 4) & 0x0F) | ((gguf_kscale_byte(r, s - 4) >> 6) << 4);
      m = (gguf_kscale_byte(r, s + 4) >> 4) | ((gguf_kscale_byte(r, s) >> 6) << 4);
    }
    const float scale = gguf_f16(r[0]) * static_cast<float>(sc), mn = gguf_f16(r[0] >> 16) * static_cast<float>(m);
    const int nib = 4 * (s & 1);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      uint32_t lo = (r[4] >> (8 * i + nib)) & 0xFu, hi = (r[5] >> (8 * i + nib)) & 0xFu;
      if constexpr (T == GgufQuant::Q5_K) {
        lo |= ((r[6] >> (8 * i + s)) & 1u) << 4;
        hi |= ((r[7] >> (8 * i + s)) & 1u) << 4;
      }
      v[i] = scale * gguf_int(lo, 0.0f) - mn;
      v[4 + i] = scale * gguf_int(hi, 0.0f) - mn;
    }
  }
}

// The unit's 8 values as 4 bf16 pairs (round to nearest even): {4t, 4t+1}, {4t+2, 4t+3},
// {16+4t, 16+4t+1}, {16+4t+2, 16+4t+3}.
template <GgufQuant T>
__device__ __forceinline__ void gguf_unit_bf16(const uint32_t (&r)[8], int unit, int t, uint32_t (&a)[4]) {
  float v[8];
  gguf_decode_unit<T>(r, unit, t, v);
#pragma unroll
  for (int p = 0; p < 4; ++p) a[p] = pack_bf16x2(v[2 * p], v[2 * p + 1]);
}

// One warp iteration's loads: kU units of rows g and g + 8, and token g's x (and up) for them.
template <int kU, bool kSwiGLU>
struct GgufFrag {
  uint32_t r[kU][2][8];
  uint2 x[kU][2];
  uint2 up[kSwiGLU ? kU : 1][2];
};

// x [n_tokens <= 8, *] bf16 rows x_stride apart ([gate | up] for kSwiGLU); body / d the matrix
// (gguf_ops.h); y [n_tokens, y_stride] (bf16, or f32 when kF32Out): columns 0 .. n_out written.
// grid: ceil(n_out / 16) blocks of kWarps warps.
template <GgufQuant T, int kU, int kWarps, bool kSwiGLU, bool kF32Out>
__global__ void __launch_bounds__(kWarps * 32)
    gguf_gemv_kernel(const __nv_bfloat16* __restrict__ x, int64_t x_stride, const uint8_t* __restrict__ body,
                     const uint16_t* __restrict__ d, void* __restrict__ y, int64_t y_stride, int n_tokens, int n_in,
                     int n_out) {
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int g = lane / 4, t = lane % 4;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kSkinnyRows;
  const int64_t last = n_out - 1;  // rows past n_out read the last row; their sums are never stored
  const int n_units = n_in / 32;
  const int64_t blocks_per_row = n_units / kGgufUnitsPerBlock<T>;
  const uint8_t* b_row[2];
  const uint16_t* d_row[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t want = row0 + g + 8 * h, row = want < last ? want : last;
    b_row[h] = body + row * blocks_per_row * kGgufBody<T>;
    d_row[h] = d + row * blocks_per_row;  // unused (and d null) unless d is stored apart
  }
  const bool x_live = g < n_tokens;
  const __nv_bfloat16* x_row = x + static_cast<int64_t>(x_live ? g : 0) * x_stride;
  const int n_iter = (n_units + kU - 1) / kU;
  using Frag = GgufFrag<kU, kSwiGLU>;
  auto load_w = [&](int it, Frag& f) {
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int unit = it * kU + u;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (unit < n_units) {
          gguf_load_unit<T>(b_row[h], d_row[h], unit, t, f.r[u][h]);
        } else {
#pragma unroll
          for (int i = 0; i < 8; ++i) f.r[u][h][i] = 0u;  // zero scales: the values are zeros
        }
      }
    }
  };
  auto load_x = [&](int it, Frag& f) {
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int unit = it * kU + u;
      const bool live = unit < n_units && x_live;
#pragma unroll
      for (int p = 0; p < 2; ++p) {
        const int k = 32 * unit + 16 * p + 4 * t;
        f.x[u][p] = live ? ld_dependent8(x_row + k) : make_uint2(0, 0);
        if constexpr (kSwiGLU) f.up[u][p] = live ? ld_dependent8(x_row + n_in + k) : make_uint2(0, 0);
      }
    }
  };
  // The B fragment of half p of unit u: x, or silu(gate) * up rounded to bf16 as silu_mul rounds it.
  auto activation = [&](const Frag& f, int u, int p) -> uint2 {
    if constexpr (kSwiGLU) {
      const uint32_t gw[2] = {f.x[u][p].x, f.x[u][p].y}, uw[2] = {f.up[u][p].x, f.up[u][p].y};
      uint32_t o[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const float g0 = __uint_as_float(gw[i] << 16), g1 = __uint_as_float(gw[i] & 0xffff0000u);
        const float u0 = __uint_as_float(uw[i] << 16), u1 = __uint_as_float(uw[i] & 0xffff0000u);
        o[i] = pack_bf16x2(silu(g0) * u0, silu(g1) * u1);
      }
      return make_uint2(o[0], o[1]);
    } else {
      return f.x[u][p];
    }
  };

  float acc[1][4] = {};
  Frag cur, nxt;
  int it = warp;
  if (it < n_iter) load_w(it, cur);
  pdl_wait();
  pdl_launch_next();
  if (it < n_iter) load_x(it, cur);
  for (; it < n_iter; it += kWarps) {
    if (it + kWarps < n_iter) {
      load_w(it + kWarps, nxt);
      load_x(it + kWarps, nxt);
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int unit = it * kU + u;
      uint32_t ag[4], ah[4];
      gguf_unit_bf16<T>(cur.r[u][0], unit, t, ag);
      gguf_unit_bf16<T>(cur.r[u][1], unit, t, ah);
      const uint32_t a0[4] = {ag[0], ah[0], ag[1], ah[1]};
      const uint32_t a1[4] = {ag[2], ah[2], ag[3], ah[3]};
      const uint2 xb0 = activation(cur, u, 0), xb1 = activation(cur, u, 1);
      const uint32_t b0[2] = {xb0.x, xb0.y};
      const uint32_t b1[2] = {xb1.x, xb1.y};
      mma_bf16_16816(acc[0], a0, b0);
      mma_bf16_16816(acc[0], a1, b1);
    }
    cur = nxt;
  }

  // acc[0][e]: row g + 8 (e >= 2), token 2 t + (e & 1). Sum over the warps in warp order.
  __shared__ SkinnyPartials<1, kWarps> partial;
  partial.put(warp, lane, acc);
  __syncthreads();
  for (int i = static_cast<int>(threadIdx.x); i < kWarpSize * 4; i += kWarps * kWarpSize) {
    const int l = i / 4, e = i % 4;
    const float s = partial.sum(0, l, e);
    const int64_t row = row0 + l / 4 + (e >= 2 ? 8 : 0);
    const int tok = 2 * (l % 4) + (e & 1);
    if (row >= n_out || tok >= n_tokens) continue;
    if constexpr (kF32Out)
      static_cast<float*>(y)[tok * y_stride + row] = s;
    else
      static_cast<__nv_bfloat16*>(y)[tok * y_stride + row] = __float2bfloat16_rn(s);
  }
}

// One thread per (row, unit): out[row, 32 unit ..] = the unit's bf16 values. out rows out_stride apart.
template <GgufQuant T>
__global__ void dequantize_gguf_kernel(const uint8_t* __restrict__ body, const uint16_t* __restrict__ d, int n_in,
                                       int64_t n_out, __nv_bfloat16* __restrict__ out, int64_t out_stride) {
  KESTREL_PDL_ENTRY();  // out may still be read by the previous kernel
  const int n_units = n_in / 32;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n_out * n_units) return;
  const int64_t row = i / n_units;
  const int unit = static_cast<int>(i % n_units);
  const int64_t blocks_per_row = n_units / kGgufUnitsPerBlock<T>;
  const uint8_t* b_row = body + row * blocks_per_row * kGgufBody<T>;
  const uint16_t* d_row = d + row * blocks_per_row;
  __nv_bfloat16* o = out + row * out_stride + 32 * unit;
#pragma unroll
  for (int t = 0; t < 4; ++t) {
    uint32_t r[8] = {}, a[4];
    gguf_load_unit<T>(b_row, d_row, unit, t, r);
    gguf_unit_bf16<T>(r, unit, t, a);
    *reinterpret_cast<uint2*>(o + 4 * t) = make_uint2(a[0], a[1]);
    *reinterpret_cast<uint2*>(o + 16 + 4 * t) = make_uint2(a[2], a[3]);
  }
}

// One block per token, threads over the units of its row: out[tok, :] = bf16 values * scale (f32);
// zeros for an id outside the matrix's rows [vocab_begin, vocab_begin + n_rows).
template <GgufQuant T>
__global__ void gguf_embedding_kernel(const uint8_t* __restrict__ body, const uint16_t* __restrict__ d,
                                      const int32_t* __restrict__ ids, int n_in, float scale, float* __restrict__ out,
                                      int64_t vocab_begin, int64_t n_rows) {
  KESTREL_PDL_ENTRY();
  const int64_t tok = blockIdx.x;
  const int n_units = n_in / 32;
  const int64_t blocks_per_row = n_units / kGgufUnitsPerBlock<T>;
  const int64_t row = static_cast<int64_t>(ids[tok]) - vocab_begin;
  if (row < 0 || row >= n_rows) {
    for (int i = static_cast<int>(threadIdx.x); i < n_in; i += static_cast<int>(blockDim.x)) out[tok * n_in + i] = 0.0f;
    return;
  }
  const uint8_t* b_row = body + row * blocks_per_row * kGgufBody<T>;
  const uint16_t* d_row = d + row * blocks_per_row;
  for (int i = static_cast<int>(threadIdx.x); i < 4 * n_units; i += static_cast<int>(blockDim.x)) {
    const int unit = i / 4, t = i % 4;
    uint32_t r[8] = {}, a[4];
    gguf_load_unit<T>(b_row, d_row, unit, t, r);
    gguf_unit_bf16<T>(r, unit, t, a);
    float* o = out + tok * n_in + 32 * unit;
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const int k = (p < 2 ? 4 * t : 16 + 4 * t) + 2 * (p % 2);
      o[k] = __uint_as_float(a[p] << 16) * scale;
      o[k + 1] = __uint_as_float(a[p] & 0xffff0000u) * scale;
    }
  }
}

}  // namespace kestrel::cuda
