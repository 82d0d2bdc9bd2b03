// dequantize_row: the plain-C++ definition of every supported block format. The tests build blocks
// by hand and check these values exactly; the matmul tests then use this function as the
// reference, so it is deliberately written for clarity, not speed.
#include <cstring>
#include <string>

#include "backend/cpu/matmul_kernels.h"
#include "core/error.h"

namespace kestrel::cpu {
namespace detail {

void q4k_unpack(const BlockQ4_K& b, uint8_t q[QK_K]) {
  // Each 32-byte run of qs holds two sub-blocks: the low nibbles are elements 64j..64j+31, the high
  // nibbles elements 64j+32..64j+63.
  for (int j = 0; j < QK_K / 64; ++j) {
    for (int l = 0; l < 32; ++l) {
      const uint8_t byte = b.qs[32 * j + l];
      q[64 * j + l] = byte & 0x0f;
      q[64 * j + 32 + l] = byte >> 4;
    }
  }
}

void q6k_unpack(const BlockQ6_K& b, int8_t q[QK_K]) {
  // Each 128-element half uses 64 bytes of ql and 32 of qh. Element 32k + l of the half (k < 4,
  // l < 32) takes its low 4 bits from ql[(k & 1) * 32 + l] (low nibble for k < 2, high for k >= 2)
  // and its high 2 bits from bits 2k..2k+1 of qh[l].
  for (int half = 0; half < 2; ++half) {
    const uint8_t* ql = b.ql + 64 * half;
    const uint8_t* qh = b.qh + 32 * half;
    int8_t* out = q + 128 * half;
    for (int k = 0; k < 4; ++k) {
      for (int l = 0; l < 32; ++l) {
        const uint8_t lo4 = (k < 2) ? (ql[(k & 1) * 32 + l] & 0x0f) : (ql[(k & 1) * 32 + l] >> 4);
        const uint8_t hi2 = (qh[l] >> (2 * k)) & 3;
        out[32 * k + l] = static_cast<int8_t>((lo4 | (hi2 << 4)) - 32);
      }
    }
  }
}

void q5_unpack(const uint8_t qh[4], const uint8_t qs[16], uint8_t q[32]) {
  // Nibbles as in Q4_0 (element l low, l + 16 high); the 5th bit of element i is bit i of qh read
  // as a little-endian uint32.
  const uint32_t h = static_cast<uint32_t>(qh[0]) | static_cast<uint32_t>(qh[1]) << 8 |
                     static_cast<uint32_t>(qh[2]) << 16 | static_cast<uint32_t>(qh[3]) << 24;
  for (int l = 0; l < 16; ++l) {
    q[l] = static_cast<uint8_t>((qs[l] & 0x0f) | ((h >> l) & 1) << 4);
    q[l + 16] = static_cast<uint8_t>((qs[l] >> 4) | ((h >> (l + 16)) & 1) << 4);
  }
}

void q5k_unpack(const BlockQ5_K& b, uint8_t q[QK_K]) {
  // Low 4 bits as in Q4_K (sub-block s from the low nibbles of qs[32 (s / 2) ..] for even s, the
  // high nibbles for odd s); the 5th bit of element 32s + l is bit s of qh[l].
  for (int s = 0; s < QK_K / 32; ++s) {
    for (int l = 0; l < 32; ++l) {
      const uint8_t byte = b.qs[32 * (s / 2) + l];
      const uint8_t lo4 = (s % 2 == 0) ? (byte & 0x0f) : (byte >> 4);
      q[32 * s + l] = static_cast<uint8_t>(lo4 | ((b.qh[l] >> s) & 1) << 4);
    }
  }
}

void q3k_unpack(const BlockQ3_K& b, int8_t q[QK_K]) {
  // The 2-bit arrangement of Q2_K (q2k_unpack); the high bit of element 128h + 32j + l is bit
  // 4h + j of hmask[l], and where it is clear the value is the low 2 bits minus 4.
  for (int h = 0; h < 2; ++h)
    for (int j = 0; j < 4; ++j)
      for (int l = 0; l < 32; ++l) {
        const int low = (b.qs[32 * h + l] >> (2 * j)) & 3;
        const bool high = (b.hmask[l] >> (4 * h + j)) & 1;
        q[128 * h + 32 * j + l] = static_cast<int8_t>(low - (high ? 0 : 4));
      }
}

void q3k_scales(const uint8_t s[K_SCALE_SIZE], int8_t sc[QK_K / 16]) {
  // Scale i: low 4 bits from the low nibble of s[i] (i < 8) or the high nibble of s[i - 8];
  // high 2 bits from bits 2 (i / 4)..2 (i / 4) + 1 of s[8 + i % 4]; stored with an offset of 32.
  for (int i = 0; i < QK_K / 16; ++i) {
    const int lo = i < 8 ? (s[i] & 0x0f) : (s[i - 8] >> 4);
    const int hi = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
    sc[i] = static_cast<int8_t>((lo | hi << 4) - 32);
  }
}

void q2k_unpack(const BlockQ2_K& b, uint8_t q[QK_K]) {
  // Each 128-element half h uses 32 bytes of qs: element 128h + 32j + l (j < 4, l < 32) is bits
  // 2j..2j+1 of qs[32h + l].
  for (int h = 0; h < 2; ++h)
    for (int j = 0; j < 4; ++j)
      for (int l = 0; l < 32; ++l) q[128 * h + 32 * j + l] = (b.qs[32 * h + l] >> (2 * j)) & 3;
}

}  // namespace detail

bool matmul_supports(GgmlType type) {
  switch (type) {
    case GgmlType::F32:
    case GgmlType::F16:
    case GgmlType::BF16:
    case GgmlType::Q8_0:
    case GgmlType::Q4_0:
    case GgmlType::Q4_1:
    case GgmlType::Q5_0:
    case GgmlType::Q5_1:
    case GgmlType::Q2_K:
    case GgmlType::Q3_K:
    case GgmlType::Q4_K:
    case GgmlType::Q5_K:
    case GgmlType::Q6_K:
      return true;
    default:
      return false;
  }
}

void dequantize_row(GgmlType type, const uint8_t* src, float* dst, int64_t n) {
  if (!matmul_supports(type))
    throw Error("dequantize_row: unsupported weight type " + std::string(type_name(type)));
  const int64_t bs = type_traits(type).block_size;
  if (n % bs != 0)
    throw Error("dequantize_row: n = " + std::to_string(n) + " is not a multiple of the " +
                std::string(type_name(type)) + " block size " + std::to_string(bs));
  const int64_t nb = n / bs;
  switch (type) {
    case GgmlType::F32:
      std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
      return;
    case GgmlType::F16:
    case GgmlType::BF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        dst[i] = type == GgmlType::F16 ? fp16_to_fp32(h) : bf16_to_fp32(h);
      }
      return;
    case GgmlType::Q8_0: {
      const auto* b = reinterpret_cast<const BlockQ8_0*>(src);
      for (int64_t i = 0; i < nb; ++i) {
        const float d = fp16_to_fp32(b[i].d);
        for (int l = 0; l < QK8_0; ++l) dst[i * QK8_0 + l] = d * b[i].qs[l];
      }
      return;
    }
    case GgmlType::Q4_0: {
      // Element l (< 16) is the low nibble of qs[l], element l + 16 its high nibble; value d * (q - 8).
      const auto* b = reinterpret_cast<const BlockQ4_0*>(src);
      for (int64_t i = 0; i < nb; ++i) {
        const float d = fp16_to_fp32(b[i].d);
        for (int l = 0; l < QK4_0 / 2; ++l) {
          dst[i * QK4_0 + l] = d * ((b[i].qs[l] & 0x0f) - 8);
          dst[i * QK4_0 + l + 16] = d * ((b[i].qs[l] >> 4) - 8);
        }
      }
      return;
    }
    case GgmlType::Q4_1: {
      // Same nibble order as Q4_0; value d * q + m.
      const auto* b = reinterpret_cast<const BlockQ4_1*>(src);
      for (int64_t i = 0; i < nb; ++i) {
        const float d = fp16_to_fp32(b[i].d);
        const float m = fp16_to_fp32(b[i].m);
        for (int l = 0; l < QK4_1 / 2; ++l) {
          dst[i * QK4_1 + l] = d * (b[i].qs[l] & 0x0f) + m;
          dst[i * QK4_1 + l + 16] = d * (b[i].qs[l] >> 4) + m;
        }
      }
      return;
    }
    case GgmlType::Q5_0: {
      // Value d * (q - 16), q the 5-bit quant.
      const auto* b = reinterpret_cast<const BlockQ5_0*>(src);
      uint8_t q[QK5_0];
      for (int64_t i = 0; i < nb; ++i) {
        detail::q5_unpack(b[i].qh, b[i].qs, q);
        const float d = fp16_to_fp32(b[i].d);
        for (int l = 0; l < QK5_0; ++l) dst[i * QK5_0 + l] = d * (q[l] - 16);
      }
      return;
    }
    case GgmlType::Q5_1: {
      // Value d * q + m.
      const auto* b = reinterpret_cast<const BlockQ5_1*>(src);
      uint8_t q[QK5_1];
      for (int64_t i = 0; i < nb; ++i) {
        detail::q5_unpack(b[i].qh, b[i].qs, q);
        const float d = fp16_to_fp32(b[i].d);
        const float m = fp16_to_fp32(b[i].m);
        for (int l = 0; l < QK5_1; ++l) dst[i * QK5_1 + l] = d * q[l] + m;
      }
      return;
    }
    case GgmlType::Q2_K: {
      // Sub-block j (16 elements): value d * sc_j * q - dmin * m_j (4-bit sc_j, m_j).
      const auto* b = reinterpret_cast<const BlockQ2_K*>(src);
      uint8_t q[QK_K];
      for (int64_t i = 0; i < nb; ++i) {
        detail::q2k_unpack(b[i], q);
        const float d = fp16_to_fp32(b[i].d);
        const float dmin = fp16_to_fp32(b[i].dmin);
        for (int j = 0; j < QK_K / 16; ++j) {
          const float scale = d * static_cast<float>(b[i].scales[j] & 0x0f);
          const float min = dmin * static_cast<float>(b[i].scales[j] >> 4);
          for (int l = 0; l < 16; ++l) dst[i * QK_K + 16 * j + l] = scale * q[16 * j + l] - min;
        }
      }
      return;
    }
    case GgmlType::Q3_K: {
      // Sub-block j (16 elements): value d * sc_j * q.
      const auto* b = reinterpret_cast<const BlockQ3_K*>(src);
      int8_t q[QK_K], sc[QK_K / 16];
      for (int64_t i = 0; i < nb; ++i) {
        detail::q3k_unpack(b[i], q);
        detail::q3k_scales(b[i].scales, sc);
        const float d = fp16_to_fp32(b[i].d);
        for (int l = 0; l < QK_K; ++l) dst[i * QK_K + l] = d * static_cast<float>(sc[l / 16]) * q[l];
      }
      return;
    }
    case GgmlType::Q5_K: {
      // As Q4_K with 5-bit quants: value d * sc_j * q - dmin * m_j per 32-element sub-block j.
      const auto* b = reinterpret_cast<const BlockQ5_K*>(src);
      uint8_t q[QK_K];
      for (int64_t i = 0; i < nb; ++i) {
        detail::q5k_unpack(b[i], q);
        const float d = fp16_to_fp32(b[i].d);
        const float dmin = fp16_to_fp32(b[i].dmin);
        for (int j = 0; j < QK_K / 32; ++j) {
          int sc, m;
          detail::q4k_scale_min(b[i].scales, j, &sc, &m);
          const float scale = d * static_cast<float>(sc);
          const float min = dmin * static_cast<float>(m);
          for (int l = 0; l < 32; ++l) dst[i * QK_K + 32 * j + l] = scale * q[32 * j + l] - min;
        }
      }
      return;
    }
    case GgmlType::Q4_K: {
      // Sub-block j (32 elements): value d * sc_j * q - dmin * m_j.
      const auto* b = reinterpret_cast<const BlockQ4_K*>(src);
      uint8_t q[QK_K];
      for (int64_t i = 0; i < nb; ++i) {
        detail::q4k_unpack(b[i], q);
        const float d = fp16_to_fp32(b[i].d);
        const float dmin = fp16_to_fp32(b[i].dmin);
        for (int j = 0; j < QK_K / 32; ++j) {
          int sc, m;
          detail::q4k_scale_min(b[i].scales, j, &sc, &m);
          const float scale = d * static_cast<float>(sc);
          const float min = dmin * static_cast<float>(m);
          for (int l = 0; l < 32; ++l) dst[i * QK_K + 32 * j + l] = scale * q[32 * j + l] - min;
        }
      }
      return;
    }
    case GgmlType::Q6_K: {
      // Sub-block j (16 elements): value d * scales[j] * (q - 32).
      const auto* b = reinterpret_cast<const BlockQ6_K*>(src);
      int8_t q[QK_K];
      for (int64_t i = 0; i < nb; ++i) {
        detail::q6k_unpack(b[i], q);
        const float d = fp16_to_fp32(b[i].d);
        for (int l = 0; l < QK_K; ++l)
          dst[i * QK_K + l] = d * static_cast<float>(b[i].scales[l / 16]) * q[l];
      }
      return;
    }
    default:
      break;
  }
}

}  // namespace kestrel::cpu
