// Tensor element types and quantization block layouts.
//
// The numeric values of GgmlType are the GGUF on-disk type ids (ggml.h, enum ggml_type), so a GGUF
// tensor's type field converts directly. Block structs match ggml's byte layout exactly
// (ggml-common.h): a quantized row of n elements is n / block_size blocks stored back to back.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>

namespace kestrel {

enum class GgmlType : uint32_t {
  F32 = 0,
  F16 = 1,
  Q4_0 = 2,
  Q4_1 = 3,
  Q5_0 = 6,
  Q5_1 = 7,
  Q8_0 = 8,
  Q8_1 = 9,
  Q2_K = 10,
  Q3_K = 11,
  Q4_K = 12,
  Q5_K = 13,
  Q6_K = 14,
  Q8_K = 15,
  I8 = 24,
  I16 = 25,
  I32 = 26,
  I64 = 27,
  F64 = 28,
  BF16 = 30,
};

struct TypeTraits {
  std::string_view name;
  int64_t block_size;   // elements per block (1 for plain types)
  size_t block_bytes;   // bytes per block
};

// Traits of a GGUF type id, or nullopt for an id kestrel does not know (the caller names the error).
std::optional<TypeTraits> type_traits(uint32_t type_id);
const TypeTraits& type_traits(GgmlType type);  // for known types only
inline std::string_view type_name(GgmlType t) { return type_traits(t).name; }
// Bytes of a row of n elements; n must be a multiple of the block size.
inline size_t row_bytes(GgmlType t, int64_t n) {
  const auto& tr = type_traits(t);
  return static_cast<size_t>(n / tr.block_size) * tr.block_bytes;
}

// IEEE half and bfloat16 conversions (round to nearest even).
float fp16_to_fp32(uint16_t h);
uint16_t fp32_to_fp16(float f);
inline float bf16_to_fp32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint16_t fp32_to_bf16(float f);

// ---- quantization blocks (ggml layout) ----
constexpr int QK4_0 = 32;
constexpr int QK4_1 = 32;
constexpr int QK5_0 = 32;
constexpr int QK5_1 = 32;
constexpr int QK8_0 = 32;
constexpr int QK8_1 = 32;
constexpr int QK_K = 256;
constexpr int K_SCALE_SIZE = 12;

struct BlockQ4_0 {
  uint16_t d;             // fp16 scale
  uint8_t qs[QK4_0 / 2];  // nibbles: element i in low nibble of qs[i], element i+16 in high nibble
};
struct BlockQ4_1 {
  uint16_t d;  // fp16 scale
  uint16_t m;  // fp16 min
  uint8_t qs[QK4_1 / 2];
};
struct BlockQ5_0 {
  uint16_t d;             // fp16 scale
  uint8_t qh[4];          // bit i of the little-endian uint32: the 5th bit of element i
  uint8_t qs[QK5_0 / 2];  // low 4 bits, nibble order of Q4_0; value d * (q - 16)
};
struct BlockQ5_1 {
  uint16_t d;  // fp16 scale
  uint16_t m;  // fp16 min; value d * q + m
  uint8_t qh[4];
  uint8_t qs[QK5_1 / 2];
};
struct BlockQ8_0 {
  uint16_t d;  // fp16 scale
  int8_t qs[QK8_0];
};
struct BlockQ8_1 {
  uint16_t d;  // fp16 scale
  uint16_t s;  // fp16 d * sum(qs)
  int8_t qs[QK8_1];
};
struct BlockQ2_K {
  uint8_t scales[QK_K / 16];  // per 16 elements: 4-bit scale (low nibble), 4-bit min (high nibble)
  uint8_t qs[QK_K / 4];       // 2-bit quants: element 128h + 32j + l in bits 2j..2j+1 of qs[32h + l]
  uint16_t d;                 // fp16 super-block scale for the scales
  uint16_t dmin;              // fp16 super-block scale for the mins
};
struct BlockQ3_K {
  uint8_t hmask[QK_K / 8];       // bit 4h + j of hmask[l] clear: element 128h + 32j + l is low - 4
  uint8_t qs[QK_K / 4];          // low 2 bits, arranged as in Q2_K
  uint8_t scales[K_SCALE_SIZE];  // 16 six-bit scales per 16 elements, stored + 32
  uint16_t d;                    // fp16 super-block scale; value d * (scale - 32) * q
};
struct BlockQ4_K {
  uint16_t d;                     // fp16 super-block scale for the quantized scales
  uint16_t dmin;                  // fp16 super-block scale for the quantized mins
  uint8_t scales[K_SCALE_SIZE];   // 8 scales and 8 mins, 6 bits each
  uint8_t qs[QK_K / 2];           // 4-bit quants
};
struct BlockQ5_K {
  uint16_t d;                    // fp16 super-block scale for the quantized scales
  uint16_t dmin;                 // fp16 super-block scale for the quantized mins
  uint8_t scales[K_SCALE_SIZE];  // as in Q4_K
  uint8_t qh[QK_K / 8];          // 5th bit of element 32s + l: bit s of qh[l]
  uint8_t qs[QK_K / 2];          // low 4 bits, arranged as in Q4_K
};
struct BlockQ6_K {
  uint8_t ql[QK_K / 2];      // low 4 bits
  uint8_t qh[QK_K / 4];      // high 2 bits
  int8_t scales[QK_K / 16];  // 8-bit scales of 16-element sub-blocks
  uint16_t d;                // fp16 super-block scale
};
struct BlockQ8_K {
  float d;                    // f32 scale
  int8_t qs[QK_K];
  int16_t bsums[QK_K / 16];   // sums of groups of 16 quants
};
static_assert(sizeof(BlockQ4_0) == 18);
static_assert(sizeof(BlockQ4_1) == 20);
static_assert(sizeof(BlockQ5_0) == 22);
static_assert(sizeof(BlockQ5_1) == 24);
static_assert(sizeof(BlockQ8_0) == 34);
static_assert(sizeof(BlockQ8_1) == 36);
static_assert(sizeof(BlockQ2_K) == 84);
static_assert(sizeof(BlockQ3_K) == 110);
static_assert(sizeof(BlockQ4_K) == 144);
static_assert(sizeof(BlockQ5_K) == 176);
static_assert(sizeof(BlockQ6_K) == 210);
static_assert(sizeof(BlockQ8_K) == 292);

}  // namespace kestrel
