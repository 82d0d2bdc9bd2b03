// The operations a model's forward pass is written in. An architecture's builder
// (src/model/archs/) calls them in order, once, for every backend; each backend implements them
// over the activations and weights it holds for the pass in progress (the CPU backend in f32 host
// arrays, the CUDA backend in bf16 device buffers) and may fuse neighbours behind this interface:
// the CUDA backend folds the residual add and RMSNorm into a one-token GEMV and RoPE + K/V write
// into decode attention.
//
// A pass's batch (ForwardBatch: token ids, positions, slots, block tables, logits rows) is the
// backend's; the ops never see it. Shapes below: n = the batch's tokens, d = n_embd.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "model/hparams.h"
#include "model/model_weights.h"

namespace kestrel {

// Activations of a pass, each [n, width] in the backend's element type.
enum class Act {
  None,     // no tensor (add_norm_linear's add on the first layer)
  Qkv,      // [n, q_dim + 2 kv_dim]
  Attn,     // [n, q_dim] attention output
  AttnOut,  // [n, d] output projection, added to the residual stream by the next add_norm_*
  GateUp,   // [n, 2 n_ff]
  Down,     // [n, d] MLP output, added to the residual stream by the next add_norm_*
  Normed,   // [n, d] RMSNorm of the residual stream (add_norm)
};

class ForwardOps {
 public:
  virtual ~ForwardOps() = default;
  // residual [n, d] = the token embedding rows of the batch's ids.
  virtual void embed() = 0;
  // residual += add (nothing for Act::None), then out = RMSNorm(residual) * w(norm) . w(proj)^T
  // (+ the projection's bias). RMSNorm: Zhang & Sennrich 2019.
  virtual void add_norm_linear(Act add, WeightId norm, WeightId proj, Act out) = 0;
  // RoPE (Su et al. 2021) on the q and k heads of `qkv` at each token's position, then each token's
  // k and v into its slot of the layer's paged KV cache.
  virtual void rope_write_kv(int32_t layer, Act qkv) = 0;
  // Exact causal attention of the q heads of `qkv` over the layer's KV cache through the block
  // tables (GQA: q head h reads KV head h / (n_head / n_head_kv)) -> out [n, q_dim].
  virtual void attention(int32_t layer, Act qkv, Act out) = 0;
  // out = in . w(proj)^T (+ its bias).
  virtual void linear(Act in, WeightId proj, Act out) = 0;
  // out = (silu(gate) * up) . w(proj)^T, in = [gate | up] rows (SwiGLU, Shazeer 2020).
  virtual void swiglu_linear(Act in, WeightId proj, Act out) = 0;
  // residual += add, then the logits of the batch's logits rows: RMSNorm(row) * w(norm) .
  // w(head)^T, [n_rows, n_vocab] f32 (a tensor-parallel rank: its head rows, [n_rows, n_vocab / N]).
  virtual void final_norm_logits(Act add, WeightId norm, WeightId head) = 0;

  // Tensor parallelism: `a` [n, d], this rank's partial sum of a row-parallel projection (its
  // slice of the input columns), becomes the sum over the ranks (Communicator::all_reduce_sum). A
  // backend that runs the whole model on one rank has the sum already: nothing to do.
  virtual void all_reduce(Act a) { (void)a; }

  // Ops of some architectures only. A backend without one throws kestrel::Error naming it.
  // residual += add, then out = RMSNorm(residual) * w(norm).
  virtual void add_norm(Act add, WeightId norm, Act out);
  // The mixture-of-experts FFN of `layer` (hparams.moe): router logits in . w(Router)^T (f32),
  // moe_select's top-k experts and weights per token, out = sum_k w_k * ExpDown_e(silu(ExpGate_e
  // in) * ExpUp_e in) + [sigmoid(in . w(ShRouter)) *] ShDown(silu(ShGate in) * ShUp in).
  virtual void moe_ffn(int32_t layer, Act in, Act out);
  // Multi-head latent attention of `layer` (hparams.mla; DeepSeek-V2, arXiv:2405.04434 sec. 2.1)
  // from the normed input [n, d] to the heads' outputs out [n, n_head * v_head_dim]: queries
  // through QA -> QANorm -> QB (or Q), the latent c = RMSNorm(KvA[:r]) * KvANorm and the RoPE key
  // k_R = rope(KvA[r:]) cached per token; head h's score is q_nope_h . (W_UK_h c) + q_rope_h . k_R,
  // its output W_UV_h (sum_j p_j c_j) (W_UK_h, W_UV_h: KvB's rows of head h), scale
  // hparams.softmax_scale(). A backend may absorb W_UK into the query and W_UV after the sum.
  virtual void mla_attention(int32_t layer, Act in, Act out);
  // Each q and k head of `qkv` = RMSNorm(head) * w(QNorm / KNorm) [head_dim] (Gemma 3's QK-norm,
  // before RoPE).
  virtual void qk_norm(int32_t layer, Act qkv);
  // a = RMSNorm(a) * w(norm), row by row (Gemma's post-attention and post-FFN norms).
  virtual void norm(Act a, WeightId w);
  // out = (gelu_tanh(gate) * up) . w(proj)^T, in = [gate | up] rows (GeGLU, Shazeer 2020; the
  // tanh approximation of GELU, Hendrycks & Gimpel 2016).
  virtual void geglu_linear(Act in, WeightId proj, Act out);
};

// One tensor an architecture loads, named as llama.cpp's GGUF files and transformers' state dicts
// name it, without the ".weight" / ".bias" suffix ("blk.3.attn_q", "model.layers.3.self_attn.q_proj").
// Experts (n_expert > 0): GGUF stores one 3-D tensor ne {n_in, n_out, n_expert}
// ("blk.3.ffn_gate_exps"); an HF folder one tensor per expert, its name the hf pattern with "{e}"
// replaced by the expert's index ("model.layers.3.mlp.experts.{e}.gate_proj").
struct TensorSpec {
  WeightRole role;   // a stored role
  std::string gguf;
  std::string hf;
  int64_t n_in = 0;   // a matrix's columns; 0 for a vector
  int64_t n_out = 0;  // a matrix's rows, or the vector's length
  // May carry a bias [n_out]: in a GGUF file loaded when present, in an HF folder when config.json
  // says so (HfModelConfig::has_bias).
  bool may_have_bias = false;
  int64_t n_expert = 0;  // > 0: a set of n_expert [n_out, n_in] matrices (LayerTensor::experts)
  // Added to a vector read from an HF folder: Gemma stores its norm weights as w for a scale of
  // 1 + w (GGUF files already hold 1 + w).
  float hf_add = 0;
};

// One architecture family: its tensors and its forward pass over ForwardOps. Adding an
// architecture adds a builder under src/model/archs/ and its names to the registry
// (architecture.cpp); no backend file changes unless it needs an op the backends lack.
struct Architecture {
  std::string_view name;
  void (*forward)(ForwardOps& ops, const ModelHparams& hp);
  // The tensors of one layer (layer -1: the model-level ones), all required except the LM head
  // (WeightRole::Output), whose absence means it is tied to the token embedding.
  std::vector<TensorSpec> (*tensors)(const ModelHparams& hp, int32_t layer);
};

// The architecture registered under `name` (GGUF general.architecture / the HF config's family:
// "llama", "qwen2", "mistral"), or null.
const Architecture* find_architecture(std::string_view name);
// find_architecture, or kestrel::Error naming the architecture and the supported ones.
const Architecture& architecture(std::string_view name);
std::vector<std::string_view> architecture_names();

}  // namespace kestrel
