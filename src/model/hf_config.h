// A Hugging Face config.json of a Llama-family model, as ModelHparams plus what the weight loader
// needs to know (tied embeddings, which biases exist, RoPE frequency divisors).
//
// Architectures (config "architectures"[0], else "model_type"): LlamaForCausalLM, MistralForCausalLM,
// Qwen2ForCausalLM, MixtralForCausalLM, Qwen2MoeForCausalLM, DeepseekV2ForCausalLM. Field meanings and defaults are those
// of transformers' LlamaConfig, MistralConfig, Qwen2Config, MixtralConfig, Qwen2MoeConfig and DeepseekV2Config
// (src/transformers/models/<arch>/configuration_<arch>.py).
#pragma once

#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "model/hparams.h"
#include "model/model_weights.h"
#include "model/quant_config.h"

namespace kestrel {

struct HfModelConfig {
  ModelHparams hparams;  // arch "llama" / "mistral" / "qwen2" / "mixtral" / "qwen2moe" / "deepseek2"
  std::string torch_dtype;           // "bfloat16", "float32", ...; "" when absent (informational)
  bool tie_word_embeddings = false;  // the output matrix is model.embed_tokens.weight
  bool qkv_bias = false;             // q/k/v_proj.bias exist: Qwen2 always, Llama with attention_bias
  bool o_bias = false;               // o_proj.bias exists: Llama with attention_bias
  // Whether the folder stores a bias for this stored role (a missing one is an error, an
  // unannounced one too).
  bool has_bias(WeightRole role) const {
    if (role == WeightRole::Q || role == WeightRole::K || role == WeightRole::V) return qkv_bias;
    return role == WeightRole::AttnOut && o_bias;
  }
  // [rope_dim / 2] divisors of the RoPE frequencies (rope_scaling type llama3), or empty; the same
  // values a GGUF carries as rope_freqs.weight.
  std::vector<float> rope_freq_factors;
  // quantization_config (QuantConfig::from_json); method None for a float checkpoint.
  QuantConfig quant;

  // Reads the fields: hidden_size, intermediate_size, num_hidden_layers, num_attention_heads and
  // vocab_size (required); num_key_value_heads (default num_attention_heads), head_dim (default
  // hidden_size / num_attention_heads), rms_norm_eps (1e-6), rope_theta (10000),
  // max_position_embeddings (Llama 2048, Mistral 131072, Qwen2 32768), tie_word_embeddings
  // (false), hidden_act (must be silu), attention_bias and mlp_bias (Llama; mlp_bias must be
  // false), rope_scaling (null, default, linear {factor} or llama3 {factor, low_freq_factor,
  // high_freq_factor, original_max_position_embeddings}), sliding_window (Mistral: every layer
  // attends through it; Qwen2 only with use_sliding_window, and then n_ctx_train is capped at it,
  // as its window covers only some layers); a window no shorter than the context has no effect.
  // Mixtral: num_local_experts (8), num_experts_per_tok (2), intermediate_size as each expert's
  // width, top-k renormalised. Qwen2-MoE: num_experts (60), num_experts_per_tok (4),
  // moe_intermediate_size (1408), shared_expert_intermediate_size (5632, sigmoid-gated),
  // norm_topk_prob (false), decoder_sparse_step (1), mlp_only_layers ([]). DeepSeek-V2: q_lora_rank
  // (null: q_proj), kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, n_routed_experts
  // (null: dense), num_experts_per_tok, moe_intermediate_size, n_shared_experts,
  // first_k_dense_replace, moe_layer_freq (1), routed_scaling_factor, topk_method (greedy,
  // group_limited_greedy with n_group, topk_group), scoring_func (softmax); rope_scaling yarn.
  // Throws kestrel::Error("<where>: ...") naming the field and value for an unsupported
  // architecture, a missing required field, a value of the wrong type or out of range, or an
  // unsupported rope_scaling type or hidden_act. hparams.name is left empty for the caller.
  static HfModelConfig from_json(const nlohmann::json& config, const std::string& where);
  // from_json on the parsed file; also throws when it cannot be read or is not JSON.
  static HfModelConfig from_file(const std::string& path);
};

// Divisors of the RoPE frequencies for rope_scaling type "llama3", per pair i of [0, rope_dim/2):
// with inv_freq = theta^(-2i/rope_dim) and wavelen = 2 pi / inv_freq,
//   wavelen < original_max_position_embeddings / high_freq_factor  -> 1 (high frequencies kept),
//   wavelen > original_max_position_embeddings / low_freq_factor   -> factor,
//   otherwise 1 / ((1 - s) / factor + s), s = (original / wavelen - low) / (high - low),
// which is transformers' _compute_llama3_parameters (modeling_rope_utils.py) written as divisors:
// its scaled inv_freq equals inv_freq / divisor. Computed in double. Throws kestrel::Error when
// factor <= 0 or low_freq_factor >= high_freq_factor.
std::vector<float> llama3_rope_freq_factors(int64_t rope_dim, double theta, double factor,
                                            double low_freq_factor, double high_freq_factor,
                                            double original_max_position_embeddings);

// Divisors of the RoPE frequencies for rope_scaling type "yarn" (Peng et al. 2023), per pair i of
// [0, rope_dim/2): the scaled inv_freq blends theta^(-2i/d) (kept) and theta^(-2i/d) / factor
// (interpolated) by a linear ramp between the pair indices whose wavelengths make beta_fast and
// beta_slow turns over original_max_position_embeddings (floored / ceiled when truncate), as
// transformers' _compute_yarn_parameters computes it; divisor = theta^(-2i/d) / scaled inv_freq.
std::vector<float> yarn_rope_freq_factors(int64_t rope_dim, double theta, double factor,
                                          double original_max_position_embeddings, double beta_fast,
                                          double beta_slow, bool truncate);

}  // namespace kestrel
