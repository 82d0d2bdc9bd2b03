// The portable kernels: plain C++ with the same activation quantization as the SIMD paths. They
// define what the SIMD kernels compute (the tests compare against them) and run on any CPU.
//
// Activation layout of one token (natural element order):
//   32-blocks (Q4_0, Q4_1, Q8_0): int8 qs[n_in] | f32 d[nb] | f32 s[nb]        (s = d * sum(qs))
//   256-blocks (Q4_K, Q6_K):      int8 qs[n_in] | f32 d[nsb] | int16 bsums[n_in / 16]
#include <cstring>

#include "backend/cpu/matmul_kernels.h"

namespace kestrel::cpu::detail {
namespace {

struct Act32 {
  const int8_t* qs;
  const float* d;
  const float* s;
};
Act32 act32(const uint8_t* p, int64_t n_in) {
  const ActLayout32 L(n_in);
  return {reinterpret_cast<const int8_t*>(p), reinterpret_cast<const float*>(p + L.d_off),
          reinterpret_cast<const float*>(p + L.s_off)};
}

struct ActK {
  const int8_t* qs;
  const float* d;
  const int16_t* bsums;
};
ActK act_k(const uint8_t* p, int64_t n_in) {
  const ActLayoutK L(n_in);
  return {reinterpret_cast<const int8_t*>(p), reinterpret_cast<const float*>(p + L.d_off),
          reinterpret_cast<const int16_t*>(p + L.bsums_off)};
}

size_t act_row_bytes(GgmlType type, int64_t n_in) {
  if (is_float_type(type)) return 0;
  return is_k_quant(type) ? ActLayoutK(n_in).bytes : ActLayout32(n_in).bytes;
}

void quantize_act(GgmlType type, const float* x, int64_t n_in, int64_t, uint8_t* dst) {
  auto* qs = reinterpret_cast<int8_t*>(dst);
  if (is_k_quant(type)) {
    const ActLayoutK L(n_in);
    auto* d = reinterpret_cast<float*>(dst + L.d_off);
    auto* bsums = reinterpret_cast<int16_t*>(dst + L.bsums_off);
    for (int64_t b = 0; b < L.nsb; ++b) {
      quantize_block_q8(x + b * QK_K, QK_K, qs + b * QK_K, d + b);
      for (int g = 0; g < QK_K / 16; ++g) {
        int sum = 0;
        for (int l = 0; l < 16; ++l) sum += qs[b * QK_K + 16 * g + l];
        bsums[b * (QK_K / 16) + g] = static_cast<int16_t>(sum);
      }
    }
    return;
  }
  const ActLayout32 L(n_in);
  auto* d = reinterpret_cast<float*>(dst + L.d_off);
  auto* s = reinterpret_cast<float*>(dst + L.s_off);
  for (int64_t b = 0; b < L.nb; ++b) {
    quantize_block_q8(x + b * 32, 32, qs + b * 32, d + b);
    int sum = 0;
    for (int l = 0; l < 32; ++l) sum += qs[b * 32 + l];
    s[b] = d[b] * static_cast<float>(sum);
  }
  std::memset(s + L.nb, 0, L.bytes - L.s_off - static_cast<size_t>(L.nb) * 4);
}

size_t scratch_bytes(GgmlType type, int64_t n_in) {
  return is_float_type(type) ? align64(static_cast<size_t>(n_in) * sizeof(float)) : 0;
}

// One weight row against one token's activations.
float dot_row(GgmlType type, const uint8_t* w, const uint8_t* act, int64_t n_in) {
  float sum = 0.0f;
  switch (type) {
    case GgmlType::Q4_0:
    case GgmlType::Q4_1:
    case GgmlType::Q8_0: {
      const Act32 a = act32(act, n_in);
      for (int64_t b = 0; b < n_in / 32; ++b) {
        const int8_t* aq = a.qs + b * 32;
        int32_t isum = 0;
        if (type == GgmlType::Q8_0) {
          const auto& blk = reinterpret_cast<const BlockQ8_0*>(w)[b];
          for (int l = 0; l < 32; ++l) isum += blk.qs[l] * aq[l];
          sum += fp16_to_fp32(blk.d) * a.d[b] * static_cast<float>(isum);
        } else if (type == GgmlType::Q4_0) {
          const auto& blk = reinterpret_cast<const BlockQ4_0*>(w)[b];
          for (int l = 0; l < 16; ++l)
            isum += ((blk.qs[l] & 0x0f) - 8) * aq[l] + ((blk.qs[l] >> 4) - 8) * aq[l + 16];
          sum += fp16_to_fp32(blk.d) * a.d[b] * static_cast<float>(isum);
        } else {
          // w = d * q + m, so w . x = d * dx * sum(q * qx) + m * (dx * sum(qx)) = ... + m * s.
          const auto& blk = reinterpret_cast<const BlockQ4_1*>(w)[b];
          for (int l = 0; l < 16; ++l) isum += (blk.qs[l] & 0x0f) * aq[l] + (blk.qs[l] >> 4) * aq[l + 16];
          sum += fp16_to_fp32(blk.d) * a.d[b] * static_cast<float>(isum) + fp16_to_fp32(blk.m) * a.s[b];
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
        const int8_t* aq = a.qs + b * QK_K;
        const int16_t* bs = a.bsums + b * (QK_K / 16);
        int32_t isum = 0, imin = 0;
        for (int j = 0; j < QK_K / 32; ++j) {
          int sc, m;
          q4k_scale_min(blk.scales, j, &sc, &m);
          int32_t s = 0;
          for (int l = 0; l < 32; ++l) s += q[32 * j + l] * aq[32 * j + l];
          isum += sc * s;
          imin += m * (bs[2 * j] + bs[2 * j + 1]);
        }
        sum += a.d[b] * (fp16_to_fp32(blk.d) * static_cast<float>(isum) -
                         fp16_to_fp32(blk.dmin) * static_cast<float>(imin));
      }
      return sum;
    }
    case GgmlType::Q6_K: {
      const ActK a = act_k(act, n_in);
      int8_t q[QK_K];
      for (int64_t b = 0; b < n_in / QK_K; ++b) {
        const auto& blk = reinterpret_cast<const BlockQ6_K*>(w)[b];
        q6k_unpack(blk, q);
        const int8_t* aq = a.qs + b * QK_K;
        int32_t isum = 0;
        for (int j = 0; j < QK_K / 16; ++j) {
          int32_t s = 0;
          for (int l = 0; l < 16; ++l) s += q[16 * j + l] * aq[16 * j + l];
          isum += blk.scales[j] * s;
        }
        sum += a.d[b] * fp16_to_fp32(blk.d) * static_cast<float>(isum);
      }
      return sum;
    }
    default:
      return 0.0f;
  }
}

void matmul_rows(const MatmulArgs& a, int64_t r0, int64_t r1, uint8_t* scratch) {
  const GgmlType type = a.w.type;
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
