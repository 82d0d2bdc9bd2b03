// What a model needs in memory, read from its files without touching any weight data: the shape
// of its KV cache, its training context and the bytes of its weights. Input of the KV planner
// (memory/kv_planner.h) and of `kestrel plan`.
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>

namespace kestrel {

class GgufFile;

enum class WeightSource {
  GgufTensors,       // sum of the tensor data sizes in the GGUF tensor infos
  SafetensorsFiles,  // sum of the sizes of the *.safetensors files beside config.json
  ConfigEstimate,    // parameter count from config.json x bytes of its torch_dtype
};

struct ModelFootprint {
  std::string path;    // the GGUF file or the config.json
  std::string format;  // "gguf" or "hf"
  std::string arch;    // general.architecture or model_type; "" when the config has none
  int64_t n_layer = 0;
  int64_t n_head_kv = 0;     // 0 for MLA
  int64_t head_dim = 0;      // 0 for MLA
  int64_t kv_lora_rank = 0;  // > 0: multi-head latent attention (DeepSeek-V2)
  int64_t rope_dim = 0;      // MLA only: the decoupled RoPE key's width
  int64_t n_ctx_train = 0;   // training context in tokens; 0 when the file does not say
  int64_t weight_bytes = 0;
  WeightSource weight_source = WeightSource::GgufTensors;
  int64_t n_weight_items = 0;  // tensors (GGUF) or *.safetensors files summed
  int64_t n_params = 0;        // ConfigEstimate only
  std::string weight_dtype;    // ConfigEstimate only: the torch_dtype the estimate used

  // From the GGUF header: `<arch>.block_count`, `<arch>.attention.head_count_kv` (default
  // head_count), `<arch>.attention.key_length` (default embedding_length / head_count),
  // `<arch>.context_length`; MLA when `<arch>.attention.kv_lora_rank` is present, with
  // `<arch>.rope.dimension_count`. Reads only the header pages of the mapping. Throws
  // kestrel::Error naming the key when a needed key is missing or out of range.
  static ModelFootprint from_gguf(const GgufFile& file);

  // From a Hugging Face config.json (or a folder holding one): num_hidden_layers, num_key_value_heads (default
  // num_attention_heads), head_dim (default hidden_size / num_attention_heads),
  // max_position_embeddings; MLA when kv_lora_rank is present, with qk_rope_head_dim. Weights:
  // the *.safetensors files in the config's folder, else hf_parameter_count x torch_dtype bytes.
  // Throws kestrel::Error("<path>: ...") for a missing file, invalid JSON, or a missing or
  // non-positive field (named).
  static ModelFootprint from_hf_config(const std::string& path);
};

// Parameters of a decoder-only transformer from its HF config: embeddings and output head (one
// matrix when tie_word_embeddings), per layer the attention (q, k, v, o and their biases when
// attention_bias or model_type qwen2; MLA's low-rank projections and norms for DeepSeek-V2), the
// gated MLP (3 x hidden x intermediate) or routed experts (num_local_experts / n_routed_experts /
// num_experts, moe_intermediate_size, n_shared_experts, first_k_dense_replace dense layers) with
// a router, two RMSNorms; and the final norm. Exact for LLaMA-2-7B (6,738,415,616), Mixtral-8x7B
// and Qwen2.5-0.5B; an estimate for anything else. Throws kestrel::Error("<where>: ...") naming a
// missing field, or on overflow.
int64_t hf_parameter_count(const nlohmann::json& config, const std::string& where);

}  // namespace kestrel
