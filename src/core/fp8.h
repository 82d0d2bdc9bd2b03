// FP8 E4M3 scalars (OCP 8-bit floating point specification, "E4M3": 1 sign bit, 4 exponent bits
// with bias 7, 3 mantissa bits, no infinities, 0x7F / 0xFF NaN, largest finite 448): the exact
// value of a code, and round-to-nearest-even with saturation. Plain C++, also compiled for the
// device by the CUDA kernels (KESTREL_HOST_DEVICE), so host references round as the kernels do.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define KESTREL_HOST_DEVICE __host__ __device__
#else
#define KESTREL_HOST_DEVICE
#endif

namespace kestrel {

inline constexpr float kFp8E4m3Max = 448.0f;

// f / s rounded to nearest as an IEEE division rounds it, from rs = 1 / s (rounded to nearest) by
// one FMA correction of the product: three instructions instead of a division's dozen, for the
// quantizers that divide a whole row by one scale. Markstein, "Computation of elementary functions
// on the IBM RISC System/6000 processor" (1990): exact while the remainder does not underflow,
// which holds for s >= 2^-40 and |f / s| >= 2^-60 (smaller quotients may differ in their last
// bit, far below E4M3's smallest subnormal 2^-9, so their codes agree); for a smaller s, divide.
inline constexpr float kQuotientByReciprocalMinScale = 0x1p-40f;
KESTREL_HOST_DEVICE inline float quotient_by_reciprocal(float f, float s, float rs) {
  const float q = f * rs;
  // The sign copied from f: the correction turns -0 / s into +0 (a zero's code would lose its sign).
#if defined(__CUDA_ARCH__)
  return copysignf(fmaf(fmaf(-q, s, f), rs, q), f);
#else
  return std::copysign(std::fma(std::fma(-q, s, f), rs, q), f);
#endif
}

KESTREL_HOST_DEVICE inline float fp8_bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
KESTREL_HOST_DEVICE inline uint32_t fp8_float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// The value of an E4M3 code (exact in f32). NaN codes give NaN.
KESTREL_HOST_DEVICE inline float e4m3_to_float(uint8_t b) {
  const uint32_t mag = b & 0x7Fu;
  if (mag == 0x7Fu) return fp8_bits_to_float(0x7FC00000u);
  // The exponent field into the low 4 bits of f32's: the value times 2^-120, subnormal codes
  // included (f32 exponent 0 is its own subnormal range); the multiply by 2^120 is exact.
  const float v = fp8_bits_to_float(mag << 20) * 1.329227995784916e36f;
  return (b & 0x80u) != 0 ? -v : v;
}

// Rounds x to the nearest E4M3 value, ties to even, saturating to +-448 (values past 448 give 448,
// as the hardware's satfinite conversion does); NaN gives 0x7F.
KESTREL_HOST_DEVICE inline uint8_t float_to_e4m3(float x) {
  const uint32_t u = fp8_float_to_bits(x);
  const auto sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return 0x7F;
  const float ax = fp8_bits_to_float(a);
  if (ax >= 448.0f) return static_cast<uint8_t>(sign | 0x7Eu);
  // |x| / step on the code's grid: step 2^-9 below 2^-6 (subnormal codes), else 2^(e-3) for
  // exponent e. The quotient is exact (a power-of-two divisor); round it to an integer, ties to even.
  const int e = ax < 0.015625f ? -6 : static_cast<int>((a >> 23) & 0xFFu) - 127;
  const float step = fp8_bits_to_float(static_cast<uint32_t>(e - 3 + 127) << 23);
  const float q = ax / step;
  auto r = static_cast<uint32_t>(q);
  const float frac = q - static_cast<float>(r);
  if (frac > 0.5f || (frac == 0.5f && (r & 1u) != 0)) ++r;
  // Subnormal range: r in 0..8 is the code itself (8 = the smallest normal, 2^-6). Normal: r in
  // 8..16 is 1.mmm x 8; 16 carries into the next exponent.
  if (e == -6) return static_cast<uint8_t>(sign | r);
  uint32_t m = r, ex = static_cast<uint32_t>(e + 7);
  if (m == 16) m = 8, ++ex;
  if (ex > 15 || (ex == 15 && m - 8 > 6)) return static_cast<uint8_t>(sign | 0x7Eu);
  return static_cast<uint8_t>(sign | (ex << 3) | (m - 8));
}

}  // namespace kestrel
