// The portable kernels: plain C++ with the same activation quantization as the SIMD paths. They
// define what the SIMD kernels compute (the tests compare against them) and run on any CPU.
//
// Activation layout of one token (natural element order): ActLayout32 / ActLayoutK in
// matmul_kernels.h (two int8 planes q1, q2 of the 16-bit quants Q = 255 q1 + q2).
#include <cmath>
#include <cstring>

#include "backend/cpu/matmul_kernels.h"

namespace kestrel::cpu::detail {
namespace {

struct Act32 {
  const int8_t* q1;
  const int8_t* q2;
  const float* d;
  const float* s;
};
Act32 act32(const uint8_t* p, int64_t n_in) {
  const ActLayout32 L(n_in);
  return {reinterpret_cast<const int8_t*>(p), reinterpret_cast<const int8_t*>(p + L.q2_off),
          reinterpret_cast<const float*>(p + L.d_off), reinterpret_cast<const float*>(p + L.s_off)};
}

struct ActK {
  const int8_t* q1;
  const int8_t* q2;
  const float* d;
  const int16_t* bsums1;
  const int16_t* bsums2;
};
ActK act_k(const uint8_t* p, int64_t n_in) {
  const ActLayoutK L(n_in);
  return {reinterpret_cast<const int8_t*>(p), reinterpret_cast<const int8_t*>(p + L.q2_off),
          reinterpret_cast<const float*>(p + L.d_off), reinterpret_cast<const int16_t*>(p + L.bsums_off),
          reinterpret_cast<const int16_t*>(p + L.bsums2_off)};
}

size_t act_row_bytes(GgmlType type, int64_t n_in) {
  if (is_float_type(type)) return 0;
  return is_k_quant(type) ? ActLayoutK(n_in).bytes : ActLayout32(n_in).bytes;
}

void quantize_act(GgmlType type, const float* x, int64_t n_in, int64_t, bool bits8, uint8_t* dst) {
  if (is_k_quant(type)) {
    const ActLayoutK L(n_in);
    const auto [q1, q2, d, bsums1, bsums2] = L.planes(dst);
    for (int64_t b = 0; b < L.nsb; ++b) {
      quantize_block_q16(x + b * QK_K, QK_K, bits8, q1 + b * QK_K, q2 + b * QK_K, d + b);
      for (int g = 0; g < QK_K / 16; ++g) {
        int sum1 = 0, sum2 = 0;
        for (int l = 0; l < 16; ++l) {
          sum1 += q1[b * QK_K + 16 * g + l];
          sum2 += q2[b * QK_K + 16 * g + l];
        }
        bsums1[b * (QK_K / 16) + g] = static_cast<int16_t>(sum1);
        bsums2[b * (QK_K / 16) + g] = static_cast<int16_t>(sum2);
      }
    }
    return;
  }
  const ActLayout32 L(n_in);
  auto* q1 = reinterpret_cast<int8_t*>(dst);
  auto* q2 = reinterpret_cast<int8_t*>(dst + L.q2_off);
  auto* d = reinterpret_cast<float*>(dst + L.d_off);
  auto* s = reinterpret_cast<float*>(dst + L.s_off);
  for (int64_t b = 0; b < L.nb; ++b) {
    const int32_t sum = quantize_block_q16(x + b * 32, 32, bits8, q1 + b * 32, q2 + b * 32, d + b);
    s[b] = d[b] * static_cast<float>(sum);
  }
  std::memset(s + L.nb, 0, L.bytes - L.s_off - static_cast<size_t>(L.nb) * 4);
}

size_t scratch_bytes(GgmlType type, int64_t n_in) {
  return is_float_type(type) ? align64(static_cast<size_t>(n_in) * sizeof(float)) : 0;
}

// Super-block b of Q4_K / Q5_K (quants q in element order, the 6-bit scales and mins of the 32-element
// sub-blocks packed as q4k_scale_min reads them): d * sum_j sc_j * sum(q Q) - dmin * sum_j m_j * sum(Q),
// times the activation scale.
float scale_min_dot(const uint8_t q[QK_K], uint16_t d, uint16_t dmin, const uint8_t scales[K_SCALE_SIZE],
                    const ActK& a, int64_t b) {
  const int8_t* a1 = a.q1 + b * QK_K;
  const int8_t* a2 = a.q2 + b * QK_K;
  const int16_t* bs1 = a.bsums1 + b * (QK_K / 16);
  const int16_t* bs2 = a.bsums2 + b * (QK_K / 16);
  int32_t isum1 = 0, isum2 = 0, imin1 = 0, imin2 = 0;
  for (int j = 0; j < QK_K / 32; ++j) {
    int sc, m;
    q4k_scale_min(scales, j, &sc, &m);
    int32_t s1 = 0, s2 = 0;
    for (int l = 0; l < 32; ++l) {
      s1 += q[32 * j + l] * a1[32 * j + l];
      s2 += q[32 * j + l] * a2[32 * j + l];
    }
    isum1 += sc * s1;
    isum2 += sc * s2;
    imin1 += m * (bs1[2 * j] + bs1[2 * j + 1]);
    imin2 += m * (bs2[2 * j] + bs2[2 * j + 1]);
  }
  const float isum = std::fma(static_cast<float>(isum1), static_cast<float>(kActSplit), static_cast<float>(isum2));
  const float imin = std::fma(static_cast<float>(imin1), static_cast<float>(kActSplit), static_cast<float>(imin2));
  return a.d[b] * (fp16_to_fp32(d) * isum - fp16_to_fp32(dmin) * imin);
}

// One weight row against one token's activations. Per block, the integer sums of both planes
// combine exactly into sum(u * Q) (see quantize_block_q16).
float dot_row(GgmlType type, const uint8_t* w, const uint8_t* act, int64_t n_in) {
  float sum = 0.0f;
  switch (type) {
    case GgmlType::Q4_0:
    case GgmlType::Q4_1:
    case GgmlType::Q5_0:
    case GgmlType::Q5_1:
    case GgmlType::Q8_0: {
      const Act32 a = act32(act, n_in);
      for (int64_t b = 0; b < n_in / 32; ++b) {
        const int8_t* a1 = a.q1 + b * 32;
        const int8_t* a2 = a.q2 + b * 32;
        int32_t i1 = 0, i2 = 0;
        if (type == GgmlType::Q8_0) {
          const auto& blk = reinterpret_cast<const BlockQ8_0*>(w)[b];
          for (int l = 0; l < 32; ++l) {
            i1 += blk.qs[l] * a1[l];
            i2 += blk.qs[l] * a2[l];
          }
          sum += fp16_to_fp32(blk.d) * a.d[b] * static_cast<float>(kActSplit * i1 + i2);
        } else if (type == GgmlType::Q4_0) {
          const auto& blk = reinterpret_cast<const BlockQ4_0*>(w)[b];
          for (int l = 0; l < 16; ++l) {
            const int lo = (blk.qs[l] & 0x0f) - 8, hi = (blk.qs[l] >> 4) - 8;
            i1 += lo * a1[l] + hi * a1[l + 16];
            i2 += lo * a2[l] + hi * a2[l + 16];
          }
          sum += fp16_to_fp32(blk.d) * a.d[b] * static_cast<float>(kActSplit * i1 + i2);
        } else if (type == GgmlType::Q5_0) {
          const auto& blk = reinterpret_cast<const BlockQ5_0*>(w)[b];
          uint8_t q[32];
          q5_unpack(blk.qh, blk.qs, q);
          for (int l = 0; l < 32; ++l) {
            i1 += (q[l] - 16) * a1[l];
            i2 += (q[l] - 16) * a2[l];
          }
          sum += fp16_to_fp32(blk.d) * a.d[b] * static_cast<float>(kActSplit * i1 + i2);
        } else if (type == GgmlType::Q5_1) {
          // As Q4_1 below.
          const auto& blk = reinterpret_cast<const BlockQ5_1*>(w)[b];
          uint8_t q[32];
          q5_unpack(blk.qh, blk.qs, q);
          for (int l = 0; l < 32; ++l) {
            i1 += q[l] * a1[l];
            i2 += q[l] * a2[l];
          }
          sum += fp16_to_fp32(blk.d) * a.d[b] * static_cast<float>(kActSplit * i1 + i2) +
                 fp16_to_fp32(blk.m) * a.s[b];
        } else {
          // w = d * q + m, so w . x = d * dx * sum(q * Q) + m * (dx * sum(Q)) = ... + m * s.
          const auto& blk = reinterpret_cast<const BlockQ4_1*>(w)[b];
          for (int l = 0; l < 16; ++l) {
            const int lo = blk.qs[l] & 0x0f, hi = blk.qs[l] >> 4;
            i1 += lo * a1[l] + hi * a1[l + 16];
            i2 += lo * a2[l] + hi * a2[l + 16];
          }
          sum += fp16_to_fp32(blk.d) * a.d[b] * static_cast<float>(kActSplit * i1 + i2) +
                 fp16_to_fp32(blk.m) * a.s[b];
        }
      }
      return sum;
    }
    case GgmlType::Q4_K: {
      const ActK a = act_k(act, n_in);
      uint8_t q[QK_K];
      for (int64_t b = 0; b < n_in / QK_K; ++b) {
        const auto& blk = reinterpret_cast<const BlockQ4_K*>(w)[b];
        q4k_unpack(blk, q);
        sum += scale_min_dot(q, blk.d, blk.dmin, blk.scales, a, b);
      }
      return sum;
    }
    case GgmlType::Q5_K: {
      const ActK a = act_k(act, n_in);
      uint8_t q[QK_K];
      for (int64_t b = 0; b < n_in / QK_K; ++b) {
        const auto& blk = reinterpret_cast<const BlockQ5_K*>(w)[b];
        q5k_unpack(blk, q);
        sum += scale_min_dot(q, blk.d, blk.dmin, blk.scales, a, b);
      }
      return sum;
    }
    case GgmlType::Q2_K: {
      // w = d * sc_j * q - dmin * m_j per 16-element sub-block j, q >= 0: the min term uses the
      // activation sums of the sub-block (bsums).
      const ActK a = act_k(act, n_in);
      uint8_t q[QK_K];
      for (int64_t b = 0; b < n_in / QK_K; ++b) {
        const auto& blk = reinterpret_cast<const BlockQ2_K*>(w)[b];
        q2k_unpack(blk, q);
        const int8_t* a1 = a.q1 + b * QK_K;
        const int8_t* a2 = a.q2 + b * QK_K;
        const int16_t* bs1 = a.bsums1 + b * (QK_K / 16);
        const int16_t* bs2 = a.bsums2 + b * (QK_K / 16);
        int32_t isum1 = 0, isum2 = 0, imin1 = 0, imin2 = 0;
        for (int j = 0; j < QK_K / 16; ++j) {
          const int sc = blk.scales[j] & 0x0f, m = blk.scales[j] >> 4;
          int32_t s1 = 0, s2 = 0;
          for (int l = 0; l < 16; ++l) {
            s1 += q[16 * j + l] * a1[16 * j + l];
            s2 += q[16 * j + l] * a2[16 * j + l];
          }
          isum1 += sc * s1;
          isum2 += sc * s2;
          imin1 += m * bs1[j];
          imin2 += m * bs2[j];
        }
        const float isum = std::fma(static_cast<float>(isum1), static_cast<float>(kActSplit), static_cast<float>(isum2));
        const float imin = std::fma(static_cast<float>(imin1), static_cast<float>(kActSplit), static_cast<float>(imin2));
        sum += a.d[b] * (fp16_to_fp32(blk.d) * isum - fp16_to_fp32(blk.dmin) * imin);
      }
      return sum;
    }
    case GgmlType::Q3_K: {
      const ActK a = act_k(act, n_in);
      int8_t q[QK_K], sc[QK_K / 16];
      for (int64_t b = 0; b < n_in / QK_K; ++b) {
        const auto& blk = reinterpret_cast<const BlockQ3_K*>(w)[b];
        q3k_unpack(blk, q);
        q3k_scales(blk.scales, sc);
        const int8_t* a1 = a.q1 + b * QK_K;
        const int8_t* a2 = a.q2 + b * QK_K;
        int32_t isum1 = 0, isum2 = 0;
        for (int j = 0; j < QK_K / 16; ++j) {
          int32_t s1 = 0, s2 = 0;
          for (int l = 0; l < 16; ++l) {
            s1 += q[16 * j + l] * a1[16 * j + l];
            s2 += q[16 * j + l] * a2[16 * j + l];
          }
          isum1 += sc[j] * s1;
          isum2 += sc[j] * s2;
        }
        const float isum = std::fma(static_cast<float>(isum1), static_cast<float>(kActSplit), static_cast<float>(isum2));
        sum += a.d[b] * fp16_to_fp32(blk.d) * isum;
      }
      return sum;
    }
    case GgmlType::Q6_K: {
      const ActK a = act_k(act, n_in);
      int8_t q[QK_K];
      for (int64_t b = 0; b < n_in / QK_K; ++b) {
        const auto& blk = reinterpret_cast<const BlockQ6_K*>(w)[b];
        q6k_unpack(blk, q);
        const int8_t* a1 = a.q1 + b * QK_K;
        const int8_t* a2 = a.q2 + b * QK_K;
        int32_t isum1 = 0, isum2 = 0;
        for (int j = 0; j < QK_K / 16; ++j) {
          int32_t s1 = 0, s2 = 0;
          for (int l = 0; l < 16; ++l) {
            s1 += q[16 * j + l] * a1[16 * j + l];
            s2 += q[16 * j + l] * a2[16 * j + l];
          }
          isum1 += blk.scales[j] * s1;
          isum2 += blk.scales[j] * s2;
        }
        const float isum = std::fma(static_cast<float>(isum1), static_cast<float>(kActSplit), static_cast<float>(isum2));
        sum += a.d[b] * fp16_to_fp32(blk.d) * isum;
      }
      return sum;
    }
    default:
      return 0.0f;
  }
}

void matmul_rows(const MatmulArgs& a, int64_t r0, int64_t r1, uint8_t* scratch) {
  const GgmlType type = a.w.type.storage;
  const int64_t n_in = a.w.n_in;
  if (is_float_type(type)) {
    auto* wf = reinterpret_cast<float*>(scratch);
    for (int64_t r = r0; r < r1; ++r) {
      dequantize_row(type, a.w.data + r * a.w_row_bytes, wf, n_in);
      for (int64_t t = 0; t < a.n_tokens; ++t) {
        const float* x = a.x + t * n_in;
        float sum = 0.0f;
        for (int64_t i = 0; i < n_in; ++i) sum += wf[i] * x[i];
        a.y[t * a.w.n_out + r] = sum;
      }
    }
    return;
  }
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* w = a.w.data + r * a.w_row_bytes;
    for (int64_t t = 0; t < a.n_tokens; ++t)
      a.y[t * a.w.n_out + r] = dot_row(type, w, a.act + t * a.act_stride, n_in);
  }
}

float vec_dot(const float* a, const float* b, int64_t n) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

}  // namespace

const MatmulKernels& kernels_scalar() {
  using Acts = PerTokenActs<act_row_bytes, quantize_act>;
  static const MatmulKernels k{"scalar", Acts::bytes, Acts::stride, Acts::quantize, scratch_bytes, matmul_rows,
                               vec_dot, [](GgmlType, int64_t) -> int64_t { return 1; }};
  return k;
}

}  // namespace kestrel::cpu::detail
