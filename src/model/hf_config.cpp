#include "model/hf_config.h"

#include <cmath>
#include <nlohmann/json.hpp>
#include <numbers>

#include "core/error.h"
#include "io/hf_fields.h"

namespace kestrel {
namespace {

using nlohmann::json;

struct ArchInfo {
  const char* hf_name;       // config "architectures" entry
  const char* model_type;    // config "model_type"
  const char* arch;          // ModelHparams::arch (GGUF naming)
  int64_t default_max_pos;   // the config class's max_position_embeddings default
};
constexpr ArchInfo kArchs[] = {
    {"LlamaForCausalLM", "llama", "llama", 2048},
    {"MistralForCausalLM", "mistral", "mistral", 4096 * 32},
    {"Qwen2ForCausalLM", "qwen2", "qwen2", 32768},
    {"MixtralForCausalLM", "mixtral", "mixtral", 4096 * 32},
    {"Qwen2MoeForCausalLM", "qwen2_moe", "qwen2moe", 32768},
};

const ArchInfo& find_arch(const HfFields& c) {
  std::string name;
  const char* field = "architectures";
  if (c.has("architectures")) {
    const json& a = c.at("architectures");
    if (!a.is_array() || a.empty() || !a[0].is_string())
      c.fail("field 'architectures' must be a non-empty array of strings, got " + a.dump());
    name = a[0].get<std::string>();
    for (const ArchInfo& i : kArchs)
      if (name == i.hf_name) return i;
  } else {
    field = "model_type";
    name = c.string_or("model_type", "");
    if (name.empty()) c.fail("missing field 'architectures' (and 'model_type')");
    for (const ArchInfo& i : kArchs)
      if (name == i.model_type) return i;
  }
  std::string supported;
  for (const ArchInfo& i : kArchs) supported += (supported.empty() ? "" : ", ") + std::string(i.hf_name);
  c.fail(std::string("unsupported ") + field + " '" + name + "' (supported: " + supported + ")");
}

// A positive finite number of rope_scaling.
double positive(const HfFields& s, const char* key) {
  const double v = s.number(key);
  if (!(v > 0)) s.fail("field '" + std::string(key) + "' must be positive, got " + std::to_string(v));
  return v;
}

void read_rope_scaling(const HfFields& c, HfModelConfig& cfg) {
  // transformers 5 writes one "rope_parameters" object (rope_theta, rope_type and the scaling
  // fields) where earlier versions wrote "rope_theta" and "rope_scaling".
  const char* key = c.has("rope_scaling") ? "rope_scaling" : "rope_parameters";
  if (!c.has(key)) return;
  const json& rs = c.at(key);
  if (!rs.is_object()) c.fail("field '" + std::string(key) + "' must be an object or null, got " + rs.dump());
  const HfFields s(rs, c.where() + ": " + key);
  if (!s.has("rope_type") && !s.has("type")) return;
  // transformers renamed "type" to "rope_type"; configs carry either.
  const std::string type = s.has("rope_type") ? s.string_or("rope_type", "") : s.string_or("type", "");
  ModelHparams& hp = cfg.hparams;
  if (type == "default") return;
  if (type == "linear") {
    hp.rope_linear_scale = static_cast<float>(positive(s, "factor"));
  } else if (type == "llama3") {
    const double factor = positive(s, "factor"), low = positive(s, "low_freq_factor"),
                 high = positive(s, "high_freq_factor"), original = positive(s, "original_max_position_embeddings");
    if (!(low < high))
      s.fail("low_freq_factor " + std::to_string(low) + " must be below high_freq_factor " + std::to_string(high));
    cfg.rope_freq_factors = llama3_rope_freq_factors(hp.rope_dim, hp.rope_theta, factor, low, high, original);
  } else {
    s.fail("rope type '" + type + "' is not supported (supported: default, linear, llama3)");
  }
}

// The MoE fields of MixtralConfig and Qwen2MoeConfig (transformers' defaults where a field is absent).
void read_moe(const HfFields& c, HfModelConfig& cfg) {
  ModelHparams& hp = cfg.hparams;
  MoeHparams& moe = hp.moe;
  if (hp.arch == "mixtral") {
    moe.routing.n_expert = static_cast<int32_t>(c.get_or("num_local_experts", 8));
    moe.routing.n_expert_used = static_cast<int32_t>(c.get_or("num_experts_per_tok", 2));
    moe.routing.norm_topk = true;  // MixtralTopKRouter renormalises the top-k weights
    moe.n_ff_expert = hp.n_ff;     // intermediate_size is each expert's width
  } else {  // qwen2moe
    moe.routing.n_expert = static_cast<int32_t>(c.get_or("num_experts", 60));
    moe.routing.n_expert_used = static_cast<int32_t>(c.get_or("num_experts_per_tok", 4));
    moe.routing.norm_topk = c.flag_or("norm_topk_prob", false);
    moe.n_ff_expert = c.get_or("moe_intermediate_size", 1408);
    moe.n_ff_shared = c.get_or("shared_expert_intermediate_size", 5632, 0);
    moe.shared_gate = moe.n_ff_shared > 0;  // Qwen2MoeSparseMoeBlock: sigmoid(shared_expert_gate(x))
    moe.sparse_step = c.get_or("decoder_sparse_step", 1);
    if (c.has("mlp_only_layers")) {
      const json& m = c.at("mlp_only_layers");
      if (!m.is_array()) c.fail("field 'mlp_only_layers' must be an array of layer indices, got " + m.dump());
      for (const json& v : m) {
        if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= hp.n_layer)
          c.fail("field 'mlp_only_layers' holds " + v.dump() + ", not a layer index in [0, " +
                 std::to_string(hp.n_layer) + ")");
        moe.dense_layers.push_back(v.get<int64_t>());
      }
    }
  }
  if (moe.routing.n_expert_used > moe.routing.n_expert)
    c.fail("num_experts_per_tok " + std::to_string(moe.routing.n_expert_used) + " exceeds the " +
           std::to_string(moe.routing.n_expert) + " experts");
}

}  // namespace

std::vector<float> llama3_rope_freq_factors(int64_t rope_dim, double theta, double factor,
                                            double low_freq_factor, double high_freq_factor,
                                            double original_max_position_embeddings) {
  if (!(factor > 0)) throw Error("llama3 rope scaling: factor must be positive, got " + std::to_string(factor));
  if (!(low_freq_factor < high_freq_factor))
    throw Error("llama3 rope scaling: low_freq_factor " + std::to_string(low_freq_factor) +
                " must be below high_freq_factor " + std::to_string(high_freq_factor));
  const double low_freq_wavelen = original_max_position_embeddings / low_freq_factor;
  const double high_freq_wavelen = original_max_position_embeddings / high_freq_factor;
  std::vector<float> out(static_cast<size_t>(rope_dim / 2));
  for (int64_t i = 0; i < rope_dim / 2; ++i) {
    const double inv_freq = std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(rope_dim));
    const double wavelen = 2 * std::numbers::pi / inv_freq;
    double divisor = 1.0;
    if (wavelen > low_freq_wavelen) {
      divisor = factor;
    } else if (wavelen >= high_freq_wavelen) {
      const double smooth = (original_max_position_embeddings / wavelen - low_freq_factor) /
                            (high_freq_factor - low_freq_factor);
      divisor = 1.0 / ((1.0 - smooth) / factor + smooth);
    }
    out[static_cast<size_t>(i)] = static_cast<float>(divisor);
  }
  return out;
}

HfModelConfig HfModelConfig::from_json(const json& config, const std::string& where) {
  const HfFields c(config, where);
  if (!config.is_object()) c.fail("expected a JSON object, got " + std::string(config.type_name()));
  const ArchInfo& arch = find_arch(c);
  HfModelConfig cfg;
  ModelHparams& hp = cfg.hparams;
  hp.arch = arch.arch;
  hp.rope_style = RopeStyle::RotateHalf;  // HF keeps q/k rows unpermuted: rotate x[i] with x[i + d/2]
  hp.n_embd = c.get("hidden_size");
  hp.n_ff = c.get("intermediate_size");
  hp.n_layer = c.get("num_hidden_layers");
  hp.n_head = c.get("num_attention_heads");
  hp.n_head_kv = c.get_or("num_key_value_heads", hp.n_head);
  if (hp.n_head % hp.n_head_kv != 0)
    c.fail("num_key_value_heads " + std::to_string(hp.n_head_kv) + " does not divide num_attention_heads " +
           std::to_string(hp.n_head));
  if (c.has("head_dim")) {
    hp.head_dim = c.get("head_dim");
  } else {
    if (hp.n_embd % hp.n_head != 0)
      c.fail("hidden_size " + std::to_string(hp.n_embd) + " is not a multiple of num_attention_heads " +
             std::to_string(hp.n_head) + " (and there is no head_dim)");
    hp.head_dim = hp.n_embd / hp.n_head;
  }
  if (hp.head_dim % 2 != 0) c.fail("head dimension " + std::to_string(hp.head_dim) + " is odd (RoPE rotates pairs)");
  hp.rope_dim = hp.head_dim;
  hp.n_vocab = c.get("vocab_size");
  hp.n_ctx_train = c.get_or("max_position_embeddings", arch.default_max_pos);
  const double eps = c.number_or("rms_norm_eps", 1e-6);
  if (!(eps > 0)) c.fail("field 'rms_norm_eps' must be positive, got " + std::to_string(eps));
  hp.rms_eps = static_cast<float>(eps);
  double theta = c.number_or("rope_theta", 10000.0);
  if (!c.has("rope_theta") && c.has("rope_parameters") && c.at("rope_parameters").is_object())
    theta = HfFields(c.at("rope_parameters"), c.where() + ": rope_parameters").number_or("rope_theta", 10000.0);
  if (!(theta > 0)) c.fail("field 'rope_theta' must be positive, got " + std::to_string(theta));
  hp.rope_theta = static_cast<float>(theta);

  const std::string act = c.string_or("hidden_act", "silu");
  if (act != "silu") c.fail("hidden_act '" + act + "' is not supported (only silu)");
  cfg.tie_word_embeddings = c.flag_or("tie_word_embeddings", false);
  cfg.torch_dtype = c.string_or("torch_dtype", "");
  if (hp.arch == "qwen2" || hp.arch == "qwen2moe") {
    cfg.qkv_bias = true;  // Qwen2Attention, Qwen2MoeAttention: q/k/v_proj with bias, o_proj without
  } else if (hp.arch == "llama") {
    cfg.qkv_bias = cfg.o_bias = c.flag_or("attention_bias", false);  // LlamaAttention: all four
    if (c.flag_or("mlp_bias", false)) c.fail("mlp_bias true is not supported (no MLP biases)");
  }
  read_rope_scaling(c, cfg);
  if (hp.arch == "mixtral" || hp.arch == "qwen2moe") read_moe(c, cfg);

  // Mistral attends through its sliding window in every layer. Qwen2 with use_sliding_window
  // windows only the layers from max_window_layers on, which one window for all layers cannot
  // say: its context is capped at the window instead, where windowed and full attention agree.
  const bool windowed = hp.arch == "mistral" || hp.arch == "mixtral" ||
                        ((hp.arch == "qwen2" || hp.arch == "qwen2moe") && c.flag_or("use_sliding_window", false));
  if (windowed && c.has("sliding_window")) {
    const int64_t window = c.get("sliding_window");
    if (window < hp.n_ctx_train) {
      hp.sliding_window = window;
      if (hp.arch == "qwen2" || hp.arch == "qwen2moe") hp.n_ctx_train = window;
    }
  }
  try {
    hp.validate();
  } catch (const Error& e) {
    c.fail(e.what());
  }
  return cfg;
}

HfModelConfig HfModelConfig::from_file(const std::string& path) { return from_json(read_json_file(path), path); }

}  // namespace kestrel
