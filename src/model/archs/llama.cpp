// The Llama family's decoder (Touvron et al. 2023): pre-norm blocks of RMSNorm -> attention with
// RoPE -> residual add, RMSNorm -> SwiGLU MLP -> residual add; final RMSNorm and the LM head.
// Qwen2 (biases on q, k and v) and Mistral (sliding-window attention: hparams.sliding_window, which
// the backends' attention applies) are the same graph; what differs (biases, RoPE pairing, GQA
// widths, the window) is in the weights and the hyperparameters the backends read. Mixtral
// (Jiang et al. 2024) and Qwen2-MoE replace the MLP of their MoE layers (hparams.moe) with routed
// experts (and Qwen2-MoE's gated shared expert). all_reduce after the output and down projections
// sums a tensor-parallel rank's partial rows (LlamaModel::tensor_parallel_shard); a no-op otherwise.
#include "model/archs/archs.h"

namespace kestrel::archs {

std::vector<TensorSpec> model_tensors(const ModelHparams& hp, float norm_hf_add) {
  using R = WeightRole;
  const int64_t d = hp.n_embd;
  return {{R::TokenEmbd, "token_embd", "model.embed_tokens", d, hp.n_vocab},
          {R::OutputNorm, "output_norm", "model.norm", 0, d, false, 0, norm_hf_add},
          {R::Output, "output", "lm_head", d, hp.n_vocab}};
}

void ffn_block(ForwardOps& ops, const ModelHparams& hp, int32_t l) {
  if (hp.moe.is_moe_layer(l)) {
    ops.add_norm(Act::AttnOut, {l, WeightRole::FfnNorm}, Act::Normed);
    ops.moe_ffn(l, Act::Normed, Act::Down);
  } else {
    ops.add_norm_linear(Act::AttnOut, {l, WeightRole::FfnNorm}, {l, WeightRole::GateUp}, Act::GateUp);
    ops.swiglu_linear(Act::GateUp, {l, WeightRole::Down}, Act::Down);
    ops.all_reduce(Act::Down);
  }
}

void add_ffn_tensors(std::vector<TensorSpec>& t, const ModelHparams& hp, int32_t layer, const HfFfnNames& n) {
  using R = WeightRole;
  const int64_t d = hp.n_embd;
  const std::string g = "blk." + std::to_string(layer) + ".";
  const std::string h = "model.layers." + std::to_string(layer) + ".";
  if (!hp.moe.is_moe_layer(layer)) {
    t.push_back({R::Gate, g + "ffn_gate", h + "mlp.gate_proj", d, hp.n_ff});
    t.push_back({R::Up, g + "ffn_up", h + "mlp.up_proj", d, hp.n_ff});
    t.push_back({R::Down, g + "ffn_down", h + "mlp.down_proj", hp.n_ff, d});
    return;
  }
  const std::string m = h + n.moe;
  const std::string e = m + "experts.{e}.";
  const int64_t n_exp = hp.moe.routing.n_expert, f = hp.moe.n_ff_expert, sh = hp.moe.n_ff_shared;
  t.push_back({R::Router, g + "ffn_gate_inp", m + "gate", d, n_exp});
  t.push_back({R::ExpGate, g + "ffn_gate_exps", e + n.expert_gate, d, f, false, n_exp});
  t.push_back({R::ExpUp, g + "ffn_up_exps", e + n.expert_up, d, f, false, n_exp});
  t.push_back({R::ExpDown, g + "ffn_down_exps", e + n.expert_down, f, d, false, n_exp});
  if (sh > 0) {
    t.push_back({R::ShGate, g + "ffn_gate_shexp", m + n.shared + "gate_proj", d, sh});
    t.push_back({R::ShUp, g + "ffn_up_shexp", m + n.shared + "up_proj", d, sh});
    t.push_back({R::ShDown, g + "ffn_down_shexp", m + n.shared + "down_proj", sh, d});
  }
  if (hp.moe.shared_gate) t.push_back({R::ShRouter, g + "ffn_gate_inp_shexp", m + "shared_expert_gate", d, 1});
}

void llama_forward(ForwardOps& ops, const ModelHparams& hp) {
  ops.embed();
  Act pending = Act::None;  // the block output the residual stream has not taken in yet
  for (int32_t l = 0; l < static_cast<int32_t>(hp.n_layer); ++l) {
    ops.add_norm_linear(pending, {l, WeightRole::AttnNorm}, {l, WeightRole::Qkv}, Act::Qkv);
    ops.rope_write_kv(l, Act::Qkv);
    ops.attention(l, Act::Qkv, Act::Attn);
    ops.linear(Act::Attn, {l, WeightRole::AttnOut}, Act::AttnOut);
    ops.all_reduce(Act::AttnOut);
    ffn_block(ops, hp, l);
    pending = Act::Down;
  }
  ops.final_norm_logits(pending, {-1, WeightRole::OutputNorm}, {-1, WeightRole::Output});
}

std::vector<TensorSpec> llama_tensors(const ModelHparams& hp, int32_t layer) {
  using R = WeightRole;
  const int64_t d = hp.n_embd;
  if (layer < 0) return model_tensors(hp);
  const std::string g = "blk." + std::to_string(layer) + ".";
  const std::string h = "model.layers." + std::to_string(layer) + ".";
  std::vector<TensorSpec> t = {
      {R::AttnNorm, g + "attn_norm", h + "input_layernorm", 0, d},
      {R::Q, g + "attn_q", h + "self_attn.q_proj", d, hp.q_dim(), true},
      {R::K, g + "attn_k", h + "self_attn.k_proj", d, hp.kv_dim(), true},
      {R::V, g + "attn_v", h + "self_attn.v_proj", d, hp.kv_dim(), true},
      {R::AttnOut, g + "attn_output", h + "self_attn.o_proj", hp.q_dim(), d, true},
      {R::FfnNorm, g + "ffn_norm", h + "post_attention_layernorm", 0, d}};
  // Mixtral's experts are block_sparse_moe.experts.E.{w1 gate, w3 up, w2 down}; Qwen2-MoE's
  // mlp.experts.E.{gate,up,down}_proj beside mlp.shared_expert and mlp.shared_expert_gate.
  if (hp.arch == "mixtral") {
    add_ffn_tensors(t, hp, layer, {"block_sparse_moe.", "w1", "w3", "w2", ""});
  } else {
    add_ffn_tensors(t, hp, layer, {"mlp.", "gate_proj", "up_proj", "down_proj", "shared_expert."});
  }
  return t;
}

}  // namespace kestrel::archs
