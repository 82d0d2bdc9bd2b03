// The Llama family's decoder (Touvron et al. 2023): pre-norm blocks of RMSNorm -> attention with
// RoPE -> residual add, RMSNorm -> SwiGLU MLP -> residual add; final RMSNorm and the LM head.
// Qwen2 (biases on q, k and v) and Mistral (sliding-window attention: hparams.sliding_window, which
// the backends' attention applies) are the same graph; what differs (biases, RoPE pairing, GQA
// widths, the window) is in the weights and the hyperparameters the backends read.
#include "model/archs/archs.h"

namespace kestrel::archs {

void llama_forward(ForwardOps& ops, const ModelHparams& hp) {
  ops.embed();
  Act pending = Act::None;  // the block output the residual stream has not taken in yet
  for (int32_t l = 0; l < static_cast<int32_t>(hp.n_layer); ++l) {
    ops.add_norm_linear(pending, {l, WeightRole::AttnNorm}, {l, WeightRole::Qkv}, Act::Qkv);
    ops.rope_write_kv(l, Act::Qkv);
    ops.attention(l, Act::Qkv, Act::Attn);
    ops.linear(Act::Attn, {l, WeightRole::AttnOut}, Act::AttnOut);
    ops.add_norm_linear(Act::AttnOut, {l, WeightRole::FfnNorm}, {l, WeightRole::GateUp}, Act::GateUp);
    ops.swiglu_linear(Act::GateUp, {l, WeightRole::Down}, Act::Down);
    pending = Act::Down;
  }
  ops.final_norm_logits(pending, {-1, WeightRole::OutputNorm}, {-1, WeightRole::Output});
}

}  // namespace kestrel::archs
