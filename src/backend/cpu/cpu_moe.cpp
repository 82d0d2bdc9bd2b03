// The CPU backend's mixture-of-experts FFN: route each token (moe_select over f32 router logits),
// group the (token, slot) rows by expert, run one SwiGLU GEMM per expert over its rows, and mix each
// token's k expert outputs in slot order, so a token's bits never depend on the batch around it.
#include <cmath>

#include "backend/cpu/cpu_model_runner.h"
#include "backend/cpu/ops.h"
#include "core/error.h"
#include "model/moe_router.h"

namespace kestrel::cpu {

void CpuModelRunner::moe_ffn(int32_t layer, Act in, Act out) {
  const MoeHparams& moe = hp_.moe;
  const ModelWeights& W = model_.weights();
  const int64_t n = batch_->n_tokens(), d = hp_.n_embd;
  const int64_t n_exp = moe.routing.n_expert, k = moe.routing.n_expert_used, f = moe.n_ff_expert;
  const float* x = act(in);
  float* y = act(out);
  KESTREL_ASSERT(x != y, "CPU moe_ffn: in and out are different activations");
  const auto& op = ops();

  // Router: logits [n, n_exp] in f32, then each token's top-k experts and weights.
  grow(router_logits_, n * n_exp);
  matmul(W.at({layer, WeightRole::Router}).matrix, x, n, router_logits_.data(), ws_, pool_);
  grow(moe_ids_, n * k);
  grow(moe_weights_, n * k);
  for (int64_t t = 0; t < n; ++t)
    moe_select(router_logits_.data() + t * n_exp, moe.routing, moe_ids_.data() + t * k, moe_weights_.data() + t * k);

  // Rows grouped by expert (counting sort, stable in (token, slot) order): rows
  // [moe_offsets_[e], moe_offsets_[e + 1]) of the grouped arrays are expert e's; moe_rows_[i] is
  // the (token * k + slot) index of grouped row i.
  moe_offsets_.assign(static_cast<size_t>(n_exp + 1), 0);
  for (int64_t r = 0; r < n * k; ++r) ++moe_offsets_[static_cast<size_t>(moe_ids_[r] + 1)];
  for (int64_t e = 0; e < n_exp; ++e) moe_offsets_[e + 1] += moe_offsets_[e];
  grow(moe_rows_, n * k);
  std::vector<int32_t> fill(moe_offsets_.begin(), moe_offsets_.end() - 1);
  std::vector<int32_t> grouped_row(static_cast<size_t>(n * k));  // (token * k + slot) -> grouped row
  for (int64_t r = 0; r < n * k; ++r) {
    const int32_t g = fill[static_cast<size_t>(moe_ids_[r])]++;
    moe_rows_[g] = static_cast<int32_t>(r);
    grouped_row[static_cast<size_t>(r)] = g;
  }
  grow(moe_x_, n * k * d);
  grow(moe_gate_, n * k * f);
  grow(moe_up_, n * k * f);
  grow(moe_y_, n * k * d);
  for (int64_t r = 0; r < n * k; ++r)
    std::copy_n(x + (moe_rows_[r] / k) * d, d, moe_x_.data() + r * d);

  const LayerTensor& gate = W.at({layer, WeightRole::ExpGate});
  const LayerTensor& up = W.at({layer, WeightRole::ExpUp});
  const LayerTensor& down = W.at({layer, WeightRole::ExpDown});
  for (int64_t e = 0; e < n_exp; ++e) {
    const int64_t r0 = moe_offsets_[e], m = moe_offsets_[e + 1] - r0;
    if (m == 0) continue;  // only the selected experts' weights are read
    expert_tokens_[static_cast<size_t>(layer * n_exp + e)] += static_cast<uint64_t>(m);
    const WeightView gu[2] = {gate.experts[e], up.experts[e]};
    float* const gu_out[2] = {moe_gate_.data() + r0 * f, moe_up_.data() + r0 * f};
    matmul_multi(gu, moe_x_.data() + r0 * d, m, gu_out, ws_, pool_);
    for (int64_t r = r0; r < r0 + m; ++r)
      op.silu_mul(moe_gate_.data() + r * f, moe_up_.data() + r * f, moe_gate_.data() + r * f, f);
    matmul(down.experts[e], moe_gate_.data() + r0 * f, m, moe_y_.data() + r0 * d, ws_, pool_);
  }

  // out[t] = sum over slots j (in order) of w_j * expert_j(x[t]).
  for (int64_t t = 0; t < n; ++t) {
    float* yt = y + t * d;
    for (int64_t j = 0; j < k; ++j) {
      const float w = moe_weights_[t * k + j];
      const float* ye = moe_y_.data() + static_cast<int64_t>(grouped_row[static_cast<size_t>(t * k + j)]) * d;
      if (j == 0) {
        for (int64_t i = 0; i < d; ++i) yt[i] = w * ye[i];
      } else {
        for (int64_t i = 0; i < d; ++i) yt[i] += w * ye[i];
      }
    }
  }

  if (moe.n_ff_shared == 0) return;
  // The shared expert runs on every token; Qwen2-MoE scales it by sigmoid(x . w_gate).
  const int64_t s = moe.n_ff_shared;
  grow(shared_gate_, n * s);
  grow(shared_up_, n * s);
  grow(shared_y_, n * d);
  float* gu_out[2] = {shared_gate_.data(), shared_up_.data()};
  project({layer, WeightRole::ShGateUp}, x, n, gu_out);
  for (int64_t t = 0; t < n; ++t)
    op.silu_mul(shared_gate_.data() + t * s, shared_up_.data() + t * s, shared_gate_.data() + t * s, s);
  float* sy = shared_y_.data();
  project({layer, WeightRole::ShDown}, shared_gate_.data(), n, &sy);
  if (moe.shared_gate) {
    grow(shared_scale_, n);
    matmul(W.at({layer, WeightRole::ShRouter}).matrix, x, n, shared_scale_.data(), ws_, pool_);
  }
  for (int64_t t = 0; t < n; ++t) {
    const float g = moe.shared_gate ? 1.0f / (1.0f + std::exp(-shared_scale_[t])) : 1.0f;
    for (int64_t i = 0; i < d; ++i) y[t * d + i] += g * shared_y_[t * d + i];
  }
}

}  // namespace kestrel::cpu
