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

}  // namespace detail

bool matmul_supports(GgmlType type) {
  switch (type) {
    case GgmlType::F32:
    case GgmlType::F16:
    case GgmlType::BF16:
    case GgmlType::Q8_0:
    case GgmlType::Q4_0:
    case GgmlType::Q4_1:
    case GgmlType::Q4_K:
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
