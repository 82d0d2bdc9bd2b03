// Hyperparameters of a Llama-family decoder (Llama 2/3, SmolLM2, Qwen2, Mistral).
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "model/moe_router.h"

namespace kestrel {

class GgufFile;

// How RoPE pairs the dimensions of a head. GGUF "llama" weights are permuted by the converter so
// that adjacent pairs (x[2i], x[2i+1]) rotate together; Hugging Face checkpoints and GGUF "qwen2"
// rotate x[i] with x[i + rope_dim/2] ("rotate half", GPT-NeoX style).
enum class RopeStyle { AdjacentPairs, RotateHalf };

// A mixture-of-experts FFN (Shazeer et al. 2017; Mixtral, Qwen2-MoE, DeepSeek-V2): in its MoE
// layers each token runs n_expert_used of n_expert routed SwiGLU experts (width n_ff_expert),
// mixed by the router's weights (routing), plus an always-run shared expert of width n_ff_shared
// (Qwen2-MoE scales it by sigmoid(x . w_gate), shared_gate). Other layers keep the dense FFN
// (width n_ff).
struct MoeHparams {
  MoeRouting routing;          // n_expert 0: a dense model
  int64_t n_ff_expert = 0;     // one routed expert's intermediate width
  int64_t n_ff_shared = 0;     // the shared expert's (all shared experts together), 0 = none
  bool shared_gate = false;    // Qwen2-MoE: the shared expert's output times sigmoid(x . shared_expert_gate)
  int64_t first_dense = 0;     // layers [0, first_dense) are dense (DeepSeek's first_k_dense_replace)
  int64_t sparse_step = 1;     // Qwen2-MoE decoder_sparse_step: layer l is MoE iff (l + 1) % step == 0
  std::vector<int64_t> dense_layers;  // Qwen2-MoE mlp_only_layers

  bool enabled() const { return routing.n_expert > 0; }
  bool is_moe_layer(int64_t layer) const;
};

// Multi-head latent attention (DeepSeek-V2, arXiv:2405.04434 sec. 2.1): per token one latent
// c_KV [kv_lora_rank] (after kv_a_layernorm) and one RoPE key k_R [qk_rope] shared by all heads
// are cached; head h's key is [W_UK_h c_KV | k_R] and its value W_UV_h c_KV, both from kv_b_proj.
// Queries come through the low-rank q_a_proj -> q_a_layernorm -> q_b_proj (q_lora_rank > 0) or q_proj.
struct MlaHparams {
  int64_t q_lora_rank = 0;   // 0: a full-rank q_proj (DeepSeek-V2-Lite)
  int64_t kv_lora_rank = 0;  // > 0: the model uses MLA
  int64_t qk_nope = 0;       // the non-rotated part of each q/k head
  int64_t qk_rope = 0;       // the rotated part (== ModelHparams::rope_dim)
  int64_t v_head_dim = 0;

  bool enabled() const { return kv_lora_rank > 0; }
};

struct ModelHparams {
  std::string arch;         // "llama", "qwen2", ...
  std::string name;         // general.name, for display
  int64_t n_vocab = 0;
  int64_t n_ctx_train = 0;  // trained context length
  int64_t n_embd = 0;
  int64_t n_layer = 0;
  int64_t n_head = 0;
  int64_t n_head_kv = 0;
  int64_t head_dim = 0;     // n_embd / n_head unless the file says otherwise
  int64_t n_ff = 0;
  int64_t rope_dim = 0;     // dimensions of a head that RoPE rotates (== head_dim for Llama)
  float rms_eps = 1e-5f;
  float rope_theta = 10000.0f;
  float rope_linear_scale = 1.0f;  // positions are divided by this ("linear" rope scaling)
  RopeStyle rope_style = RopeStyle::AdjacentPairs;
  // Sliding-window attention span in tokens (Mistral's sliding_window): the token at position p
  // attends to positions (p - W, p]; 0 = full attention. Every layer, unless swa_pattern > 0:
  // then layer l is global (full attention, RoPE base rope_theta) when (l + 1) % swa_pattern == 0
  // and windowed (RoPE base rope_theta_swa) otherwise (Gemma 3: 5 local layers to 1 global).
  int64_t sliding_window = 0;
  int64_t swa_pattern = 0;
  float rope_theta_swa = 0;     // 0 = rope_theta
  float embd_scale = 1;         // token embeddings times this (Gemma: sqrt(n_embd))
  MoeHparams moe;
  MlaHparams mla;               // MLA: head_dim = qk_nope + qk_rope, rope_dim = qk_rope
  float attn_scale = 0;         // softmax scale; 0 = 1 / sqrt(head_dim) (YaRN's mscale changes it)
  // YaRN RoPE scaling (Peng et al. 2023) as a GGUF file states it (rope.scaling.type "yarn",
  // DeepSeek-V2): the loader turns it into per-pair frequency factors (yarn_rope_freq_factors).
  // yarn_factor 0: none (a Hugging Face folder's YaRN arrives as factors directly).
  double yarn_factor = 0;
  double yarn_original_ctx = 0;  // the context the model was trained at before the extension

  int64_t q_dim() const { return n_head * head_dim; }
  int64_t kv_dim() const { return n_head_kv * head_dim; }
  // Width of the attention output (the input of the output projection).
  int64_t attn_out_dim() const { return mla.enabled() ? n_head * mla.v_head_dim : q_dim(); }
  float softmax_scale() const;
  // The window of `layer` (0 = full attention) and its RoPE base.
  int64_t layer_window(int64_t layer) const {
    return swa_pattern > 0 && (layer + 1) % swa_pattern == 0 ? 0 : sliding_window;
  }
  float layer_rope_theta(int64_t layer) const {
    return layer_window(layer) > 0 && rope_theta_swa > 0 ? rope_theta_swa : rope_theta;
  }
  // When every layer is windowed (Mistral), the most positions back any layer reads (the largest
  // window): a token at p reads no key before p + 1 - kv_lookback(). 0 when some layer attends to
  // every earlier key (most models, Gemma 3's global layers).
  int64_t kv_lookback() const {
    int64_t w = 0;
    for (int64_t l = 0; l < n_layer; ++l) {
      if (layer_window(l) <= 0) return 0;
      w = std::max(w, layer_window(l));
    }
    return w;
  }

  // Reads `<arch>.*` keys (GGUF naming, e.g. llama.embedding_length). Throws kestrel::Error naming
  // the key when a required key is missing or a value is out of range (e.g. n_head not dividing
  // n_embd, n_head_kv not dividing n_head).
  static ModelHparams from_gguf(const GgufFile& file);
  void validate() const;
  std::string summary() const;
};

// RoPE inverse frequencies [rope_dim / 2]: theta^(-2i / rope_dim) / freq_factors[i] (factors
// empty = 1), computed in double and rounded to f32 once (Su et al. 2021; Llama 3 factors as in
// GGUF rope_freqs.weight or HF rope_scaling "llama3").
std::vector<float> rope_inv_freq(const ModelHparams& hp, const std::vector<float>& freq_factors);
// The same for RoPE base theta.
std::vector<float> rope_inv_freq(const ModelHparams& hp, double theta, const std::vector<float>& freq_factors);

}  // namespace kestrel
