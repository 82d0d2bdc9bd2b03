// Gemma 3 (Gemma Team 2025, "Gemma 3 Technical Report"): the embedding scaled by sqrt(d); blocks
// of RMSNorm -> attention with QK-norm and RoPE -> RMSNorm (post-attention) -> residual add, then
// RMSNorm -> GeGLU MLP -> RMSNorm (post-FFN) -> residual add; final RMSNorm and the tied LM head.
// Local layers attend through a sliding window with RoPE base rope_theta_swa, every
// swa_pattern-th layer globally with rope_theta (hparams.layer_window / layer_rope_theta, which the
// backends read).
#include "model/archs/archs.h"

namespace kestrel::archs {

void gemma3_forward(ForwardOps& ops, const ModelHparams& hp) {
  ops.embed();
  Act pending = Act::None;
  for (int32_t l = 0; l < static_cast<int32_t>(hp.n_layer); ++l) {
    ops.add_norm_linear(pending, {l, WeightRole::AttnNorm}, {l, WeightRole::Qkv}, Act::Qkv);
    ops.qk_norm(l, Act::Qkv);
    ops.rope_write_kv(l, Act::Qkv);
    ops.attention(l, Act::Qkv, Act::Attn);
    ops.linear(Act::Attn, {l, WeightRole::AttnOut}, Act::AttnOut);
    ops.norm(Act::AttnOut, {l, WeightRole::PostAttnNorm});
    ops.add_norm_linear(Act::AttnOut, {l, WeightRole::FfnNorm}, {l, WeightRole::GateUp}, Act::GateUp);
    ops.geglu_linear(Act::GateUp, {l, WeightRole::Down}, Act::Down);
    ops.norm(Act::Down, {l, WeightRole::PostFfnNorm});
    pending = Act::Down;
  }
  ops.final_norm_logits(pending, {-1, WeightRole::OutputNorm}, {-1, WeightRole::Output});
}

std::vector<TensorSpec> gemma3_tensors(const ModelHparams& hp, int32_t layer) {
  using R = WeightRole;
  const int64_t d = hp.n_embd, hd = hp.head_dim;
  if (layer < 0) return model_tensors(hp, 1.0f);
  const std::string g = "blk." + std::to_string(layer) + ".";
  const std::string h = "model.layers." + std::to_string(layer) + ".";
  // transformers' post_attention_layernorm is the post-norm of the attention output; the FFN's
  // pre-norm is pre_feedforward_layernorm (GGUF ffn_norm).
  return {{R::AttnNorm, g + "attn_norm", h + "input_layernorm", 0, d, false, 0, 1.0f},
          {R::Q, g + "attn_q", h + "self_attn.q_proj", d, hp.q_dim()},
          {R::K, g + "attn_k", h + "self_attn.k_proj", d, hp.kv_dim()},
          {R::V, g + "attn_v", h + "self_attn.v_proj", d, hp.kv_dim()},
          {R::QNorm, g + "attn_q_norm", h + "self_attn.q_norm", 0, hd, false, 0, 1.0f},
          {R::KNorm, g + "attn_k_norm", h + "self_attn.k_norm", 0, hd, false, 0, 1.0f},
          {R::AttnOut, g + "attn_output", h + "self_attn.o_proj", hp.q_dim(), d},
          {R::PostAttnNorm, g + "post_attention_norm", h + "post_attention_layernorm", 0, d, false, 0, 1.0f},
          {R::FfnNorm, g + "ffn_norm", h + "pre_feedforward_layernorm", 0, d, false, 0, 1.0f},
          {R::Gate, g + "ffn_gate", h + "mlp.gate_proj", d, hp.n_ff},
          {R::Up, g + "ffn_up", h + "mlp.up_proj", d, hp.n_ff},
          {R::Down, g + "ffn_down", h + "mlp.down_proj", hp.n_ff, d},
          {R::PostFfnNorm, g + "post_ffw_norm", h + "post_feedforward_layernorm", 0, d, false, 0, 1.0f}};
}

}  // namespace kestrel::archs
