#include "model/quant_config.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <cctype>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/hf_fields.h"
#include "io/json_text.h"

namespace kestrel {
namespace {

using nlohmann::json;

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

// A list of module names (null or absent: empty).
void read_names(const HfFields& q, const char* key, std::vector<std::string>& out) {
  if (!q.has(key)) return;
  const json& v = q.at(key);
  if (!v.is_array()) q.fail("field '" + std::string(key) + "' must be a list of module names, got " + json_shown(v));
  for (const json& e : v) {
    if (!e.is_string()) q.fail("field '" + std::string(key) + "' holds " + json_shown(e) + ", not a module name");
    out.push_back(e.get<std::string>());
  }
}

// Required, as vLLM requires it: a default would guess the layout the scale and zero shapes depend on.
int64_t group_size(const HfFields& q, const char* key) {
  if (!q.has(key)) q.fail("missing field '" + std::string(key) + "' (inputs per scale group, or -1 for one group per row)");
  const int64_t g = q.get_or(key, -1, -1);
  if (g == 0) q.fail("field '" + std::string(key) + "' must be positive or -1, got 0");
  return g;
}

void read_gptq(const HfFields& q, QuantConfig& c) {
  // GPTQModel writes "checkpoint_format"; AutoGPTQ's older "is_marlin_format" marks Marlin repacking.
  const std::string format = q.string_or("checkpoint_format", "gptq");
  if (format != "gptq")
    q.fail("checkpoint_format '" + format + "' is not supported (only gptq: the v1 layout with zeros stored minus one)");
  if (q.flag_or("is_marlin_format", false)) q.fail("is_marlin_format true is not supported (only the gptq v1 layout)");
  c.bits = static_cast<int32_t>(q.get("bits"));
  if (c.bits != 4 && c.bits != 8) q.fail("bits " + std::to_string(c.bits) + " is not supported (4 or 8)");
  c.group_size = group_size(q, "group_size");
  c.desc_act = q.flag_or("desc_act", false);
  c.sym = q.flag_or("sym", true);
  c.lm_head = q.flag_or("lm_head", false);
  read_names(q, "modules_to_not_convert", c.not_converted);
}

void read_awq(const HfFields& q, QuantConfig& c) {
  const std::string version = lower(q.string_or("version", "gemm"));
  if (version != "gemm") q.fail("AWQ version '" + version + "' is not supported (only gemm: AutoAWQ WQLinear_GEMM)");
  c.bits = static_cast<int32_t>(q.has("bits") ? q.get("bits") : q.get("w_bit"));
  if (c.bits != 4) q.fail("bits " + std::to_string(c.bits) + " is not supported (AWQ GEMM packs 4-bit values)");
  c.group_size = group_size(q, q.has("group_size") ? "group_size" : "q_group_size");
  if (!q.flag_or("zero_point", true)) q.fail("zero_point false is not supported (AWQ GEMM stores zeros)");
  read_names(q, "modules_to_not_convert", c.not_converted);
}

void read_block(const HfFields& q, const char* key, QuantConfig& c) {
  const json& b = q.at(key);
  // At most HfFields::kMaxDim each, so that ceil(N / block) cannot overflow.
  if (!b.is_array() || b.size() != 2 || !b[0].is_number_integer() || !b[1].is_number_integer() ||
      b[0].get<int64_t>() <= 0 || b[1].get<int64_t>() <= 0 || b[0].get<int64_t>() > HfFields::kMaxDim ||
      b[1].get<int64_t>() > HfFields::kMaxDim)
    q.fail("field '" + std::string(key) + "' must be [rows, columns] of two integers in [1, " +
           std::to_string(HfFields::kMaxDim) + "], got " + json_shown(b));
  c.block_n = b[0].get<int64_t>();
  c.block_k = b[1].get<int64_t>();
}

void read_fp8(const HfFields& q, QuantConfig& c) {
  const std::string fmt = q.string_or("fmt", "e4m3");
  if (fmt != "e4m3") q.fail("fmt '" + fmt + "' is not supported (only e4m3: float8_e4m3fn weights)");
  const std::string act = q.string_or("activation_scheme", "dynamic");
  if (act != "dynamic") q.fail("activation_scheme '" + act + "' is not supported (only dynamic: no input scales)");
  if (q.has("weight_block_size")) {
    read_block(q, "weight_block_size", c);
    c.block_scale_inv = true;
  }
  read_names(q, "modules_to_not_convert", c.not_converted);
  read_names(q, "ignored_layers", c.not_converted);
}

void read_compressed_tensors(const HfFields& q, QuantConfig& c) {
  const std::string format = q.string_or("format", "");
  if (format != "float-quantized")
    q.fail("compressed-tensors format '" + format + "' is not supported (only float-quantized: FP8 weights)");
  if (!q.has("config_groups") || !q.at("config_groups").is_object() || q.at("config_groups").empty())
    q.fail("field 'config_groups' must be an object of quantization schemes");
  bool first = true;
  for (const auto& [name, group] : q.at("config_groups").items()) {
    const HfFields g(group, q.where() + ": config_groups." + name);
    if (!g.has("weights") || !g.at("weights").is_object()) g.fail("missing object 'weights'");
    const HfFields w(g.at("weights"), g.where() + ".weights");
    const std::string type = w.string_or("type", "");
    if (type != "float" || w.get("num_bits") != 8)
      w.fail("weights of type '" + type + "' and num_bits " + std::to_string(w.get_or("num_bits", 0, 0)) +
             " are not supported (only type float, num_bits 8: float8_e4m3fn)");
    if (!w.flag_or("symmetric", true)) w.fail("symmetric false is not supported");
    if (w.flag_or("dynamic", false)) w.fail("dynamic weight scales are not supported");
    const std::string strategy = w.string_or("strategy", "tensor");
    QuantConfig s;
    if (strategy == "block") {
      if (!w.has("block_structure")) w.fail("strategy block without block_structure");
      read_block(w, "block_structure", s);
    } else if (strategy != "tensor" && strategy != "channel") {
      w.fail("strategy '" + strategy + "' is not supported (tensor, channel or block)");
    }
    if (!first && (s.block_n != c.block_n || s.block_k != c.block_k))
      g.fail("weight schemes of the config groups differ (one scheme for all is supported)");
    c.block_n = s.block_n, c.block_k = s.block_k, first = false;
    if (g.has("input_activations") && g.at("input_activations").is_object()) {
      const HfFields a(g.at("input_activations"), g.where() + ".input_activations");
      if (!a.flag_or("dynamic", false))
        a.fail("static input activation scales are not supported (only dynamic: per-token scales made at run time)");
    }
  }
  read_names(q, "ignore", c.not_converted);
}

}  // namespace

std::string_view quant_method_name(QuantMethod m) {
  switch (m) {
    case QuantMethod::None: return "none";
    case QuantMethod::Gptq: return "gptq";
    case QuantMethod::Awq: return "awq";
    case QuantMethod::Fp8: return "fp8";
  }
  return "?";
}

Quantization parse_quantization(std::string_view name) {
  if (name == "auto") return Quantization::Auto;
  if (name == "none") return Quantization::None;
  if (name == "fp8" || name == "compressed-tensors") return Quantization::Fp8;
  if (name == "awq") return Quantization::Awq;
  if (name == "gptq") return Quantization::Gptq;
  if (name == "rtn") return Quantization::Rtn;
  throw Error("unknown quantization '" + std::string(name) + "' (supported: auto, none, fp8, awq, gptq, rtn)");
}

struct QuantConfig::Pattern {
  pcre2_code* code = nullptr;
  std::string text;
  ~Pattern() { pcre2_code_free(code); }
};

namespace {

// A "re:" entry's expression, compiled to match a whole module name. Throws kestrel::Error with
// PCRE2's message (which also refuses nesting past its parenthesis limit of 250).
std::shared_ptr<const QuantConfig::Pattern> compile_pattern(const std::string& expr) {
  int err = 0;
  PCRE2_SIZE off = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(expr.data()), expr.size(),
                                   PCRE2_ANCHORED | PCRE2_ENDANCHORED, &err, &off, nullptr);
  if (code == nullptr) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof msg);
    throw Error("a 're:' entry of the ignore list is not a valid regular expression (at offset " +
                std::to_string(off) + ": " + reinterpret_cast<const char*>(msg) + ")");
  }
  auto p = std::make_shared<QuantConfig::Pattern>();
  p->code = code;
  p->text = expr.size() > 64 ? expr.substr(0, 64) + "..." : expr;
  return p;
}

// Whether `p` matches all of `subject`, within PCRE2 match and depth limits (a module name is
// short: a pattern that needs more steps backtracks catastrophically).
bool pattern_matches(const QuantConfig::Pattern& p, const std::string& subject) {
  pcre2_match_context* ctx = pcre2_match_context_create(nullptr);
  pcre2_match_data* md = pcre2_match_data_create_from_pattern(p.code, nullptr);
  if (ctx == nullptr || md == nullptr) {
    pcre2_match_context_free(ctx);
    pcre2_match_data_free(md);
    throw Error("out of memory matching an ignore pattern");
  }
  pcre2_set_match_limit(ctx, 100000);
  pcre2_set_depth_limit(ctx, 1000);
  const int rc = pcre2_match(p.code, reinterpret_cast<PCRE2_SPTR>(subject.data()), subject.size(), 0, 0, md, ctx);
  pcre2_match_data_free(md);
  pcre2_match_context_free(ctx);
  if (rc == PCRE2_ERROR_MATCHLIMIT || rc == PCRE2_ERROR_DEPTHLIMIT)
    throw Error("the ignore pattern 're:" + p.text + "' backtracks past PCRE2's limits matching '" + subject +
                "'; simplify it");
  return rc >= 0;
}

}  // namespace

bool QuantConfig::is_not_converted(const std::string& prefix) const {
  for (size_t i = 0; i < not_converted.size(); ++i) {
    const std::string& e = not_converted[i];
    if (e.starts_with("re:")) {
      const bool compiled = i < not_converted_re.size() && not_converted_re[i] != nullptr;
      if (pattern_matches(compiled ? *not_converted_re[i] : *compile_pattern(e.substr(3)), prefix)) return true;
    } else if (!e.empty()) {
      // Whole dotted components: "mlp.gate" names model.layers.0.mlp.gate, not mlp.gate_proj.
      const std::string dotted = "." + prefix + ".";
      if (dotted.find("." + e + ".") != std::string::npos) return true;
    }
  }
  return false;
}

QuantConfig QuantConfig::from_json(const json& config, const std::string& where) {
  QuantConfig c;
  if (!config.is_object() || !config.contains("quantization_config") || config["quantization_config"].is_null())
    return c;
  const json& qc = config["quantization_config"];
  const HfFields q(qc, where + ": quantization_config");
  if (!qc.is_object()) q.fail("must be an object, got " + json_shown(qc));
  c.quant_method = q.string_or("quant_method", "");
  if (c.quant_method == "gptq") {
    c.method = QuantMethod::Gptq;
    read_gptq(q, c);
  } else if (c.quant_method == "awq") {
    c.method = QuantMethod::Awq;
    read_awq(q, c);
  } else if (c.quant_method == "fp8") {
    c.method = QuantMethod::Fp8;
    read_fp8(q, c);
  } else if (c.quant_method == "compressed-tensors") {
    c.method = QuantMethod::Fp8;
    read_compressed_tensors(q, c);
  } else {
    q.fail("quant_method '" + c.quant_method + "' is not supported (supported: gptq, awq, fp8, compressed-tensors)");
  }
  try {
    for (const std::string& e : c.not_converted)
      c.not_converted_re.push_back(e.starts_with("re:") ? compile_pattern(e.substr(3)) : nullptr);
  } catch (const Error& e) {
    q.fail(e.what());
  }
  return c;
}

QuantConfig resolve_quantization(Quantization requested, const QuantConfig& checkpoint, const std::string& where) {
  if (requested == Quantization::Auto) return checkpoint;
  if (requested == Quantization::Rtn)
    throw Error(where + ": --quantization rtn (round-to-nearest INT4 at load) applies to GGUF files; a Hugging Face "
                        "checkpoint takes auto, none, fp8, awq or gptq");
  const QuantMethod want = requested == Quantization::None ? QuantMethod::None
                           : requested == Quantization::Fp8 ? QuantMethod::Fp8
                           : requested == Quantization::Awq ? QuantMethod::Awq
                                                            : QuantMethod::Gptq;
  if (want == checkpoint.method) return checkpoint;
  // Float weights quantized to FP8 at load, by the backend (LlamaModel::online_fp8): the
  // checkpoint itself is read as it is.
  if (!checkpoint.quantized() && want == QuantMethod::Fp8) return checkpoint;
  const std::string has = checkpoint.quantized()
                              ? "is quantized with " + std::string(quant_method_name(checkpoint.method)) +
                                    " (config.json quantization_config.quant_method '" + checkpoint.quant_method + "')"
                              : "is not quantized (config.json has no quantization_config)";
  throw Error(where + ": --quantization " + std::string(quant_method_name(want)) + " disagrees with the checkpoint, which " +
              has + "; use --quantization auto");
}

}  // namespace kestrel
