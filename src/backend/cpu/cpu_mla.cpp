// The CPU backend's multi-head latent attention (DeepSeek-V2, arXiv:2405.04434 sec. 2.1), run in
// the latent space ("weight absorption", sec. 2.1.2 and appendix): the cache holds per token one
// row [c_KV (kv_lora_rank) | k_R (qk_rope)]; head h's query becomes [W_UK_h^T q_nope_h | q_rope_h],
// so all heads attend over the one cached row as MQA with head_dim kv_lora_rank + qk_rope, the
// values being the latent itself; head h's output is W_UV_h times its latent output. Scores and
// outputs equal the up-projected form's (per-head K = [W_UK_h c | k_R], V = W_UV_h c) up to f32
// rounding; each cached token costs kv_lora_rank + qk_rope elements per layer instead of
// 2 x n_head x head_dim.
#include <algorithm>
#include <cstring>

#include "backend/cpu/cpu_model_runner.h"
#include "backend/cpu/ops.h"
#include "core/error.h"

namespace kestrel::cpu {

void CpuModelRunner::prepare_mla() {
  const MlaHparams& mla = hp_.mla;
  const int64_t H = hp_.n_head, r = mla.kv_lora_rank, nope = mla.qk_nope, vd = mla.v_head_dim;
  mla_uk_t_.resize(static_cast<size_t>(hp_.n_layer));
  mla_uv_.resize(static_cast<size_t>(hp_.n_layer));
  std::vector<float> row(static_cast<size_t>(r));
  for (int32_t l = 0; l < static_cast<int32_t>(hp_.n_layer); ++l) {
    const WeightView& kvb = model_.weights().at({l, WeightRole::KvB}).matrix;  // [H (nope + vd), r]
    std::vector<float>& uk_t = mla_uk_t_[static_cast<size_t>(l)];  // [H, r, nope]: W_UK_h transposed
    std::vector<float>& uv = mla_uv_[static_cast<size_t>(l)];      // [H, vd, r]: W_UV_h
    uk_t.assign(static_cast<size_t>(H * r * nope), 0.0f);
    uv.assign(static_cast<size_t>(H * vd * r), 0.0f);
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < nope + vd; ++i) {
        dequantize_row(kvb.type.storage, kvb.row(h * (nope + vd) + i), row.data(), r);
        if (i < nope) {
          for (int64_t j = 0; j < r; ++j) uk_t[static_cast<size_t>((h * r + j) * nope + i)] = row[static_cast<size_t>(j)];
        } else {
          std::copy(row.begin(), row.end(), uv.begin() + (h * vd + (i - nope)) * r);
        }
      }
  }
}

void CpuModelRunner::mla_attention(int32_t layer, Act in, Act out) {
  KESTREL_ASSERT(out == Act::Attn, "CPU mla_attention: writes Act::Attn");
  const MlaHparams& mla = hp_.mla;
  const ModelWeights& W = model_.weights();
  const ForwardBatch& b = *batch_;
  const int64_t n = b.n_tokens(), H = hp_.n_head, r = mla.kv_lora_rank, rope_d = mla.qk_rope, nope = mla.qk_nope;
  const int64_t vd = mla.v_head_dim, qh = nope + rope_d, row = r + rope_d;
  const float* x = act(in);
  const auto& op = ops();
  const bool adjacent = hp_.rope_style == RopeStyle::AdjacentPairs;

  // Queries [n, H, qh].
  float* q = q_.data();
  if (const LayerTensor* qa = W.find({layer, WeightRole::QA}); qa != nullptr) {
    const int64_t qr = mla.q_lora_rank;
    grow(mla_qa_, n * qr);
    float* y = mla_qa_.data();
    project({layer, WeightRole::QA}, x, n, &y);
    op.rms_norm(y, W.at({layer, WeightRole::QANorm}).vector.data(), y, n, qr, hp_.rms_eps);
    project({layer, WeightRole::QB}, y, n, &q);
  } else {
    project({layer, WeightRole::Q}, x, n, &q);
  }
  // The cached rows [n, r + rope]: normed latent, rotated key.
  grow(mla_kv_, n * row);
  float* kv = mla_kv_.data();
  project({layer, WeightRole::KvA}, x, n, &kv);
  const float* kv_norm = W.at({layer, WeightRole::KvANorm}).vector.data();
  for (int64_t t = 0; t < n; ++t) op.rms_norm(kv + t * row, kv_norm, kv + t * row, 1, r, hp_.rms_eps);
  rope(q + nope, b.positions.data(), n, H, qh, rope_d, inv_freq_.data(), hp_.rope_linear_scale, adjacent);
  rope(kv + r, b.positions.data(), n, 1, row, rope_d, inv_freq_.data(), hp_.rope_linear_scale, adjacent);
  for (int64_t t = 0; t < n; ++t) {
    const int64_t off = kv_.offset(b.slot_mapping[t], 0);
    if (kv_.dtype() == KvDtype::F16) {
      op.f32_to_f16(kv + t * row, static_cast<uint16_t*>(kv_.k(layer)) + off, row);
    } else if (kv_.dtype() == KvDtype::INT8) {
      // The latent and the RoPE key are scaled apart: their magnitudes differ (the latent is
      // RMS-normed, the key is not), and one scale would round the smaller part coarsely.
      int8_t* codes = static_cast<int8_t*>(kv_.k(layer)) + off;
      kv_.k_scale(layer)[off / row] = quantize_row_int8(kv + t * row, codes, r);
      kv_.rope_scale(layer)[off / row] = quantize_row_int8(kv + t * row + r, codes + r, rope_d);
    } else {
      std::memcpy(static_cast<float*>(kv_.k(layer)) + off, kv + t * row, sizeof(float) * static_cast<size_t>(row));
    }
  }

  // Absorbed queries [n, H, row] = [W_UK_h^T q_nope_h | q_rope_h].
  grow(mla_q_, n * H * row);
  grow(mla_o_, n * H * r);
  const std::vector<float>& uk_t = mla_uk_t_[static_cast<size_t>(layer)];
  const std::vector<float>& uv = mla_uv_[static_cast<size_t>(layer)];
  pool_.parallel_for(n * H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t th = begin; th < end; ++th) {
      const int64_t h = th % H;
      const float* qn = q + th * qh;
      float* ql = mla_q_.data() + th * row;
      for (int64_t j = 0; j < r; ++j) ql[j] = vec_dot_f32(uk_t.data() + (h * r + j) * nope, qn, nope);
      std::copy_n(qn + nope, rope_d, ql + r);
    }
  });
  // All heads over the one latent row (MQA): one KV head whose group is every query head.
  AttentionArgs a{};
  a.k_cache = kv_.k(layer);
  a.v_cache = kv_.k(layer);
  a.kv_dtype = kv_.dtype();
  a.k_scale = kv_.k_scale(layer);
  a.v_scale = kv_.k_scale(layer);  // the values are the latent
  a.k_rope_scale = kv_.rope_scale(layer);
  a.block_stride = static_cast<int64_t>(kv_.block_size()) * row;
  a.block_size = kv_.block_size();
  a.head_dim = row;
  a.v_dim = r;
  a.group = H;
  a.scale = hp_.softmax_scale();
  set_key_ranges(b, 0);
  paged_attention(pool_, a, attention_batch(b, mla_q_.data(), H * row, mla_o_.data(), H * r, 1, 0), attn_states_);
  // out[t, h, i] = W_UV_h[i] . o_lat[t, h].
  float* o = act(out);
  pool_.parallel_for(n * H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t th = begin; th < end; ++th) {
      const int64_t h = th % H;
      for (int64_t i = 0; i < vd; ++i)
        o[th * vd + i] = vec_dot_f32(uv.data() + (h * vd + i) * r, mla_o_.data() + th * r, r);
    }
  });
}

}  // namespace kestrel::cpu
