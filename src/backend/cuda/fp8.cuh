// FP8 E4M3 on the device: the scalar conversions of core/fp8.h, four codes at a time into the
// bf16x2 fragments the tensor-core kernels multiply (weights stored as E4M3, activations bf16), and
// the FP8 tensor-core product itself (weights and activations both E4M3).
#pragma once

#include "backend/cuda/device_common.cuh"
#include "core/fp8.h"

namespace kestrel::cuda {

// Four E4M3 codes of one 32-bit word (byte i = element i) as two bf16x2 words, exactly:
// lo = {element 0, element 1}, hi = {element 2, element 3} (low half first). Each code's sign
// goes to bf16 bit 15 and its 7 magnitude bits to bits 4..10: the value times 2^-120 (subnormal
// codes included, bf16 sharing f32's exponent range); one bf16x2 multiply by 2^120 then makes it
// exact (bf16 arithmetic keeps subnormal inputs). NaN codes give finite values: weights hold none.
__device__ __forceinline__ void e4m3x4_to_bf16x2(uint32_t w, uint32_t& lo, uint32_t& hi) {
  const uint32_t t0 = __byte_perm(w, 0u, 0x1404);  // {0, b0, 0, b1}: each code in a half's high byte
  const uint32_t t1 = __byte_perm(w, 0u, 0x3424);  // {0, b2, 0, b3}
  const uint32_t s0 = (t0 & 0x80008000u) | ((t0 >> 4) & 0x07F007F0u);
  const uint32_t s1 = (t1 & 0x80008000u) | ((t1 >> 4) & 0x07F007F0u);
  const __nv_bfloat162 k = __floats2bfloat162_rn(1.329227995784916e36f, 1.329227995784916e36f);  // 2^120
  __nv_bfloat162 a, b;
  std::memcpy(&a, &s0, 4);
  std::memcpy(&b, &s1, 4);
  a = __hmul2(a, k);
  b = __hmul2(b, k);
  std::memcpy(&lo, &a, 4);
  std::memcpy(&hi, &b, 4);
}

// Two floats to E4M3 codes (round to nearest even, saturating to +-448, NaN to 0x7F: float_to_e4m3
// of core/fp8.h, which the emulation runs), lo in bits 0..7 and hi in bits 8..15.
__device__ __forceinline__ uint32_t f32x2_to_e4m3x2(float lo, float hi) {
#if defined(KESTREL_CUDA_EMULATE)
  return static_cast<uint32_t>(float_to_e4m3(lo)) | (static_cast<uint32_t>(float_to_e4m3(hi)) << 8);
#else
  uint16_t r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
#endif
}

// The code of x / s as float_to_e4m3(x / s) gives it, for the row quantizers that divide a row of
// bf16 values by one scale: the quotient from the reciprocal (quotient_by_reciprocal, exact where a
// code can tell; a division below kQuotientByReciprocalMinScale and for an infinite scale, as a row
// holding inf has), then the hardware conversion
// (f32x2_to_e4m3x2): a few instructions a value where an IEEE division and float_to_e4m3 in
// software take some 50.
struct E4m3Divisor {
  float s, rs;
  bool by_reciprocal;
  __device__ __forceinline__ explicit E4m3Divisor(float scale)
      : s(scale), rs(1.0f / scale), by_reciprocal(scale >= kQuotientByReciprocalMinScale && scale <= 3.40282347e38f) {}
  __device__ __forceinline__ float quotient(float f) const { return by_reciprocal ? quotient_by_reciprocal(f, s, rs) : f / s; }
  // The codes of f[0..7] / s, f[e] in byte e.
  __device__ __forceinline__ uint2 codes8(const float (&f)[8]) const {
    const uint32_t lo = f32x2_to_e4m3x2(quotient(f[0]), quotient(f[1])) | (f32x2_to_e4m3x2(quotient(f[2]), quotient(f[3])) << 16);
    const uint32_t hi = f32x2_to_e4m3x2(quotient(f[4]), quotient(f[5])) | (f32x2_to_e4m3x2(quotient(f[6]), quotient(f[7])) << 16);
    return make_uint2(lo, hi);
  }
};

#if defined(KESTREL_CUDA_EMULATE)
// mma.m16n8k32 with E4M3 A and B on the host: the fragment layouts of the PTX ISA ("Matrix
// fragments for mma.m16n8k32"), each product exact, the sums in f32 in k order.
inline void emu_mma_e4m3_16832(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  struct Frag {
    uint32_t a[4], b[2];
  };
  const Frag mine{{a[0], a[1], a[2], a[3]}, {b[0], b[1]}};
  Frag all[32];
  emu::warp_exchange(&mine, sizeof mine, all);
  float A[16][32], B[32][8];
  auto code = [](uint32_t w, int i) { return e4m3_to_float(static_cast<uint8_t>(w >> (8 * i))); };
  for (int l = 0; l < 32; ++l) {
    const int g = l / 4, c = (l % 4) * 4;
    for (int i = 0; i < 4; ++i) {
      A[g][c + i] = code(all[l].a[0], i);
      A[g + 8][c + i] = code(all[l].a[1], i);
      A[g][c + 16 + i] = code(all[l].a[2], i);
      A[g + 8][c + 16 + i] = code(all[l].a[3], i);
      B[c + i][g] = code(all[l].b[0], i);
      B[c + 16 + i][g] = code(all[l].b[1], i);
    }
  }
  const int lane = emu::lane_id();
  const int g = lane / 4, c = (lane % 4) * 2;
  for (int i = 0; i < 4; ++i) {
    const int row = g + (i >= 2 ? 8 : 0), col = c + (i & 1);
    float s = 0.0f;
    for (int k = 0; k < 32; ++k) s += A[row][k] * B[k][col];
    d[i] += s;
  }
}
#endif

// d += A (16x32 E4M3, row-major fragment a) * B (32x8 E4M3, column fragment b), f32 accumulate
// (sm_89+). Fragments (PTX ISA, "Matrix fragments for mma.m16n8k32", g = lane / 4, t = lane % 4):
// a[0] rows g, k 4t..4t+3 (byte i = k 4t + i); a[1] row g + 8, the same k; a[2], a[3] as a[0],
// a[1] at k + 16; b[0] column g, k 4t..4t+3; b[1] k + 16; d as mma_bf16_16816's.
__device__ __forceinline__ void mma_e4m3_16832(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#if defined(KESTREL_CUDA_EMULATE)
  emu_mma_e4m3_16832(d, a, b);
#else
  asm(  // no side effects: the compiler may interleave independent mmas
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// The largest of every thread's v in the block, for any whole-warp block of at most 32 warps.
// scratch [32]; reusable when this returns.
__device__ __forceinline__ float block_reduce_max_any(float v, float* scratch) {
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int n_warps = static_cast<int>(blockDim.x) / kWarpSize;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < n_warps ? scratch[lane] : 0.0f;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();
  return v;
}

// Eight f32 weights' scales (data no kernel writes: the read-only path is safe), 16-byte aligned.
__device__ __forceinline__ void load_f32x8(const float* __restrict__ p, float (&f)[8]) {
  const float4 lo = reinterpret_cast<const float4*>(p)[0], hi = reinterpret_cast<const float4*>(p)[1];
  f[0] = lo.x, f[1] = lo.y, f[2] = lo.z, f[3] = lo.w, f[4] = hi.x, f[5] = hi.y, f[6] = hi.z, f[7] = hi.w;
}

__device__ __forceinline__ float round_to_bf16(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// A row's E4M3 codes from values its block holds in registers, with quantize_rows_fp8_kernel's
// rounding (scale = amax / 448, 1 for an all-zero row; q = e4m3(v / scale)): thread j holds chunks
// c = j + i * blockDim.x (i < kChunks, c < n_chunks) of 8 values each, already rounded to bf16
// (the values quantize_rows_fp8 would read back). q_row [n_chunks * 8], *scale_out one f32.
template <int kChunks>
__device__ __forceinline__ void quantize_held_row_fp8(const float (&v)[kChunks][8], int64_t n_chunks, uint8_t* q_row,
                                                      float* scale_out, float* scratch) {
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int64_t c = threadIdx.x + static_cast<int64_t>(i) * blockDim.x;
    if (c < n_chunks) {
#pragma unroll
      for (int e = 0; e < 8; ++e) amax = fmaxf(amax, fabsf(v[i][e]));
    }
  }
  amax = block_reduce_max_any(amax, scratch);
  const float s = amax > 0.0f ? amax / kFp8E4m3Max : 1.0f;
  if (threadIdx.x == 0) *scale_out = s;
  const E4m3Divisor div(s);
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int64_t c = threadIdx.x + static_cast<int64_t>(i) * blockDim.x;
    if (c < n_chunks) *reinterpret_cast<uint2*>(q_row + c * 8) = div.codes8(v[i]);
  }
}

}  // namespace kestrel::cuda
