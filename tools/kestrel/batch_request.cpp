#include "batch_request.h"

#include <cmath>
#include <limits>

#include "core/error.h"

namespace kestrel::cli {

namespace {
using json = Json;

// Fields that are read, plus OpenAI fields a batch file often carries that change nothing here.
bool is_known_field(const std::string& key) {
  static const char* const kKnown[] = {
      "id",          "prompt",     "messages", "max_tokens",       "max_completion_tokens",
      "temperature", "top_p",      "top_k",    "min_p",            "seed",
      "stop",        "ignore_eos", "n",        "presence_penalty", "frequency_penalty",
      "repetition_penalty", "logit_bias", "model", "user"};
  for (const char* k : kKnown)
    if (key == k) return true;
  return false;
}

// The value as it was written, short enough for a message (cut at a UTF-8 character boundary).
std::string shown(const json& v) {
  std::string s = v.dump(-1, ' ', false, json::error_handler_t::replace);
  constexpr size_t kMax = 60;
  if (s.size() > kMax) {
    size_t n = kMax - 3;
    while (n > 0 && (static_cast<unsigned char>(s[n]) & 0xC0) == 0x80) --n;
    s = s.substr(0, n) + "...";
  }
  return s;
}

[[noreturn]] void bad(const std::string& field, const std::string& rule, const json& v) {
  throw Error(field + " " + rule + ", got " + shown(v));
}

// A JSON number as double; bools are not numbers.
double number(const std::string& field, const json& v) {
  if (!v.is_number()) bad(field, "must be a number", v);
  return v.get<double>();
}

// A float field: the double range check first, so the cast below is always defined.
float float_field(const std::string& field, const json& v) {
  const double x = number(field, v);
  if (!(std::fabs(x) <= std::numeric_limits<float>::max())) bad(field, "is out of range", v);
  return static_cast<float>(x);
}

// An integer in [lo, hi]; an integral float (16.0) counts, as JSON does not tell them apart.
int64_t integer(const std::string& field, const json& v, int64_t lo, int64_t hi, const std::string& range) {
  if (!v.is_number()) bad(field, "must be an integer", v);
  if (v.is_number_unsigned()) {
    const uint64_t x = v.get<uint64_t>();  // nlohmann stores every non-negative integer this way
    if (x > static_cast<uint64_t>(hi) || (lo > 0 && x < static_cast<uint64_t>(lo))) bad(field, "must be " + range, v);
    return static_cast<int64_t>(x);
  }
  if (v.is_number_integer()) {
    const int64_t x = v.get<int64_t>();
    if (x < lo || x > hi) bad(field, "must be " + range, v);
    return x;
  }
  const double x = v.get<double>();
  if (x != std::floor(x)) bad(field, "must be an integer", v);
  if (x < static_cast<double>(lo) || x > static_cast<double>(hi)) bad(field, "must be " + range, v);
  return static_cast<int64_t>(x);
}

uint64_t seed_field(const json& v) {
  if (!v.is_number()) bad("seed", "must be an integer", v);
  if (v.is_number_unsigned()) return v.get<uint64_t>();
  if (v.is_number_integer()) bad("seed", "must be >= 0", v);
  const double x = v.get<double>();
  if (x != std::floor(x)) bad("seed", "must be an integer", v);
  if (x < 0 || x >= 18446744073709551616.0) bad("seed", "must be in [0, 2^64)", v);
  return static_cast<uint64_t>(x);
}

// OpenAI content: a string, or an array of {"type": "text", "text": ...} parts (joined).
std::string content_field(const std::string& field, const json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (!v.is_array()) bad(field, "must be a string or an array of text parts", v);
  std::string text;
  for (size_t i = 0; i < v.size(); ++i) {
    const json& part = v[i];
    const std::string name = field + "[" + std::to_string(i) + "]";
    if (!part.is_object() || part.value("type", json()) != "text" || !part.contains("text") ||
        !part["text"].is_string())
      bad(name, "must be {\"type\": \"text\", \"text\": \"...\"}", part);
    text += part["text"].get<std::string>();
  }
  return text;
}

std::vector<ChatMessage> messages_field(const json& v) {
  if (!v.is_array() || v.empty()) bad("messages", "must be a non-empty array of {role, content} objects", v);
  std::vector<ChatMessage> out;
  for (size_t i = 0; i < v.size(); ++i) {
    const json& m = v[i];
    const std::string name = "messages[" + std::to_string(i) + "]";
    if (!m.is_object()) bad(name, "must be an object with role and content", m);
    if (!m.contains("role")) throw Error(name + ".role is missing");
    if (!m.contains("content")) throw Error(name + ".content is missing");
    const json& role = m["role"];
    if (role != "system" && role != "user" && role != "assistant")
      bad(name + ".role", "must be \"system\", \"user\" or \"assistant\"", role);
    out.push_back({role.get<std::string>(), content_field(name + ".content", m["content"])});
  }
  return out;
}

std::vector<std::string> stop_field(const json& v) {
  if (v.is_string()) {
    if (v.get<std::string>().empty()) bad("stop", "must not be an empty string", v);
    return {v.get<std::string>()};
  }
  if (!v.is_array()) bad("stop", "must be a string or an array of strings", v);
  if (v.size() > kBatchMaxStopStrings)
    bad("stop", "must have at most " + std::to_string(kBatchMaxStopStrings) + " strings", v);
  std::vector<std::string> out;
  for (size_t i = 0; i < v.size(); ++i) {
    const std::string name = "stop[" + std::to_string(i) + "]";
    if (!v[i].is_string()) bad(name, "must be a string", v[i]);
    if (v[i].get<std::string>().empty()) bad(name, "must not be an empty string", v[i]);
    out.push_back(v[i].get<std::string>());
  }
  return out;
}

// OpenAI logit_bias: {"token id": bias in [-100, 100]}.
std::unordered_map<int32_t, float> logit_bias_field(const json& v) {
  if (!v.is_object()) bad("logit_bias", "must be an object {\"token id\": bias}", v);
  std::unordered_map<int32_t, float> out;
  for (const auto& [key, bias] : v.items()) {
    size_t used = 0;
    long long id = -1;
    try {
      id = std::stoll(key, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != key.size() || key.empty() || key[0] == '-' || key[0] == '+' || id < 0 ||
        id > std::numeric_limits<int32_t>::max())
      bad("logit_bias key", "must be a token id (a non-negative integer)", json(key));
    const std::string name = "logit_bias[\"" + key + "\"]";
    const float b = float_field(name, bias);
    if (b < -100.0f || b > 100.0f) bad(name, "must be in [-100, 100]", bias);
    out[static_cast<int32_t>(id)] = b;
  }
  return out;
}

// The field's value, or null when absent (OpenAI clients send null for "not set").
const json& field(const json& obj, const char* name) {
  static const json kNull;
  const auto it = obj.find(name);
  return it == obj.end() ? kNull : *it;
}

BatchRequest parse_request(const json& j) {
  BatchRequest r;
  const json& prompt = field(j, "prompt");
  const json& messages = field(j, "messages");
  if (!prompt.is_null() && !messages.is_null()) throw Error("give either prompt or messages, not both");
  if (prompt.is_null() && messages.is_null()) throw Error("missing prompt or messages");
  if (!prompt.is_null()) {
    if (prompt.is_array()) {  // token ids, as OpenAI's completions API accepts
      if (prompt.empty()) bad("prompt", "must not be an empty array", prompt);
      for (const json& id : prompt) {
        if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > INT32_MAX)
          bad("prompt", "must be a string or an array of non-negative token ids", prompt);
        r.prompt_ids.push_back(static_cast<int32_t>(id.get<int64_t>()));
      }
    } else {
      if (!prompt.is_string()) bad("prompt", "must be a string or an array of token ids", prompt);
      r.prompt = prompt.get<std::string>();
    }
  } else {
    r.is_chat = true;
    r.messages = messages_field(messages);
  }

  // max_completion_tokens is OpenAI's newer name for max_tokens. An explicit null means "until
  // max_model_len", as vLLM reads it.
  std::optional<int64_t> limit;
  for (const char* name : {"max_tokens", "max_completion_tokens"}) {
    const auto it = j.find(name);
    if (it == j.end()) continue;
    const int64_t n = it->is_null() ? -1 : integer(name, *it, 1, std::numeric_limits<int64_t>::max(), ">= 1");
    if (limit && *limit != n)
      throw Error("max_tokens (" + shown(field(j, "max_tokens")) + ") and max_completion_tokens (" + shown(*it) +
                  ") disagree; give one of them");
    limit = n;
  }
  if (limit) r.max_tokens = *limit;

  SamplingParams& s = r.sampling;
  s.repeat_last_n = -1;  // vLLM's repetition_penalty looks at every previous token
  if (const json& v = field(j, "temperature"); !v.is_null()) {
    s.temperature = float_field("temperature", v);
    if (s.temperature < 0) bad("temperature", "must be >= 0 (0 = greedy)", v);
  }
  if (const json& v = field(j, "top_p"); !v.is_null()) {
    s.top_p = float_field("top_p", v);
    if (!(s.top_p > 0 && s.top_p <= 1)) bad("top_p", "must be in (0, 1]", v);
  }
  if (const json& v = field(j, "top_k"); !v.is_null()) {
    const int64_t k = integer("top_k", v, -1, std::numeric_limits<int32_t>::max(), ">= 0 (0 or -1 = off)");
    s.top_k = k < 0 ? 0 : static_cast<int32_t>(k);
  }
  if (const json& v = field(j, "min_p"); !v.is_null()) {
    s.min_p = float_field("min_p", v);
    if (!(s.min_p >= 0 && s.min_p <= 1)) bad("min_p", "must be in [0, 1]", v);
  }
  if (const json& v = field(j, "presence_penalty"); !v.is_null()) {
    s.presence_penalty = float_field("presence_penalty", v);
    if (!(s.presence_penalty >= -2 && s.presence_penalty <= 2)) bad("presence_penalty", "must be in [-2, 2]", v);
  }
  if (const json& v = field(j, "frequency_penalty"); !v.is_null()) {
    s.frequency_penalty = float_field("frequency_penalty", v);
    if (!(s.frequency_penalty >= -2 && s.frequency_penalty <= 2))
      bad("frequency_penalty", "must be in [-2, 2]", v);
  }
  if (const json& v = field(j, "repetition_penalty"); !v.is_null()) {
    s.repetition_penalty = float_field("repetition_penalty", v);
    if (!(s.repetition_penalty > 0)) bad("repetition_penalty", "must be > 0 (1 = off)", v);
  }
  if (const json& v = field(j, "logit_bias"); !v.is_null()) s.logit_bias = logit_bias_field(v);
  s.validate();  // a guard: every rule it has is checked above with the JSON value in the message

  if (const json& v = field(j, "seed"); !v.is_null()) r.seed = seed_field(v);
  if (const json& v = field(j, "stop"); !v.is_null()) r.stop = stop_field(v);
  if (const json& v = field(j, "ignore_eos"); !v.is_null()) {
    if (!v.is_boolean()) bad("ignore_eos", "must be true or false", v);
    r.ignore_eos = v.get<bool>();
  }
  if (const json& v = field(j, "n"); !v.is_null() && v != 1) bad("n", "must be 1 (one completion per request)", v);
  return r;
}

// nlohmann's message says "parse error at line 1, column C: ..."; the line is always 1 here and
// would contradict the file line the result reports, so keep the column on.
std::string json_error_text(const std::string& what) {
  const size_t at = what.find("column ");
  return "invalid JSON: " + (at == std::string::npos ? what : "at " + what.substr(at));
}
}  // namespace

bool is_blank_line(std::string_view line) {
  for (char c : line)
    if (c != ' ' && c != '\t' && c != '\r' && c != '\n' && c != '\f' && c != '\v') return false;
  return true;
}

BatchLine parse_batch_line(std::string_view line, int64_t line_index) {
  BatchLine out;
  out.id = line_index;
  json j;
  try {
    j = json::parse(line);
  } catch (const json::exception& e) {
    out.error = json_error_text(e.what());
    return out;
  }
  if (!j.is_object()) {
    out.error = std::string("a request must be a JSON object, got ") + j.type_name();
    return out;
  }
  for (const auto& [key, value] : j.items())
    if (!is_known_field(key)) out.unknown_fields.push_back(key);
  try {
    if (const json& id = field(j, "id"); !id.is_null()) {
      if (!id.is_string() && !id.is_number()) bad("id", "must be a string or a number", id);
      out.id = id;
    }
    out.request = parse_request(j);
  } catch (const Error& e) {
    out.error = e.what();
  } catch (const json::exception& e) {  // not expected: every access above checks the type first
    out.error = std::string("bad request: ") + e.what();
  }
  return out;
}

PromptFormat PromptFormat::for_model(const LlamaModel& model, const Tokenizer& tokenizer) {
  PromptFormat f;
  f.tokenizer = &tokenizer;
  f.chat_template = ChatTemplate::detect(model.chat_template(), tokenizer.token_id("<|im_start|>").has_value());
  for (int32_t id = 0; id < tokenizer.n_vocab(); ++id)
    if (tokenizer.is_eog(id)) f.stop_ids.push_back(id);
  if (const std::string eot = f.chat_template.end_of_turn(); !eot.empty()) f.end_of_turn_id = tokenizer.token_id(eot);
  return f;
}

Request to_engine_request(const BatchRequest& request, const PromptFormat& format, uint64_t random_seed) {
  const Tokenizer& tok = *format.tokenizer;
  Request out;
  if (!request.prompt_ids.empty()) {
    out.prompt = request.prompt_ids;  // the engine checks them against the model's vocabulary
  } else {
    const std::string text =
        request.is_chat ? format.chat_template.apply(request.messages, /*add_generation_prompt=*/true) : request.prompt;
    out.prompt = tok.encode(text, /*add_special=*/true, /*parse_special=*/true);
    if (out.prompt.empty()) throw Error("prompt " + shown(json(text)) + " has no tokens (the model adds no BOS)");
  }
  out.max_tokens = request.max_tokens;
  out.sampling = request.sampling;
  out.sampling.seed = request.seed.value_or(random_seed);
  for (const auto& [id, bias] : out.sampling.logit_bias)
    if (id >= tok.n_vocab())
      throw Error("logit_bias token id " + std::to_string(id) + " is outside the vocabulary (" +
                  std::to_string(tok.n_vocab()) + " tokens)");
  if (!request.ignore_eos) {
    out.stop_ids = format.stop_ids;
    if (request.is_chat && format.end_of_turn_id && !tok.is_eog(*format.end_of_turn_id))
      out.stop_ids.push_back(*format.end_of_turn_id);
  }
  out.stop = request.stop;
  return out;
}

json result_json(const json& id, const BatchResult& result) {
  const RequestMetrics& m = result.metrics;
  json j;
  j["id"] = id;
  j["output_ids"] = result.output_ids;
  j["text"] = result.text;
  j["finish_reason"] = result.finish_reason;
  j["usage"] = {{"prompt_tokens", m.n_prompt_tokens},
                {"completion_tokens", static_cast<int64_t>(result.output_ids.size())},
                {"total_tokens", m.n_prompt_tokens + static_cast<int64_t>(result.output_ids.size())},
                {"cached_tokens", m.n_cached_prompt_tokens}};
  j["ttft_ms"] = m.ttft_s * 1e3;
  j["tpot_ms"] = m.tpot_s * 1e3;
  return j;
}

json error_json(const json& id, const std::string& message, int64_t line_number) {
  return {{"id", id}, {"error", {{"message", message}, {"line", line_number}}}};
}

std::string to_json_line(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace) + "\n"; }

}  // namespace kestrel::cli
