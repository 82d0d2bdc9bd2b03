#include "backend/cpu/cpu_model_runner.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "backend/cpu/ops.h"
#include "backend/cpu/paged_attention.h"
#include "core/error.h"
#include "backend/kv_geometry.h"

namespace kestrel::cpu {

CpuModelRunner::CpuModelRunner(const LlamaModel& model, KvCache& kv, ThreadPool& pool, Communicator* comm,
                               PipelineRole role)
    : model_(model),
      hp_(model.hparams()),
      kv_(kv),
      pool_(pool),
      comm_(comm),
      role_(role),
      arch_(architecture(model.hparams().arch)) {
  const KvGeometry g = kv_geometry(hp_);
  KESTREL_ASSERT(kv.kv_dim() == (g.is_mla() ? g.kv_lora_rank + g.rope_dim : hp_.kv_dim()) && kv.has_v() == !g.is_mla(),
                 "KV cache shape does not match the model");
  auto require = [&](const WeightView& w, const std::string& what) {
    if (!w.type.self_contained() || !matmul_supports(w.type.storage))
      throw Error(model.path() + ": " + what + " has type " + std::string(type_name(w.type.storage)) +
                  ", which the CPU kernels do not support");
  };
  const ModelWeights& W = model.weights();
  for (int32_t l = -1; l < static_cast<int32_t>(hp_.n_layer); ++l)
    for (size_t r = 0; r < kWeightRoleCount; ++r) {
      const LayerTensor* t = W.find({l, static_cast<WeightRole>(r)});
      if (t == nullptr) continue;
      const std::string what = "tensor '" + std::string(weight_role_name(static_cast<WeightRole>(r))) + "'" +
                               (l < 0 ? std::string() : " of layer " + std::to_string(l));
      if (t->matrix.n_out > 0) require(t->matrix, what);
      for (const WeightView& e : t->experts) require(e, what);
    }
  if (hp_.moe.enabled()) expert_tokens_.assign(static_cast<size_t>(hp_.n_layer * hp_.moe.routing.n_expert), 0);
  inv_freq_ = rope_inv_freq(hp_, model.weights().rope_freq_factors);
  if (hp_.rope_theta_swa > 0) inv_freq_swa_ = rope_inv_freq(hp_, hp_.rope_theta_swa, {});
  if (hp_.mla.enabled()) prepare_mla();
}

void CpuModelRunner::check(const ForwardBatch& b) const {
  // Attention reads from each layer's window start (attention()), so released blocks before the
  // widest window may be kNoBlock.
  validate_forward_batch(b, hp_.n_vocab, kv_.n_blocks(), kv_.block_size(), hp_.kv_lookback());
}

void CpuModelRunner::attention(int32_t layer, Act qkv, Act out) {
  KESTREL_ASSERT(qkv == Act::Qkv && out == Act::Attn, "CPU attention: reads Act::Qkv, writes Act::Attn");
  const ForwardBatch& b = *batch_;
  const int64_t hd = hp_.head_dim;
  const int64_t window = hp_.layer_window(layer);
  const int64_t head_stride = static_cast<int64_t>(kv_.block_size()) * hd;
  AttentionArgs a{};
  a.k_cache = kv_.k(layer);
  a.v_cache = kv_.v(layer);
  a.kv_dtype = kv_.dtype();
  a.k_scale = kv_.k_scale(layer);
  a.v_scale = kv_.v_scale(layer);
  a.block_stride = hp_.n_head_kv * head_stride;
  a.block_size = kv_.block_size();
  a.head_dim = hd;
  a.group = hp_.n_head / hp_.n_head_kv;
  a.scale = hp_.softmax_scale();
  // Causal: a token sees itself and everything before it; a sliding window of W keys: positions
  // (pos - W, pos], as Mistral's reference attends.
  set_key_ranges(b, window);
  paged_attention(pool_, a, attention_batch(b, q_.data(), hp_.q_dim(), attn_.data(), hp_.q_dim(), hp_.n_head_kv, head_stride),
                  attn_states_);
}

void CpuModelRunner::set_key_ranges(const ForwardBatch& b, int64_t window) {
  const size_t n = static_cast<size_t>(b.n_tokens());
  attn_n_ctx_.resize(n);
  attn_kv_begin_.resize(n);
  for (size_t t = 0; t < n; ++t) {
    attn_n_ctx_[t] = b.positions[t] + 1;
    attn_kv_begin_[t] = window > 0 ? std::max<int64_t>(0, attn_n_ctx_[t] - window) : 0;
  }
}

AttentionBatch CpuModelRunner::attention_batch(const ForwardBatch& b, const float* q, int64_t q_stride, float* out,
                                               int64_t out_stride, int64_t n_head_kv, int64_t head_stride) const {
  return AttentionBatch{b.n_seqs(), b.query_start.data(), b.block_tables.data(), b.max_blocks_per_seq,
                        attn_n_ctx_.data(), attn_kv_begin_.data(), q, q_stride, out, out_stride, n_head_kv,
                        head_stride};
}

void CpuModelRunner::write_kv(const ForwardBatch& b, int64_t layer) {
  const int64_t n = b.n_tokens();
  const int64_t hd = hp_.head_dim;
  const int64_t kvd = hp_.kv_dim();
  const auto& op = ops();
  for (int64_t t = 0; t < n; ++t)
    for (int64_t h = 0; h < hp_.n_head_kv; ++h) {
      const int64_t off = kv_.offset(b.slot_mapping[t], h);
      const float* ks = k_.data() + t * kvd + h * hd;
      const float* vs = v_.data() + t * kvd + h * hd;
      if (kv_.dtype() == KvDtype::F16) {
        op.f32_to_f16(ks, static_cast<uint16_t*>(kv_.k(layer)) + off, hd);
        op.f32_to_f16(vs, static_cast<uint16_t*>(kv_.v(layer)) + off, hd);
      } else if (kv_.dtype() == KvDtype::INT8) {
        kv_.k_scale(layer)[off / hd] = quantize_row_int8(ks, static_cast<int8_t*>(kv_.k(layer)) + off, hd);
        kv_.v_scale(layer)[off / hd] = quantize_row_int8(vs, static_cast<int8_t*>(kv_.v(layer)) + off, hd);
      } else {
        std::memcpy(static_cast<float*>(kv_.k(layer)) + off, ks, sizeof(float) * static_cast<size_t>(hd));
        std::memcpy(static_cast<float*>(kv_.v(layer)) + off, vs, sizeof(float) * static_cast<size_t>(hd));
      }
    }
}

void CpuModelRunner::rms_norm_rows(const float* x, const float* w, float* y, int64_t n) {
  const int64_t d = hp_.n_embd;
  pool_.parallel_for(n, 4, [&](int64_t r0, int64_t r1) {
    ops().rms_norm(x + r0 * d, w, y + r0 * d, r1 - r0, d, hp_.rms_eps);
  });
}

std::span<const float> CpuModelRunner::forward(const ForwardBatch& b, std::span<const float> hidden_in) {
  check(b);
  const int64_t n = b.n_tokens();
  const int64_t d = hp_.n_embd;
  if (!role_.first && static_cast<int64_t>(hidden_in.size()) != n * d)
    throw Error("pipeline stage: hidden_in holds " + std::to_string(hidden_in.size()) + " values, the batch needs " +
                std::to_string(n) + " x " + std::to_string(d));
  hidden_in_ = hidden_in;
  grow(x_, n * d);
  grow(h_, n * d);
  grow(o_, n * d);
  grow(down_, n * d);
  grow(q_, n * hp_.q_dim());
  grow(k_, n * hp_.kv_dim());
  grow(v_, n * hp_.kv_dim());
  grow(attn_, n * std::max(hp_.q_dim(), hp_.attn_out_dim()));
  grow(gate_, n * hp_.n_ff);
  grow(up_, n * hp_.n_ff);
  token_seq_.resize(static_cast<size_t>(n));
  for (int64_t s = 0; s < b.n_seqs(); ++s)
    for (int32_t t = b.query_start[s]; t < b.query_start[s + 1]; ++t)
      token_seq_[static_cast<size_t>(t)] = static_cast<int32_t>(s);
  batch_ = &b;
  arch_.forward(*this, hp_);
  batch_ = nullptr;
  hidden_in_ = {};
  if (!role_.last) return {x_.data(), static_cast<size_t>(n * d)};
  const int64_t n_out = static_cast<int64_t>(b.logits_indices.size());
  return {logits_.data(), static_cast<size_t>(n_out * logits_width_)};
}

void CpuModelRunner::embed() {
  const ForwardBatch& b = *batch_;
  const int64_t d = hp_.n_embd;
  if (!role_.first) {  // the stage before computed the residual stream
    std::copy(hidden_in_.begin(), hidden_in_.end(), x_.begin());
    return;
  }
  const WeightView& e = model_.weights().at({-1, WeightRole::TokenEmbd}).matrix;
  // A tensor-parallel shard holds the rows of its vocabulary slice: the other ranks' tokens get
  // zeros here and their rows from the all-reduce (one nonzero term: exact).
  const int64_t begin = model_.weights().vocab_begin;
  for (int64_t t = 0; t < b.n_tokens(); ++t) {
    float* x = x_.data() + t * d;
    const int64_t row = b.token_ids[t] - begin;
    if (row < 0 || row >= e.n_out) {
      std::fill(x, x + d, 0.0f);
      continue;
    }
    dequantize_row(e.type.storage, e.row(row), x, d);
    if (hp_.embd_scale != 1.0f)
      for (int64_t i = 0; i < d; ++i) x[i] *= hp_.embd_scale;
  }
  if (comm_ != nullptr) comm_->all_reduce_sum(x_.data(), b.n_tokens() * d);
}

float* CpuModelRunner::act(Act a) {
  switch (a) {
    case Act::Attn: return attn_.data();
    case Act::AttnOut: return o_.data();
    case Act::Down: return down_.data();
    case Act::Normed: return h_.data();
    default: break;
  }
  KESTREL_ASSERT(false, "CPU backend: no single array for this activation");
  return nullptr;
}

size_t CpuModelRunner::act_parts(Act a, float** ys) {
  switch (a) {
    case Act::Qkv:
      ys[0] = q_.data(), ys[1] = k_.data(), ys[2] = v_.data();
      return 3;
    case Act::GateUp:
      ys[0] = gate_.data(), ys[1] = up_.data();
      return 2;
    default:
      ys[0] = act(a);
      return 1;
  }
}

void CpuModelRunner::add_to_residual(Act add) {
  if (add != Act::None) ops().add(x_.data(), act(add), batch_->n_tokens() * hp_.n_embd);
}

void CpuModelRunner::project(WeightId proj, const float* x, int64_t n, float* const* ys) {
  const std::span<const WeightRole> roles = parts(proj.role);
  KESTREL_ASSERT(roles.size() <= 4, "CPU backend: at most four projections of one input");
  WeightView w[4];
  const LayerTensor* t[4];
  for (size_t i = 0; i < roles.size(); ++i) {
    t[i] = &model_.weights().at({proj.layer, roles[i]});
    w[i] = t[i]->matrix;
  }
  // One fork-join for all parts; each output is bitwise what its own matmul gives.
  matmul_multi({w, roles.size()}, x, n, {ys, roles.size()}, ws_, pool_);
  for (size_t i = 0; i < roles.size(); ++i) {
    const std::vector<float>& bias = t[i]->bias;
    if (bias.empty()) continue;
    const int64_t width = w[i].n_out;
    for (int64_t r = 0; r < n; ++r) ops().add(ys[i] + r * width, bias.data(), width);
  }
}

void CpuModelRunner::add_norm_linear(Act add, WeightId norm, WeightId proj, Act out) {
  const int64_t n = batch_->n_tokens();
  add_to_residual(add);
  rms_norm_rows(x_.data(), model_.weights().at(norm).vector.data(), h_.data(), n);
  float* ys[4];
  KESTREL_ASSERT(act_parts(out, ys) == parts(proj.role).size(), "CPU backend: one output array per projection");
  project(proj, h_.data(), n, ys);
}

void CpuModelRunner::add_norm(Act add, WeightId norm, Act out) {
  KESTREL_ASSERT(out == Act::Normed, "CPU add_norm: writes Act::Normed");
  add_to_residual(add);
  rms_norm_rows(x_.data(), model_.weights().at(norm).vector.data(), h_.data(), batch_->n_tokens());
}

void CpuModelRunner::rope_write_kv(int32_t layer, Act qkv) {
  KESTREL_ASSERT(qkv == Act::Qkv, "CPU rope_write_kv: reads Act::Qkv");
  const ForwardBatch& b = *batch_;
  const int64_t n = b.n_tokens();
  const bool adjacent = hp_.rope_style == RopeStyle::AdjacentPairs;
  const float* inv_freq =
      !inv_freq_swa_.empty() && hp_.layer_window(layer) > 0 ? inv_freq_swa_.data() : inv_freq_.data();
  rope(q_.data(), b.positions.data(), n, hp_.n_head, hp_.head_dim, hp_.rope_dim, inv_freq, hp_.rope_linear_scale,
       adjacent);
  rope(k_.data(), b.positions.data(), n, hp_.n_head_kv, hp_.head_dim, hp_.rope_dim, inv_freq, hp_.rope_linear_scale,
       adjacent);
  write_kv(b, layer);
}

void CpuModelRunner::linear(Act in, WeightId proj, Act out) {
  float* ys[4];
  KESTREL_ASSERT(act_parts(out, ys) == parts(proj.role).size(), "CPU backend: one output array per projection");
  project(proj, act(in), batch_->n_tokens(), ys);
}

void CpuModelRunner::swiglu_linear(Act in, WeightId proj, Act out) {
  KESTREL_ASSERT(in == Act::GateUp && proj.role == WeightRole::Down, "CPU backend: SwiGLU reads Act::GateUp");
  glu_linear(false, proj, out);
}

void CpuModelRunner::geglu_linear(Act in, WeightId proj, Act out) {
  KESTREL_ASSERT(in == Act::GateUp && proj.role == WeightRole::Down, "CPU backend: GeGLU reads Act::GateUp");
  glu_linear(true, proj, out);
}

void CpuModelRunner::glu_linear(bool gelu, WeightId proj, Act out) {
  const int64_t n = batch_->n_tokens(), ff = hp_.n_ff;
  const auto& op = ops();
  // Row by row, so a token's arithmetic (vector lanes and tails) never depends on the batch.
  pool_.parallel_for(n, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* g = gate_.data() + r * ff;
      const float* u = up_.data() + r * ff;
      if (gelu) op.gelu_mul(g, u, g, ff);
      else op.silu_mul(g, u, g, ff);
    }
  });
  float* y = act(out);
  project(proj, gate_.data(), n, &y);
}

void CpuModelRunner::all_reduce(Act a) {
  if (comm_ != nullptr) comm_->all_reduce_sum(act(a), batch_->n_tokens() * hp_.n_embd);
}

void CpuModelRunner::qk_norm(int32_t layer, Act qkv) {
  KESTREL_ASSERT(qkv == Act::Qkv, "CPU qk_norm: reads Act::Qkv");
  const int64_t n = batch_->n_tokens(), hd = hp_.head_dim;
  const float* wq = model_.weights().at({layer, WeightRole::QNorm}).vector.data();
  const float* wk = model_.weights().at({layer, WeightRole::KNorm}).vector.data();
  // q_ is [n * n_head, head_dim] rows, k_ [n * n_head_kv, head_dim].
  pool_.parallel_for(n, 1, [&](int64_t r0, int64_t r1) {
    ops().rms_norm(q_.data() + r0 * hp_.q_dim(), wq, q_.data() + r0 * hp_.q_dim(), (r1 - r0) * hp_.n_head, hd,
                   hp_.rms_eps);
    ops().rms_norm(k_.data() + r0 * hp_.kv_dim(), wk, k_.data() + r0 * hp_.kv_dim(), (r1 - r0) * hp_.n_head_kv, hd,
                   hp_.rms_eps);
  });
}

void CpuModelRunner::norm(Act a, WeightId w) {
  float* x = act(a);
  rms_norm_rows(x, model_.weights().at(w).vector.data(), x, batch_->n_tokens());
}

void CpuModelRunner::final_norm_logits(Act add, WeightId norm, WeightId head) {
  const ForwardBatch& b = *batch_;
  const int64_t d = hp_.n_embd;
  const ModelWeights& w = model_.weights();
  add_to_residual(add);
  if (!role_.last) return;  // the residual stream goes to the next stage
  const int64_t n_out = static_cast<int64_t>(b.logits_indices.size());
  grow(logits_in_, n_out * d);
  logits_width_ = w.at(head).matrix.n_out;
  grow(logits_, n_out * logits_width_);
  for (int64_t i = 0; i < n_out; ++i)
    ops().rms_norm(x_.data() + static_cast<int64_t>(b.logits_indices[i]) * d, w.at(norm).vector.data(),
                   logits_in_.data() + i * d, 1, d, hp_.rms_eps);
  matmul(w.at(head).matrix, logits_in_.data(), n_out, logits_.data(), ws_, pool_);
}

}  // namespace kestrel::cpu
