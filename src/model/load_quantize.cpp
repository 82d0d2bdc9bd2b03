#include "model/load_quantize.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "backend/cpu/matmul.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/fp8.h"
#include "core/thread_pool.h"
#include "model/llama_weights.h"
#include "model/quantized_matrix.h"

namespace kestrel {

uint16_t fp16_round_up(double x) {
  KESTREL_ASSERT(x >= 0 && x <= 65504.0, "fp16_round_up of a value f16 holds");
  uint16_t h = fp32_to_fp16(static_cast<float>(x));
  // Nearest-even may land below x (and the f32 step may too); positive f16 bit patterns increase
  // with their values, so the next pattern up is the next f16 value.
  while (static_cast<double>(fp16_to_fp32(h)) < x) ++h;
  return h;
}

void rtn_int4_quantize(const float* w, int64_t n_out, int64_t n_in, int64_t group, uint8_t* codes, uint16_t* scales,
                       uint8_t* zeros) {
  KESTREL_ASSERT(group > 0, "RTN group size");
  const int64_t n_groups = (n_in + group - 1) / group;
  for (int64_t n = 0; n < n_out; ++n)
    for (int64_t g = 0; g < n_groups; ++g) {
      const int64_t k0 = g * group, k1 = std::min(n_in, k0 + group);
      const float* x = w + n * n_in;
      double lo = 0, hi = 0;
      for (int64_t k = k0; k < k1; ++k) {
        lo = std::min(lo, static_cast<double>(x[k]));
        hi = std::max(hi, static_cast<double>(x[k]));
      }
      const uint16_t sb = hi > lo ? fp16_round_up((hi - lo) / 15.0) : fp32_to_fp16(1.0f);
      const double s = fp16_to_fp32(sb);
      const double z = std::clamp(std::nearbyint(-lo / s), 0.0, 15.0);
      for (int64_t k = k0; k < k1; ++k)
        codes[n * n_in + k] = static_cast<uint8_t>(std::clamp(std::nearbyint(static_cast<double>(x[k]) / s) + z, 0.0, 15.0));
      scales[n * n_groups + g] = sb;
      zeros[n * n_groups + g] = static_cast<uint8_t>(z);
    }
}

float fp8_quantize_row(const float* x, int64_t n, uint8_t* codes) {
  float amax = 0;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float scale = amax > 0 ? amax / kFp8E4m3Max : 1.0f;
  for (int64_t i = 0; i < n; ++i) codes[i] = float_to_e4m3(x[i] / scale);
  return scale;
}

namespace {

constexpr int kAwqReverse[8] = {0, 4, 1, 5, 2, 6, 3, 7};  // column j of 8 sits in nibble kAwqReverse[j]

// Packs values v[n, c] (n < N, c < C, 0..15) AWQ-GEMM style: word (c, n / 8) of [C, N / 8], nibble
// kAwqReverse[n % 8] (model/quantized_matrix.h).
void awq_pack(const uint8_t* v, int64_t N, int64_t C, int64_t v_stride, uint32_t* out) {
  for (int64_t c = 0; c < C; ++c)
    for (int64_t w = 0; w < N / 8; ++w) {
      uint32_t word = 0;
      for (int j = 0; j < 8; ++j) word |= static_cast<uint32_t>(v[(8 * w + j) * v_stride + c]) << (4 * kAwqReverse[j]);
      out[c * (N / 8) + w] = word;
    }
}

}  // namespace

void LlamaModel::quantize_at_load(Quantization q) {
  KESTREL_ASSERT(q == Quantization::Fp8 || q == Quantization::Rtn, "quantize_at_load: fp8 or rtn");
  const bool fp8 = q == Quantization::Fp8;
  const char* flag = fp8 ? "--quantization fp8" : "--quantization rtn";
  if (hparams_.mla.enabled() || hparams_.moe.enabled())
    throw Error(path_ + ": " + flag + " at load covers dense attention and MLP projections; this model has " +
                (hparams_.mla.enabled() ? "latent attention (MLA)" : "mixture-of-experts layers") +
                " (use --quantization auto)");
  if (quantized_ == nullptr) quantized_ = std::make_unique<QuantizedWeights>();
  ThreadPool pool(0);
  for (int32_t l = 0; l < static_cast<int32_t>(hparams_.n_layer); ++l)
    for (const WeightRole role : {WeightRole::Q, WeightRole::K, WeightRole::V, WeightRole::Qkv, WeightRole::AttnOut,
                                  WeightRole::Gate, WeightRole::Up, WeightRole::GateUp, WeightRole::Down}) {
      const LayerTensor* t = weights_.find({l, role});
      if (t == nullptr || t->matrix.empty()) continue;
      const WeightView& w = t->matrix;
      const int64_t K = w.n_in, N = w.n_out;
      const std::string name = "layer " + std::to_string(l) + " " + std::string(weight_role_name(role));
      if (!cpu::matmul_supports(w.type.storage))
        throw Error(path_ + ": " + flag + ": " + name + " is " + std::string(type_name(w.type.storage)) + ", which has no dequantizer");
      if (!fp8 && N % 8 != 0)
        throw Error(path_ + ": " + flag + ": " + name + " has " + std::to_string(N) +
                    " output rows, not a multiple of the 8 that a packed INT4 word holds");
      // The bf16 model's values (dequantized, rounded to bf16), row by row.
      std::vector<float> f(static_cast<size_t>(N * K));
      pool.parallel_for(N, 16, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          float* o = f.data() + r * K;
          cpu::dequantize_row(w.type.storage, w.row(r), o, K);
          for (int64_t k = 0; k < K; ++k) o[k] = bf16_to_fp32(fp32_to_bf16(o[k]));
        }
      });
      QuantizedMatrix m;
      m.name = name;
      m.n_in = K, m.n_out = N;
      uint64_t bytes = 0;
      if (fp8) {
        m.format = QuantFormat::Fp8;
        m.block_n = 1, m.block_k = K;
        m.scale_type = GgmlType::F32;
        uint8_t* codes = quantized_->hold(static_cast<size_t>(N * K));
        auto* scales = reinterpret_cast<float*>(quantized_->hold(static_cast<size_t>(N) * 4));
        pool.parallel_for(N, 16, [&](int64_t r0, int64_t r1) {
          for (int64_t r = r0; r < r1; ++r) scales[r] = fp8_quantize_row(f.data() + r * K, K, codes + r * K);
        });
        m.weight = codes;
        m.scales = reinterpret_cast<const uint8_t*>(scales);
        bytes = static_cast<uint64_t>(N * K + 4 * N);
      } else {
        const int64_t G = (K + kRtnGroupSize - 1) / kRtnGroupSize;
        m.format = QuantFormat::AwqGemm;
        m.bits = 4, m.group_size = kRtnGroupSize, m.n_groups = G;
        m.scale_type = GgmlType::F16;
        std::vector<uint8_t> codes(static_cast<size_t>(N * K)), zeros(static_cast<size_t>(N * G));
        std::vector<uint16_t> scales_ng(static_cast<size_t>(N * G));
        pool.parallel_for(N / 8, 4, [&](int64_t b0, int64_t b1) {
          rtn_int4_quantize(f.data() + 8 * b0 * K, 8 * (b1 - b0), K, kRtnGroupSize, codes.data() + 8 * b0 * K,
                            scales_ng.data() + 8 * b0 * G, zeros.data() + 8 * b0 * G);
        });
        auto* qweight = reinterpret_cast<uint32_t*>(quantized_->hold(static_cast<size_t>(K * N / 2)));
        auto* qzeros = reinterpret_cast<uint32_t*>(quantized_->hold(static_cast<size_t>(G * N / 2)));
        auto* scales = reinterpret_cast<uint16_t*>(quantized_->hold(static_cast<size_t>(G * N) * 2));
        awq_pack(codes.data(), N, K, K, qweight);
        awq_pack(zeros.data(), N, G, G, qzeros);
        for (int64_t n = 0; n < N; ++n)
          for (int64_t g = 0; g < G; ++g) scales[g * N + n] = scales_ng[n * G + g];  // [G, N], as AWQ stores them
        m.qweight = reinterpret_cast<const uint8_t*>(qweight);
        m.qzeros = reinterpret_cast<const uint8_t*>(qzeros);
        m.scales = reinterpret_cast<const uint8_t*>(scales);
        bytes = static_cast<uint64_t>(K * N / 2 + G * N / 2 + 2 * G * N);
      }
      LayerTensor lt = *t;
      weight_bytes_ -= static_cast<uint64_t>(N) * w.row_size();
      weight_bytes_ += bytes;
      lt.matrix = quantized_->add(std::move(m));
      weights_.put({l, role}, std::move(lt));
    }
  quant_method_ = fp8 ? QuantMethod::Fp8 : QuantMethod::Awq;
}

}  // namespace kestrel
