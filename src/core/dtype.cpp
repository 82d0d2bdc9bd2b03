#include "core/dtype.h"

#include <array>
#include <cmath>

#include "core/error.h"

namespace kestrel {
namespace {

struct Entry {
  uint32_t id;
  TypeTraits traits;
};

// Sizes from ggml-common.h (block structs) for every type id GGUF files use in practice.
constexpr std::array<Entry, 20> kTypes{{
    {0, {"F32", 1, 4}},
    {1, {"F16", 1, 2}},
    {2, {"Q4_0", 32, 18}},
    {3, {"Q4_1", 32, 20}},
    {6, {"Q5_0", 32, 22}},
    {7, {"Q5_1", 32, 24}},
    {8, {"Q8_0", 32, 34}},
    {9, {"Q8_1", 32, 36}},
    {10, {"Q2_K", 256, 84}},
    {11, {"Q3_K", 256, 110}},
    {12, {"Q4_K", 256, 144}},
    {13, {"Q5_K", 256, 176}},
    {14, {"Q6_K", 256, 210}},
    {15, {"Q8_K", 256, 292}},
    {24, {"I8", 1, 1}},
    {25, {"I16", 1, 2}},
    {26, {"I32", 1, 4}},
    {27, {"I64", 1, 8}},
    {28, {"F64", 1, 8}},
    {30, {"BF16", 1, 2}},
}};

}  // namespace

std::optional<TypeTraits> type_traits(uint32_t type_id) {
  for (const auto& e : kTypes)
    if (e.id == type_id) return e.traits;
  return std::nullopt;
}

const TypeTraits& type_traits(GgmlType type) {
  for (const auto& e : kTypes)
    if (e.id == static_cast<uint32_t>(type)) return e.traits;
  KESTREL_ASSERT(false, "unknown GgmlType " + std::to_string(static_cast<uint32_t>(type)));
}

float fp16_to_fp32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalize
      exp = 127 - 15 + 1;
      while ((mant & 0x400u) == 0) {
        mant <<= 1;
        --exp;
      }
      mant &= 0x3ffu;
      bits = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t fp32_to_fp16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t absx = x & 0x7fffffffu;
  if (absx >= 0x7f800000u) return sign | 0x7c00u | (absx > 0x7f800000u ? 0x200u : 0);  // inf/nan
  if (absx >= 0x477ff000u) return sign | 0x7c00u;  // rounds to >= 65520: overflow to inf
  if (absx < 0x38800000u) {                           // result is subnormal or zero
    if (absx < 0x33000000u) return sign;              // below half the smallest subnormal
    const uint32_t e = absx >> 23;
    const uint32_t m = (absx & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - e;  // 14 + (113 - e)
    uint32_t r = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1);
    const uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return sign | static_cast<uint16_t>(r);
  }
  uint32_t r = absx + 0xfffu + ((absx >> 13) & 1u);  // round to nearest even on the 13 dropped bits
  r -= 0x38000000u;                                   // rebias exponent 127 -> 15
  return sign | static_cast<uint16_t>(r >> 13);
}

uint16_t fp32_to_bf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // quiet NaN
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}

}  // namespace kestrel
