// FP8 E4M3 on the device: the scalar conversions of core/fp8.h, and four codes at a time into the
// bf16x2 fragments the tensor-core kernels multiply (weights stored as E4M3, activations bf16).
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

}  // namespace kestrel::cuda
