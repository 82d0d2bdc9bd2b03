#include "spec/speculative_config.h"

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/json_text.h"
#include "model/quant_config.h"

namespace kestrel {

namespace {

int32_t int_field(const nlohmann::json& j, const char* name, int64_t lo, int64_t hi) {
  const nlohmann::json& v = j.at(name);
  if (!v.is_number_integer())
    throw Error(std::string("speculative config: \"") + name + "\" must be an integer, got " + json_shown(v));
  const int64_t x = v.get<int64_t>();
  if (x < lo || x > hi)
    throw Error(std::string("speculative config: \"") + name + "\" must be in [" + std::to_string(lo) + ", " +
                std::to_string(hi) + "], got " + std::to_string(x));
  return static_cast<int32_t>(x);
}

}  // namespace

std::string_view spec_method_name(SpecMethod method) {
  switch (method) {
    case SpecMethod::Ngram: return "ngram";
    case SpecMethod::DraftModel: return "draft_model";
    case SpecMethod::None: break;
  }
  return "none";
}

SpeculativeConfig parse_speculative_config(std::string_view json) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(json);
  } catch (const nlohmann::json::parse_error& e) {
    throw Error(std::string("speculative config: not valid JSON: ") + e.what());
  }
  if (!j.is_object()) throw Error("speculative config: must be a JSON object, got " + json_shown(j));
  static constexpr const char* kFields[] = {"method", "num_speculative_tokens", "prompt_lookup_min",
                                            "prompt_lookup_max", "disable_by_batch_size", "model", "quantization",
                                            "draft_length"};
  for (const auto& [key, value] : j.items()) {
    bool known = false;
    for (const char* f : kFields) known |= key == f;
    if (!known)
      throw Error("speculative config: unknown field \"" + key +
                  "\" (known: method, num_speculative_tokens, prompt_lookup_min, prompt_lookup_max, "
                  "disable_by_batch_size, model, quantization, draft_length)");
  }
  SpeculativeConfig c;
  const bool has_lookup = j.contains("prompt_lookup_min") || j.contains("prompt_lookup_max");
  if (j.contains("model")) {
    if (!j["model"].is_string() || j["model"].get<std::string>().empty())
      throw Error("speculative config: \"model\" must be a non-empty path, got " + json_shown(j["model"]));
    c.model = j["model"].get<std::string>();
  }
  if (j.contains("quantization")) {
    const nlohmann::json& q = j["quantization"];
    if (!q.is_string()) throw Error("speculative config: \"quantization\" must be a string, got " + json_shown(q));
    c.quantization = q.get<std::string>();
    try {
      parse_quantization(c.quantization);
    } catch (const Error& e) {
      throw Error(std::string("speculative config: \"quantization\": ") + e.what());
    }
  }
  if (j.contains("method")) {
    const nlohmann::json& m = j["method"];
    const std::string name = m.is_string() ? m.get<std::string>() : "";
    if (name == "ngram") c.method = SpecMethod::Ngram;
    else if (name == "draft_model") c.method = SpecMethod::DraftModel;
    else throw Error("speculative config: \"method\" must be \"ngram\" or \"draft_model\", got " + json_shown(m));
  } else if (!c.model.empty()) {
    c.method = SpecMethod::DraftModel;
  } else if (has_lookup) {
    c.method = SpecMethod::Ngram;
  } else {
    throw Error("speculative config: \"method\" is missing (\"ngram\" or \"draft_model\")");
  }
  if (c.method == SpecMethod::DraftModel && c.model.empty())
    throw Error("speculative config: \"method\": \"draft_model\" needs \"model\" (the draft model's path)");
  if (c.method == SpecMethod::Ngram && j.contains("quantization"))
    throw Error("speculative config: \"quantization\" is for \"method\": \"draft_model\"; ngram drafts need no model");
  if (c.method == SpecMethod::Ngram && !c.model.empty())
    throw Error("speculative config: \"model\" is for \"method\": \"draft_model\"; ngram drafts need no model");
  if (!j.contains("num_speculative_tokens"))
    throw Error("speculative config: \"num_speculative_tokens\" is missing (draft tokens per step, 1.." +
                std::to_string(kMaxSpeculativeTokens) + ")");
  c.num_speculative_tokens = int_field(j, "num_speculative_tokens", 1, kMaxSpeculativeTokens);
  constexpr int64_t kMaxLookup = 1024;
  if (j.contains("prompt_lookup_min")) c.prompt_lookup_min = int_field(j, "prompt_lookup_min", 1, kMaxLookup);
  if (j.contains("prompt_lookup_max")) c.prompt_lookup_max = int_field(j, "prompt_lookup_max", 1, kMaxLookup);
  if (j.contains("prompt_lookup_min") != j.contains("prompt_lookup_max")) {
    if (j.contains("prompt_lookup_min")) c.prompt_lookup_max = c.prompt_lookup_min;
    else c.prompt_lookup_min = c.prompt_lookup_max;
  }
  if (c.prompt_lookup_max < c.prompt_lookup_min)
    throw Error("speculative config: \"prompt_lookup_max\" " + std::to_string(c.prompt_lookup_max) +
                " must be >= \"prompt_lookup_min\" " + std::to_string(c.prompt_lookup_min));
  if (has_lookup && c.method != SpecMethod::Ngram)
    throw Error("speculative config: \"prompt_lookup_min\" and \"prompt_lookup_max\" are for \"method\": \"ngram\"");
  if (j.contains("draft_length")) {
    const nlohmann::json& d = j["draft_length"];
    const std::string v = d.is_string() ? d.get<std::string>() : "";
    if (v != "adaptive" && v != "fixed")
      throw Error("speculative config: \"draft_length\" must be \"adaptive\" or \"fixed\", got " + json_shown(d));
    if (c.method != SpecMethod::Ngram)
      throw Error("speculative config: \"draft_length\" is for \"method\": \"ngram\"");
    c.adaptive_draft_length = v == "adaptive";
  }
  if (j.contains("disable_by_batch_size"))
    c.disable_by_batch_size = int_field(j, "disable_by_batch_size", 0, int64_t{1} << 30);
  return c;
}

}  // namespace kestrel
