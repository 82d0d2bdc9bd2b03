#include "model/hf_config.h"

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <numbers>

#include "core/error.h"
#include "io/hf_fields.h"
#include "io/json_text.h"

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
    {"DeepseekV2ForCausalLM", "deepseek_v2", "deepseek2", 2048},
    {"Gemma3ForCausalLM", "gemma3_text", "gemma3", 131072},
};

const ArchInfo& find_arch(const HfFields& c) {
  std::string name;
  const char* field = "architectures";
  if (c.has("architectures")) {
    const json& a = c.at("architectures");
    if (!a.is_array() || a.empty() || !a[0].is_string())
      c.fail("field 'architectures' must be a non-empty array of strings, got " + json_shown(a));
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

double yarn_mscale(double factor, double m) { return factor <= 1 ? 1.0 : 0.1 * m * std::log(factor) + 1.0; }

// rope_scaling type "yarn" (Peng et al. 2023, YaRN), read as transformers'
// _compute_yarn_parameters reads it: with original_max_position_embeddings present the factor is
// max_position_embeddings / original (DeepSeek's convention); the cos/sin attention factor
// (attention_factor, else mscale(factor, mscale) / mscale(factor, mscale_all_dim), else
// mscale(factor)) must be 1, which holds for DeepSeek's configs (mscale == mscale_all_dim). DeepSeek
// also scales the softmax by mscale(factor, mscale_all_dim)^2.
void read_yarn(const HfFields& c, const HfFields& s, HfModelConfig& cfg);

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
  if (!rs.is_object()) c.fail("field '" + std::string(key) + "' must be an object or null, got " + json_shown(rs));
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
  } else if (type == "yarn") {
    read_yarn(c, s, cfg);
  } else {
    s.fail("rope type '" + type + "' is not supported (supported: default, linear, llama3, yarn)");
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
      if (!m.is_array()) c.fail("field 'mlp_only_layers' must be an array of layer indices, got " + json_shown(m));
      for (const json& v : m) {
        if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= hp.n_layer)
          c.fail("field 'mlp_only_layers' holds " + json_shown(v) + ", not a layer index in [0, " +
                 std::to_string(hp.n_layer) + ")");
        moe.dense_layers.push_back(v.get<int64_t>());
      }
    }
  }
  if (moe.routing.n_expert_used > moe.routing.n_expert)
    c.fail("num_experts_per_tok " + std::to_string(moe.routing.n_expert_used) + " exceeds the " +
           std::to_string(moe.routing.n_expert) + " experts");
}

void read_yarn(const HfFields& c, const HfFields& s, HfModelConfig& cfg) {
  ModelHparams& hp = cfg.hparams;
  double factor = positive(s, "factor");
  double original = static_cast<double>(hp.n_ctx_train);
  if (s.has("original_max_position_embeddings")) {
    original = positive(s, "original_max_position_embeddings");
    factor = static_cast<double>(hp.n_ctx_train) / original;
  }
  const double mscale = s.number_or("mscale", 0), mscale_all = s.number_or("mscale_all_dim", 0);
  double attention_factor = yarn_mscale(factor, 1.0);
  if (s.has("attention_factor")) {
    attention_factor = s.number("attention_factor");
  } else if (mscale != 0 && mscale_all != 0) {
    attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all);
  }
  if (std::abs(attention_factor - 1.0) > 1e-6)
    s.fail("a yarn attention factor of " + std::to_string(attention_factor) +
           " is not supported (only 1, as when mscale equals mscale_all_dim)");
  const double beta_fast = s.number_or("beta_fast", 32), beta_slow = s.number_or("beta_slow", 1);
  cfg.rope_freq_factors = yarn_rope_freq_factors(hp.rope_dim, hp.rope_theta, factor, original, beta_fast, beta_slow,
                                                 s.flag_or("truncate", true));
  if (hp.arch == "deepseek2" && mscale_all != 0) {
    const double m = yarn_mscale(factor, mscale_all);
    hp.attn_scale = static_cast<float>(m * m / std::sqrt(static_cast<double>(hp.head_dim)));
  }
  (void)c;
}

// Gemma3TextConfig's fields beyond Llama's: hidden_activation gelu_pytorch_tanh, the softmax scale
// query_pre_attn_scalar^-0.5, sliding_window on the layers layer_types calls sliding_attention
// (or all but every sliding_window_pattern-th), their RoPE base rope_local_base_freq, the
// embedding scale sqrt(hidden_size); no logit soft-capping.
void read_gemma3(const HfFields& c, HfModelConfig& cfg) {
  ModelHparams& hp = cfg.hparams;
  const std::string act = c.string_or("hidden_activation", c.string_or("hidden_act", "gelu_pytorch_tanh"));
  if (act != "gelu_pytorch_tanh")
    c.fail("hidden_activation '" + act + "' is not supported (only gelu_pytorch_tanh)");
  for (const char* key : {"final_logit_softcapping", "attn_logit_softcapping"})
    if (c.has(key)) c.fail("field '" + std::string(key) + "' is not supported (Gemma 3 has none)");
  if (c.has("rope_scaling")) c.fail("rope_scaling on Gemma 3's global layers is not supported yet");
  hp.attn_scale = static_cast<float>(1.0 / std::sqrt(c.number_or("query_pre_attn_scalar", 256)));
  hp.rope_theta_swa = static_cast<float>(c.number_or("rope_local_base_freq", 10000.0));
  hp.embd_scale = std::sqrt(static_cast<float>(hp.n_embd));
  hp.sliding_window = c.get_or("sliding_window", 4096);
  hp.swa_pattern = c.get_or("sliding_window_pattern", 6);
  if (c.has("layer_types")) {
    const json& t = c.at("layer_types");
    if (!t.is_array() || static_cast<int64_t>(t.size()) != hp.n_layer)
      c.fail("field 'layer_types' must list the " + std::to_string(hp.n_layer) + " layers, got " + json_shown(t));
    int64_t pattern = 0;
    for (int64_t l = 0; l < hp.n_layer && pattern == 0; ++l)
      if (t[static_cast<size_t>(l)] == "full_attention") pattern = l + 1;
    for (int64_t l = 0; l < hp.n_layer; ++l) {
      const bool full = pattern > 0 && (l + 1) % pattern == 0;
      if (t[static_cast<size_t>(l)] != (full ? "full_attention" : "sliding_attention"))
        c.fail("field 'layer_types' is not a repeating pattern of sliding_attention layers then one full_attention layer");
    }
    hp.swa_pattern = pattern;
  }
}

// DeepseekV2Config's attention and MoE fields.
void read_deepseek2(const HfFields& c, HfModelConfig& cfg) {
  ModelHparams& hp = cfg.hparams;
  MlaHparams& mla = hp.mla;
  mla.q_lora_rank = c.get_or("q_lora_rank", 0, 0);
  mla.kv_lora_rank = c.get_or("kv_lora_rank", 512);
  mla.qk_nope = c.get_or("qk_nope_head_dim", 128);
  mla.qk_rope = c.get_or("qk_rope_head_dim", 64);
  mla.v_head_dim = c.get_or("v_head_dim", 128);
  if (mla.qk_rope % 2 != 0) c.fail("qk_rope_head_dim " + std::to_string(mla.qk_rope) + " is odd (RoPE rotates pairs)");
  hp.head_dim = mla.qk_nope + mla.qk_rope;
  hp.rope_dim = mla.qk_rope;
  hp.n_head_kv = hp.n_head;  // every head reads the one cached latent
  hp.rope_style = RopeStyle::AdjacentPairs;  // DeepSeek rotates interleaved pairs (x[2i], x[2i+1])
  if (c.flag_or("attention_bias", false)) c.fail("attention_bias true is not supported");
  if (!c.has("n_routed_experts")) return;
  MoeHparams& moe = hp.moe;
  moe.routing.n_expert = static_cast<int32_t>(c.get("n_routed_experts"));
  moe.routing.n_expert_used = static_cast<int32_t>(c.get("num_experts_per_tok"));
  moe.n_ff_expert = c.get_or("moe_intermediate_size", 1407);
  moe.n_ff_shared = c.get_or("n_shared_experts", 0, 0) * moe.n_ff_expert;
  moe.first_dense = c.get_or("first_k_dense_replace", 0, 0);
  if (c.get_or("moe_layer_freq", 1) != 1) c.fail("moe_layer_freq other than 1 is not supported");
  moe.routing.routed_scale = static_cast<float>(c.number_or("routed_scaling_factor", 1.0));
  // DeepSeek-V2's router (transformers DeepseekV2Moe) scales the top-k softmax weights without
  // renormalising them, whatever norm_topk_prob says.
  moe.routing.norm_topk = false;
  const std::string scoring = c.string_or("scoring_func", "softmax");
  if (scoring != "softmax") c.fail("scoring_func '" + scoring + "' is not supported (only softmax)");
  const std::string method = c.string_or("topk_method", "greedy");
  if (method == "group_limited_greedy") {
    moe.routing.select = MoeRouting::Select::GroupLimited;
    moe.routing.n_group = static_cast<int32_t>(c.get("n_group"));
    moe.routing.topk_group = static_cast<int32_t>(c.get("topk_group"));
  } else if (method != "greedy") {
    c.fail("topk_method '" + method + "' is not supported (supported: greedy, group_limited_greedy)");
  }
}

}  // namespace

std::vector<float> yarn_rope_freq_factors(int64_t rope_dim, double theta, double factor, double original_max_position_embeddings,
                                          double beta_fast, double beta_slow, bool truncate) {
  if (!(factor > 0)) throw Error("yarn rope scaling: factor must be positive, got " + std::to_string(factor));
  const double d = static_cast<double>(rope_dim);
  // The pair index whose wavelength makes `rotations` turns over the original context.
  auto correction_dim = [&](double rotations) {
    return d * std::log(original_max_position_embeddings / (rotations * 2 * std::numbers::pi)) / (2 * std::log(theta));
  };
  double low = correction_dim(beta_fast), high = correction_dim(beta_slow);
  if (truncate) low = std::floor(low), high = std::ceil(high);
  low = std::max(low, 0.0);
  high = std::min(high, d - 1);
  if (low == high) high += 0.001;
  std::vector<float> out(static_cast<size_t>(rope_dim / 2));
  for (int64_t i = 0; i < rope_dim / 2; ++i) {
    const double extrapolation = std::pow(theta, -2.0 * static_cast<double>(i) / d);
    const double ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
    const double keep = 1 - ramp;  // the share of the unscaled frequency
    const double inv_freq = extrapolation / factor * (1 - keep) + extrapolation * keep;
    out[static_cast<size_t>(i)] = static_cast<float>(extrapolation / inv_freq);
  }
  return out;
}

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

  if (hp.arch == "gemma3") {
    read_gemma3(c, cfg);
  } else {
    const std::string act = c.string_or("hidden_act", "silu");
    if (act != "silu") c.fail("hidden_act '" + act + "' is not supported (only silu)");
  }
  cfg.tie_word_embeddings = c.flag_or("tie_word_embeddings", hp.arch == "gemma3");  // Gemma3TextConfig ties by default
  cfg.torch_dtype = c.string_or("torch_dtype", "");
  cfg.quant = QuantConfig::from_json(config, where);
  if (hp.arch == "qwen2" || hp.arch == "qwen2moe") {
    cfg.qkv_bias = true;  // Qwen2Attention, Qwen2MoeAttention: q/k/v_proj with bias, o_proj without
  } else if (hp.arch == "llama") {
    cfg.qkv_bias = cfg.o_bias = c.flag_or("attention_bias", false);  // LlamaAttention: all four
    if (c.flag_or("mlp_bias", false)) c.fail("mlp_bias true is not supported (no MLP biases)");
  }
  if (hp.arch == "deepseek2") read_deepseek2(c, cfg);
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
