// INT4 decoding helpers shared by the int4 kernels (int4_gemm.cuh, stream_gemv_narrow.cuh): meta
// word loads, the scale and zero of a meta word (int4_ops.h has the layout), and the bf16 pair
// subtraction that leaves q - z exactly.
#pragma once

#include "backend/cuda/device_common.cuh"

namespace kestrel::cuda {

// a - b on a pair of bf16 (round to nearest; exact for the small integers used here).
__device__ __forceinline__ uint32_t bf16x2_sub(uint32_t a, uint32_t b) {
#if defined(KESTREL_CUDA_EMULATE)
  return pack_bf16x2(emu_bf16(a, 0) - emu_bf16(b, 0), emu_bf16(a, 1) - emu_bf16(b, 1));
#else
  uint32_t d;
  asm("sub.rn.bf16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  return d;
#endif
}

// The bf16 pair {128 + q0, 128 + q1} of the codes at bits 0-3 and 16-19 of v: (v & 0x000F000F) |
// 0x43004300, written as one lop3 (the compiler otherwise splits the AND and the OR, an immediate
// each).
__device__ __forceinline__ uint32_t int4_bf16_pair(uint32_t v) {
#if defined(KESTREL_CUDA_EMULATE)
  return (v & 0x000F000Fu) | 0x43004300u;
#else
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(r) : "r"(v), "r"(0x000F000Fu), "r"(0x43004300u));
  return r;
#endif
}

// The scale of a meta word (its low 16 bits, f16 or bf16) as f32, exactly.
__device__ __forceinline__ float int4_scale(uint32_t m, bool f16) {
  if (!f16) return __uint_as_float(m << 16);
#if defined(KESTREL_CUDA_EMULATE)
  const uint32_t h = m & 0xFFFFu, sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, f = h & 0x3FFu;
  if (e == 0x1F) return __uint_as_float(sign | 0x7F800000u | (f << 13));
  if (e != 0) return __uint_as_float(sign | ((e + 112) << 23) | (f << 13));
  const float v = static_cast<float>(f) * 5.9604644775390625e-8f;  // subnormal: f 2^-24
  return sign != 0 ? -v : v;
#else
  float v;
  asm("cvt.f32.f16 %0, %1;\n" : "=f"(v) : "h"(static_cast<unsigned short>(m & 0xFFFFu)));
  return v;
#endif
}
// The pair {128 + z, 128 + z} of a meta word.
__device__ __forceinline__ uint32_t int4_zero_pair(uint32_t m) { return (m & 0xFFFF0000u) | (m >> 16); }

}  // namespace kestrel::cuda
