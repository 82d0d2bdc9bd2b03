// dequantize_row for Q5_0, Q5_1, Q2_K, Q3_K and Q5_K against a float64 decoding written here from
// the GGUF block layouts (ggml-common.h) element by element, reading the raw bytes at their
// offsets rather than through the structs and unpack helpers of the kernels, on random blocks
// (every quant byte random, fp16 scales sane); plus hand-built blocks with values worked out by
// hand. The matmul kernels for these types are checked with the others in test_matmul.cpp.
//
// Tolerance: the product terms are exact in f32 (fp16 scale x small integers), so Q5_0 and Q3_K
// must match exactly; Q5_1, Q2_K and Q5_K add a min, which rounds once: at most half an f32 ulp of
// the larger term, 2^-24 * (|scale term| + |min term|).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "backend/cpu/matmul.h"
#include "backend/cpu/matmul_kernels.h"
#include "core/dtype.h"

using namespace kestrel;
using namespace kestrel::cpu;

namespace {

double half(const uint8_t* p) { return fp16_to_fp32(static_cast<uint16_t>(p[0] | p[1] << 8)); }

// Element e of one block: the value and the magnitude of its terms (for the rounding bound).
struct Decoded {
  double value, magnitude;
};

// Q5_0, 22 bytes: fp16 d | qh[4] | qs[16]. Low 4 bits: low nibble of qs[e] for e < 16, high
// nibble of qs[e - 16] otherwise; 5th bit: bit e of the 32-bit little-endian qh. Value d (q - 16).
// Q5_1, 24 bytes: fp16 d | fp16 m | qh[4] | qs[16]; value d q + m.
Decoded decode_q5(const uint8_t* b, int e, bool with_min) {
  const uint8_t* qh = b + (with_min ? 4 : 2);
  const uint8_t* qs = qh + 4;
  const int lo = e < 16 ? (qs[e] & 15) : (qs[e - 16] >> 4);
  const int hi = (qh[e / 8] >> (e % 8)) & 1;
  const int q = lo + 16 * hi;
  const double d = half(b);
  if (!with_min) return {d * (q - 16), std::fabs(d * (q - 16))};
  const double m = half(b + 2);
  return {d * q + m, std::fabs(d * q) + std::fabs(m)};
}

// The 2-bit field shared by Q2_K and Q3_K: element e = 128 h + 32 j + l sits in bits 2j, 2j + 1 of
// qs[32 h + l].
int two_bits(const uint8_t* qs, int e) { return (qs[32 * (e / 128) + e % 32] >> (2 * ((e % 128) / 32))) & 3; }

// Q2_K, 84 bytes: scales[16] | qs[64] | fp16 d | fp16 dmin. Sub-block e / 16 has scale
// scales[.] & 15 and min scales[.] >> 4; value d sc q - dmin m.
Decoded decode_q2k(const uint8_t* b, int e) {
  const uint8_t sm = b[e / 16];
  const double d = half(b + 80), dmin = half(b + 82);
  const double t = d * (sm & 15) * two_bits(b + 16, e), m = dmin * (sm >> 4);
  return {t - m, std::fabs(t) + std::fabs(m)};
}

// Q3_K, 110 bytes: hmask[32] | qs[64] | scales[12] | fp16 d. q = 2-bit field, minus 4 unless bit
// 4 h + j of hmask[l] is set. The 16 six-bit scales (stored + 32), read as three little-endian
// 32-bit words a0 a1 a2: word i of the unpacked scales (4 scales a byte each) is, for i = 0..3,
// (a[i % 2] >> (4 (i / 2))) & 0x0f0f0f0f for the low 4 bits, ((a2 >> (2 i)) & 0x03030303) << 4
// for the high 2.
Decoded decode_q3k(const uint8_t* b, int e) {
  uint32_t a[3];
  std::memcpy(a, b + 96, 12);
  const int sub = e / 16;
  const int i = sub / 4;
  const uint32_t word = ((a[i % 2] >> (4 * (i / 2))) & 0x0f0f0f0fu) | (((a[2] >> (2 * i)) & 0x03030303u) << 4);
  const int sc = static_cast<int>((word >> (8 * (sub % 4))) & 0xff) - 32;
  const int h = e / 128, j = (e % 128) / 32, l = e % 32;
  const int q = two_bits(b + 32, e) - (((b[l] >> (4 * h + j)) & 1) ? 0 : 4);
  const double v = half(b + 108) * sc * q;
  return {v, std::fabs(v)};
}

// Q5_K, 176 bytes: fp16 d | fp16 dmin | scales[12] | qh[32] | qs[128]. Sub-block s = e / 32,
// l = e % 32: low 4 bits from qs[32 (s / 2) + l] (low nibble for even s), 5th bit = bit s of
// qh[l]. Six-bit scale / min of sub-block s: s < 4: scales[s] & 63 / scales[s + 4] & 63; else the
// low 4 bits from scales[s + 4] (scale: low nibble, min: high) and the top 2 from the top bits of
// scales[s - 4] (scale) and scales[s] (min). Value d sc q - dmin m.
Decoded decode_q5k(const uint8_t* b, int e) {
  const uint8_t* sc12 = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* qs = b + 48;
  const int s = e / 32, l = e % 32;
  int sc, m;
  if (s < 4) {
    sc = sc12[s] & 63;
    m = sc12[s + 4] & 63;
  } else {
    sc = (sc12[s + 4] & 15) | (sc12[s - 4] >> 6) << 4;
    m = (sc12[s + 4] >> 4) | (sc12[s] >> 6) << 4;
  }
  const int lo = (s % 2 == 0) ? (qs[32 * (s / 2) + l] & 15) : (qs[32 * (s / 2) + l] >> 4);
  const int q = lo + 16 * ((qh[l] >> s) & 1);
  const double t = half(b) * sc * q, mm = half(b + 2) * m;
  return {t - mm, std::fabs(t) + std::fabs(mm)};
}

Decoded decode(GgmlType type, const uint8_t* block, int e) {
  switch (type) {
    case GgmlType::Q5_0: return decode_q5(block, e, false);
    case GgmlType::Q5_1: return decode_q5(block, e, true);
    case GgmlType::Q2_K: return decode_q2k(block, e);
    case GgmlType::Q3_K: return decode_q3k(block, e);
    case GgmlType::Q5_K: return decode_q5k(block, e);
    default: ADD_FAILURE() << "no decoder"; return {0, 0};
  }
}

void put_half(uint8_t* p, float v) {
  const uint16_t h = fp32_to_fp16(v);
  p[0] = static_cast<uint8_t>(h & 0xff);
  p[1] = static_cast<uint8_t>(h >> 8);
}

// Random bytes with sane fp16 scales (either sign), at the offsets the decoders above use.
std::vector<uint8_t> random_blocks(GgmlType type, int n_blocks, std::mt19937& rng) {
  const size_t bb = type_traits(type).block_bytes;
  std::vector<uint8_t> data(bb * static_cast<size_t>(n_blocks));
  std::uniform_int_distribution<int> byte(0, 255);
  for (auto& v : data) v = static_cast<uint8_t>(byte(rng));
  std::uniform_real_distribution<float> scale(-0.05f, 0.05f);
  for (int i = 0; i < n_blocks; ++i) {
    uint8_t* b = data.data() + i * bb;
    switch (type) {
      case GgmlType::Q5_0: put_half(b, scale(rng)); break;
      case GgmlType::Q5_1:
      case GgmlType::Q5_K:
        put_half(b, scale(rng));
        put_half(b + 2, scale(rng));
        break;
      case GgmlType::Q2_K:
        put_half(b + 80, scale(rng));
        put_half(b + 82, scale(rng));
        break;
      case GgmlType::Q3_K: put_half(b + 108, scale(rng)); break;
      default: break;
    }
  }
  return data;
}

}  // namespace

TEST(KernelDequantize, NewTypesMatchFloat64Decoding) {
  std::mt19937 rng(2024);
  for (GgmlType type : {GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::Q2_K, GgmlType::Q3_K, GgmlType::Q5_K}) {
    const auto& tr = type_traits(type);
    const int n_blocks = type == GgmlType::Q5_0 || type == GgmlType::Q5_1 ? 64 : 16;
    const auto data = random_blocks(type, n_blocks, rng);
    const int64_t n = n_blocks * tr.block_size;
    std::vector<float> out(static_cast<size_t>(n));
    dequantize_row(type, data.data(), out.data(), n);
    const bool exact = type == GgmlType::Q5_0 || type == GgmlType::Q3_K;
    int bad = 0, nonzero = 0;
    for (int64_t i = 0; i < n && bad < 5; ++i) {
      const Decoded want = decode(type, data.data() + (i / tr.block_size) * tr.block_bytes, static_cast<int>(i % tr.block_size));
      const double tol = exact ? 0.0 : std::ldexp(want.magnitude, -24);
      nonzero += want.value != 0.0;
      if (!(std::fabs(out[i] - want.value) <= tol)) {
        ++bad;
        ADD_FAILURE() << type_name(type) << " element " << i << ": got " << out[i] << ", want " << want.value;
      }
    }
    EXPECT_GT(nonzero, n / 2) << type_name(type);  // the comparison is not between zeros
  }
}

TEST(KernelDequantize, Q5_0) {
  BlockQ5_0 blk{};
  blk.d = 0x3800;  // 0.5
  // Element 0: low nibble 3, 5th bit (qh bit 0) set -> 19 - 16 = 3. Element 16: high nibble 0xa,
  // qh bit 16 clear -> 10 - 16 = -6. Element 31: high nibble of qs[15] = 0xf, qh bit 31 set -> 15.
  // Element 9: nibble 0, qh bit 9 clear -> -16.
  blk.qs[0] = 0xa3;
  blk.qs[15] = 0xf0;
  blk.qh[0] = 0x01;
  blk.qh[3] = 0x80;
  float out[32];
  dequantize_row(GgmlType::Q5_0, reinterpret_cast<const uint8_t*>(&blk), out, 32);
  EXPECT_EQ(out[0], 1.5f);
  EXPECT_EQ(out[16], -3.0f);
  EXPECT_EQ(out[31], 7.5f);
  EXPECT_EQ(out[15], -8.0f);  // nibble 0, qh bit 15 clear
  EXPECT_EQ(out[9], -8.0f);
}

TEST(KernelDequantize, Q5_1) {
  BlockQ5_1 blk{};
  blk.d = 0x3400;  // 0.25
  blk.m = 0xc000;  // -2
  blk.qs[2] = 0x5c;  // element 2: 12, element 18: 5
  blk.qh[2] = 0x04;  // bit 18 -> element 18: 21
  float out[32];
  dequantize_row(GgmlType::Q5_1, reinterpret_cast<const uint8_t*>(&blk), out, 32);
  EXPECT_EQ(out[2], 0.25f * 12 - 2);   // 1
  EXPECT_EQ(out[18], 0.25f * 21 - 2);  // 3.25
  EXPECT_EQ(out[0], -2.0f);
}

TEST(KernelDequantize, Q2_K) {
  BlockQ2_K blk{};
  blk.d = 0x3800;     // 0.5
  blk.dmin = 0x3400;  // 0.25
  blk.scales[0] = 0x23;   // sub-block 0: scale 3, min 2
  blk.scales[2] = 0x15;   // sub-block 2 (elements 32..47): scale 5, min 1
  blk.scales[15] = 0xf7;  // sub-block 15 (elements 240..255): scale 7, min 15
  blk.qs[0] = 0x06;       // element 0: bits 0-1 = 2; element 32: bits 2-3 = 1
  blk.qs[63] = 0xc0;      // element 128 + 96 + 31 = 255: bits 6-7 of qs[32 + 31] = 3
  float out[256];
  dequantize_row(GgmlType::Q2_K, reinterpret_cast<const uint8_t*>(&blk), out, 256);
  EXPECT_EQ(out[0], 0.5f * 3 * 2 - 0.25f * 2);   // 2.5
  EXPECT_EQ(out[32], 0.5f * 5 * 1 - 0.25f * 1);  // 2.25
  EXPECT_EQ(out[255], 0.5f * 7 * 3 - 0.25f * 15);  // 6.75
  EXPECT_EQ(out[1], -0.5f);                      // q = 0: -dmin * m
}

TEST(KernelDequantize, Q3_K) {
  BlockQ3_K blk{};
  blk.d = 0x3800;  // 0.5
  // Scales (stored + 32): sub-block 0: low 4 bits from scales[0] low nibble, high 2 bits from
  // scales[8] bits 0-1; sub-block 9: scales[1] high nibble, scales[9] bits 4-5; sub-block 15:
  // scales[7] high nibble, scales[11] bits 6-7.
  blk.scales[0] = 0x05;   // sc0 low 5
  blk.scales[8] = 0x02;   // sc0 high 2 -> 37 - 32 = 5
  blk.scales[1] = 0xf0;   // sc9 low 15
  blk.scales[9] = 0x10;   // sc9 high 1 -> 31 - 32 = -1
  blk.scales[7] = 0x00;   // sc15 low 0
  blk.scales[11] = 0xc0;  // sc15 high 3 -> 48 - 32 = 16
  // Element 0: bits 0-1 of qs[0] = 3, hmask[0] bit 0 set -> 3. Element 144 (h 1, j 0, l 16):
  // bits 0-1 of qs[48] = 1, hmask[16] bit 4 clear -> 1 - 4 = -3. Element 255 (h 1, j 3, l 31):
  // bits 6-7 of qs[63] = 2, hmask[31] bit 7 set -> 2.
  blk.qs[0] = 0x03;
  blk.hmask[0] = 0x01;
  blk.qs[48] = 0x01;
  blk.qs[63] = 0x80;
  blk.hmask[31] = 0x80;
  float out[256];
  dequantize_row(GgmlType::Q3_K, reinterpret_cast<const uint8_t*>(&blk), out, 256);
  EXPECT_EQ(out[0], 0.5f * 5 * 3);     // 7.5
  EXPECT_EQ(out[1], 0.5f * 5 * -4);    // q = 0 with the high bit clear: -4
  EXPECT_EQ(out[144], 0.5f * -1 * -3);  // 1.5
  EXPECT_EQ(out[255], 0.5f * 16 * 2);   // 16
  EXPECT_EQ(out[16], 0.5f * -32 * -4);  // sub-block 1: stored scale 0 -> -32
}

TEST(KernelDequantize, Q5_K) {
  BlockQ5_K blk{};
  blk.d = 0x3800;     // 0.5
  blk.dmin = 0x3400;  // 0.25
  blk.scales[1] = 3;     // sub-block 1: scale 3
  blk.scales[5] = 2;     // sub-block 1: min 2
  blk.scales[2] = 0x40;  // sub-block 2: scale 0; top bits 01 -> sub-block 6 scale bits 4-5
  blk.scales[10] = 0x31;  // sub-block 6: scale 1 | 1 << 4 = 17, min 3
  blk.qs[5] = 0x90;      // element 32 + 5 (sub-block 1, high nibble): 9
  blk.qh[5] = 0x02;      // bit 1: sub-block 1 element 5 gets +16 -> 25
  blk.qs[96 + 7] = 0x0b;  // element 192 + 7 (sub-block 6, low nibble): 11
  float out[256];
  dequantize_row(GgmlType::Q5_K, reinterpret_cast<const uint8_t*>(&blk), out, 256);
  EXPECT_EQ(out[37], 0.5f * 3 * 25 - 0.25f * 2);   // 37
  EXPECT_EQ(out[199], 0.5f * 17 * 11 - 0.25f * 3);  // 92.75
  EXPECT_EQ(out[64], 0.0f);                         // sub-block 2: scale 0, min 0
}

// The SIMD kernels take Q4_K / Q5_K scales and mins apart with word operations
// (q4k_scales_mins); they must agree with the per-sub-block reading of the dequantizer.
TEST(KernelDequantize, K4ScalesMinsWordsMatchPerSubBlock) {
  std::mt19937 rng(17);
  std::uniform_int_distribution<int> byte(0, 255);
  for (int trial = 0; trial < 2000; ++trial) {
    uint8_t s[12];
    for (auto& v : s) v = static_cast<uint8_t>(byte(rng));
    uint64_t sc8, m8;
    detail::q4k_scales_mins(s, &sc8, &m8);
    for (int j = 0; j < 8; ++j) {
      int sc, m;
      detail::q4k_scale_min(s, j, &sc, &m);
      ASSERT_EQ(static_cast<int>((sc8 >> (8 * j)) & 0xff), sc) << "trial " << trial << " j " << j;
      ASSERT_EQ(static_cast<int>((m8 >> (8 * j)) & 0xff), m) << "trial " << trial << " j " << j;
    }
  }
}

// Likewise Q3_K's scales (q3k_scales_biased, offset by 32) against q3k_scales.
TEST(KernelDequantize, K3ScalesWordsMatchPerScale) {
  std::mt19937 rng(19);
  std::uniform_int_distribution<int> byte(0, 255);
  for (int trial = 0; trial < 2000; ++trial) {
    uint8_t s[12];
    uint32_t w[4];
    int8_t want[16];
    for (auto& v : s) v = static_cast<uint8_t>(byte(rng));
    detail::q3k_scales_biased(s, w);
    detail::q3k_scales(s, want);
    for (int i = 0; i < 16; ++i)
      ASSERT_EQ(static_cast<int>((w[i / 4] >> (8 * (i % 4))) & 0xff) - 32, want[i]) << "trial " << trial << " scale " << i;
  }
}
