// DeepSeek-V2 (DeepSeek-AI 2024, arXiv:2405.04434): pre-norm blocks of RMSNorm -> multi-head latent
// attention -> output projection -> residual add, then the FFN (dense in the first
// first_k_dense_replace layers, else routed experts plus shared experts); final RMSNorm and the LM
// head. V2-Lite has no query low-rank projection (q_proj instead of q_a/q_b).
#include "model/archs/archs.h"

namespace kestrel::archs {

void deepseek2_forward(ForwardOps& ops, const ModelHparams& hp) {
  ops.embed();
  Act pending = Act::None;
  for (int32_t l = 0; l < static_cast<int32_t>(hp.n_layer); ++l) {
    ops.add_norm(pending, {l, WeightRole::AttnNorm}, Act::Normed);
    ops.mla_attention(l, Act::Normed, Act::Attn);
    ops.linear(Act::Attn, {l, WeightRole::AttnOut}, Act::AttnOut);
    ffn_block(ops, hp, l);
    pending = Act::Down;
  }
  ops.final_norm_logits(pending, {-1, WeightRole::OutputNorm}, {-1, WeightRole::Output});
}

std::vector<TensorSpec> deepseek2_tensors(const ModelHparams& hp, int32_t layer) {
  using R = WeightRole;
  const int64_t d = hp.n_embd;
  if (layer < 0) return model_tensors(hp);
  const MlaHparams& mla = hp.mla;
  const int64_t r = mla.kv_lora_rank, q_out = hp.n_head * (mla.qk_nope + mla.qk_rope);
  const std::string g = "blk." + std::to_string(layer) + ".";
  const std::string h = "model.layers." + std::to_string(layer) + ".";
  const std::string a = h + "self_attn.";
  std::vector<TensorSpec> t = {{R::AttnNorm, g + "attn_norm", h + "input_layernorm", 0, d}};
  if (mla.q_lora_rank > 0) {
    t.push_back({R::QA, g + "attn_q_a", a + "q_a_proj", d, mla.q_lora_rank});
    t.push_back({R::QANorm, g + "attn_q_a_norm", a + "q_a_layernorm", 0, mla.q_lora_rank});
    t.push_back({R::QB, g + "attn_q_b", a + "q_b_proj", mla.q_lora_rank, q_out});
  } else {
    t.push_back({R::Q, g + "attn_q", a + "q_proj", d, q_out});
  }
  t.push_back({R::KvA, g + "attn_kv_a_mqa", a + "kv_a_proj_with_mqa", d, r + mla.qk_rope});
  t.push_back({R::KvANorm, g + "attn_kv_a_norm", a + "kv_a_layernorm", 0, r});
  t.push_back({R::KvB, g + "attn_kv_b", a + "kv_b_proj", r, hp.n_head * (mla.qk_nope + mla.v_head_dim)});
  t.push_back({R::AttnOut, g + "attn_output", a + "o_proj", hp.n_head * mla.v_head_dim, d});
  t.push_back({R::FfnNorm, g + "ffn_norm", h + "post_attention_layernorm", 0, d});
  add_ffn_tensors(t, hp, layer, {"mlp.", "gate_proj", "up_proj", "down_proj", "shared_experts."});
  return t;
}

}  // namespace kestrel::archs
