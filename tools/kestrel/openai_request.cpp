#include "openai_request.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <unordered_map>
#include <utility>

#include "chat_prompt.h"
#include "chat_request.h"

namespace kestrel::cli {

namespace {
using json = RequestJson;

// The parameter an error names: "messages[0].content" stays as is, "logit_bias[\"5\"]" and
// "logit_bias key" become "logit_bias", "stop[1]" stays.
std::string param_of(const std::string& field) {
  const size_t space = field.find(' ');
  std::string p = space == std::string::npos ? field : field.substr(0, space);
  if (p.rfind("logit_bias", 0) == 0) return "logit_bias";
  return p;
}

[[noreturn]] void bad(const std::string& field, const std::string& rule, const json& v) {
  throw RequestError(param_of(field), field + " " + rule + ", got " + shown(v));
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
  // A nonzero value that a 32-bit float holds only as zero would fail a range check stated as
  // excluding zero with its own (nonzero) value in the message.
  if (x != 0.0 && static_cast<float>(x) == 0.0f)
    bad(field, "is too small for a 32-bit float (magnitude under 1.4e-45)", v);
  return static_cast<float>(x);
}

// The message of a token id out of range (the int32 ids of the engine; the vocabulary is checked
// once the model is known).
constexpr const char* kTokenIdRange = "a token id in [0, 2147483647]";

// An integer in [lo, hi]; an integral float (16.0) counts, as JSON does not tell them apart. range
// states [lo, hi] in the message ("in [0, 9223372036854775807]").
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
  // Only doubles in [-2^63, 2^63) convert to int64_t (anything else is undefined behaviour); the
  // exact bounds are then checked on the integer, as double(hi) may round up past hi.
  constexpr double kTwo63 = 9223372036854775808.0;
  if (!(x >= -kTwo63 && x < kTwo63)) bad(field, "must be " + range, v);
  const auto n = static_cast<int64_t>(x);
  if (n < lo || n > hi) bad(field, "must be " + range, v);
  return n;
}

bool boolean(const std::string& field, const json& v) {
  if (!v.is_boolean()) bad(field, "must be true or false", v);
  return v.get<bool>();
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

// A list of token ids (v is an array); name is the field it came from ("prompt", "prompt[2]").
std::vector<int32_t> token_ids(const std::string& name, const json& v, const char* rule) {
  if (v.empty()) bad(name, "must not be an empty array", v);
  std::vector<int32_t> ids;
  ids.reserve(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    const std::string item = name + "[" + std::to_string(i) + "]";
    if (!v[i].is_number()) bad(item, rule, v[i]);
    ids.push_back(static_cast<int32_t>(integer(item, v[i], 0, std::numeric_limits<int32_t>::max(), kTokenIdRange)));
  }
  return ids;
}

// OpenAI's prompt: a string, an array of token ids, an array of strings or an array of token-id
// arrays (the last two: one prompt each). The array's first element decides which; the others must
// be the same kind.
void prompt_field(const json& v, RequestApi api, OpenAiRequest& r) {
  if (v.is_string()) {
    r.prompts.push_back({v.get<std::string>(), std::nullopt});
  } else if (!v.is_array()) {
    bad("prompt", "must be a string, an array of token ids, or an array of strings or of token-id arrays", v);
  } else if (v.empty()) {
    bad("prompt", "must not be an empty array", v);
  } else if (v[0].is_number()) {
    r.prompts.push_back({"", token_ids("prompt", v, "must be a token id like prompt[0] (a prompt array is all token "
                                                    "ids, all strings or all token-id arrays)")});
  } else if (v[0].is_string()) {
    for (size_t i = 0; i < v.size(); ++i) {
      if (!v[i].is_string())
        bad("prompt[" + std::to_string(i) + "]",
            "must be a string like prompt[0] (a prompt array is all token ids, all strings or all token-id arrays)",
            v[i]);
      r.prompts.push_back({v[i].get<std::string>(), std::nullopt});
    }
  } else if (v[0].is_array()) {
    for (size_t i = 0; i < v.size(); ++i) {
      const std::string name = "prompt[" + std::to_string(i) + "]";
      if (!v[i].is_array())
        bad(name,
            "must be an array of token ids like prompt[0] (a prompt array is all token ids, all strings or all "
            "token-id arrays)",
            v[i]);
      r.prompts.push_back({"", token_ids(name, v[i], "must be a token id")});
    }
  } else {
    bad("prompt[0]", "must be a token id, a string or an array of token ids", v[0]);
  }
  if (api == RequestApi::Batch && r.prompts.size() != 1)
    bad("prompt", "must be one prompt on a batch line (give each prompt its own line)", v);
}

std::vector<std::string> stop_field(const json& v) {
  if (v.is_string()) {
    if (v.get<std::string>().empty()) bad("stop", "must not be an empty string", v);
    return {v.get<std::string>()};
  }
  if (!v.is_array()) bad("stop", "must be a string or an array of strings", v);
  if (v.size() > kMaxStopStrings) bad("stop", "must have at most " + std::to_string(kMaxStopStrings) + " strings", v);
  std::vector<std::string> out;
  for (size_t i = 0; i < v.size(); ++i) {
    const std::string name = "stop[" + std::to_string(i) + "]";
    if (!v[i].is_string()) bad(name, "must be a string", v[i]);
    if (v[i].get<std::string>().empty()) bad(name, "must not be an empty string", v[i]);
    out.push_back(v[i].get<std::string>());
  }
  return out;
}

// OpenAI logit_bias: {"token id": bias} (the bias's range is SamplingParams::validate's). *keys
// gets each id's key as written, for messages.
std::unordered_map<int32_t, float> logit_bias_field(const json& v, std::unordered_map<int32_t, std::string>* keys) {
  if (!v.is_object()) bad("logit_bias", "must be an object {\"token id\": bias}", v);
  std::unordered_map<int32_t, float> out;
  for (const auto& [key, bias] : v.items()) {
    // Decimal digits only: no sign, no whitespace (strtol-style parsers skip it), no exponent.
    int64_t id = 0;
    bool ok = !key.empty() && key.size() <= 10;
    for (char c : key) {
      ok = ok && c >= '0' && c <= '9';
      if (ok) id = id * 10 + (c - '0');
    }
    if (!ok || id > std::numeric_limits<int32_t>::max())
      bad("logit_bias key", "must be a token id (decimal digits, at most 2147483647)", json(key));
    out[static_cast<int32_t>(id)] = float_field("logit_bias[\"" + key + "\"]", bias);
    (*keys)[static_cast<int32_t>(id)] = key;
  }
  return out;
}

// The field's value, or null when absent (OpenAI clients send null for "not set").
const json& field(const json& obj, const char* name) {
  static const json kNull;
  const auto it = obj.find(name);
  return it == obj.end() ? kNull : *it;
}

void prompt_or_messages(const json& j, RequestApi api, OpenAiRequest& r) {
  const json& prompt = field(j, "prompt");
  const json& messages = field(j, "messages");
  if (api == RequestApi::Batch) {
    if (!prompt.is_null() && !messages.is_null())
      throw RequestError("prompt", "give either prompt or messages, not both");
    if (prompt.is_null() && messages.is_null()) throw RequestError("prompt", "missing prompt or messages");
  } else if (api == RequestApi::Completions && prompt.is_null()) {
    throw RequestError("prompt", "prompt is missing (a string or an array of token ids)");
  } else if (api == RequestApi::Chat && messages.is_null()) {
    throw RequestError("messages", "messages is missing (a non-empty array of {role, content} objects)");
  }
  if (api != RequestApi::Chat && !prompt.is_null()) {
    prompt_field(prompt, api, r);
  } else {
    r.is_chat = true;
    parse_chat_messages(messages, r);
  }
}

// The fields' types here; their ranges in SamplingParams::validate (the one place for them, the CLI
// flags' too), whose error is reported with the field's JSON value as written.
void sampling_fields(const json& j, SamplingParams& s) {
  s.repeat_last_n = -1;  // vLLM's repetition_penalty looks at every previous token
  for (const auto& [name, member] : {std::pair{"temperature", &SamplingParams::temperature},
                                     std::pair{"top_p", &SamplingParams::top_p},
                                     std::pair{"min_p", &SamplingParams::min_p},
                                     std::pair{"presence_penalty", &SamplingParams::presence_penalty},
                                     std::pair{"frequency_penalty", &SamplingParams::frequency_penalty},
                                     std::pair{"repetition_penalty", &SamplingParams::repetition_penalty}})
    if (const json& v = field(j, name); !v.is_null()) s.*member = float_field(name, v);
  if (const json& v = field(j, "top_k"); !v.is_null()) {
    const int64_t k = integer("top_k", v, -1, std::numeric_limits<int32_t>::max(), "in [-1, 2147483647] (0 or -1 = off)");
    s.top_k = k < 0 ? 0 : static_cast<int32_t>(k);
  }
  std::unordered_map<int32_t, std::string> bias_keys;
  if (const json& v = field(j, "logit_bias"); !v.is_null()) s.logit_bias = logit_bias_field(v, &bias_keys);
  try {
    s.validate();
  } catch (const SamplingParamError& e) {
    if (e.field() == "logit_bias" && bias_keys.count(e.token())) {
      const std::string& key = bias_keys.at(e.token());
      bad("logit_bias[\"" + key + "\"]", e.rule(), field(j, "logit_bias").at(key));
    }
    bad(e.field(), e.rule(), field(j, e.field().c_str()));
  }
}

// logprobs: completions take an integer (how many top alternatives), chat a boolean plus
// top_logprobs.
void logprobs_fields(const json& j, RequestApi api, OpenAiRequest& r) {
  const std::string range = "in [0, " + std::to_string(kMaxLogprobs) + "]";
  if (api == RequestApi::Completions) {
    if (const json& v = field(j, "logprobs"); !v.is_null())
      r.logprobs = static_cast<int32_t>(integer("logprobs", v, 0, kMaxLogprobs, range));
    return;
  }
  const json& top = field(j, "top_logprobs");
  const bool wanted = !field(j, "logprobs").is_null() && boolean("logprobs", field(j, "logprobs"));
  if (!top.is_null()) {
    const auto n = static_cast<int32_t>(integer("top_logprobs", top, 0, kMaxLogprobs, range));
    if (!wanted) throw RequestError("top_logprobs", "top_logprobs needs logprobs: true");
    r.logprobs = n;
  } else if (wanted) {
    r.logprobs = 0;
  }
}

// Structured output. Each field's value becomes one grammar::Constraint; two fields asking for
// one are refused (which would win is not obvious).
void set_constraint(OpenAiRequest& r, const std::string& param, grammar::Constraint c) {
  if (r.constraint && r.constraint_param == param)
    throw RequestError(param, param + " holds more than one of json, regex, choice, grammar, json_object; give one");
  if (r.constraint)
    throw RequestError(param, param + " and " + r.constraint_param + " both ask for structured output; give one of them");
  r.constraint = std::move(c);
  r.constraint_param = param;
}

grammar::Constraint schema_constraint(const std::string& param, const json& v) {
  grammar::Constraint c;
  c.kind = grammar::ConstraintKind::JSON_SCHEMA;
  if (v.is_string()) {  // vLLM takes a schema as JSON text too
    c.text = v.get<std::string>();
  } else if (v.is_object() || v.is_boolean()) {
    c.text = v.dump();
  } else {
    bad(param, "must be a JSON schema (an object)", v);
  }
  return c;
}

grammar::Constraint text_constraint(const std::string& param, const json& v, grammar::ConstraintKind kind) {
  if (!v.is_string()) bad(param, "must be a string", v);
  grammar::Constraint c;
  c.kind = kind;
  c.text = v.get<std::string>();
  return c;
}

grammar::Constraint choice_constraint(const std::string& param, const json& v) {
  if (!v.is_array() || v.empty()) bad(param, "must be a non-empty list of strings", v);
  grammar::Constraint c;
  c.kind = grammar::ConstraintKind::CHOICE;
  for (const json& e : v) {
    if (!e.is_string()) bad(param, "must be a non-empty list of strings", v);
    c.choices.push_back(e.get<std::string>());
  }
  return c;
}

void structured_output_fields(const json& j, OpenAiRequest& r) {
  using grammar::ConstraintKind;
  if (const json& v = field(j, "response_format"); !v.is_null()) {
    if (!v.is_object() || !v.contains("type") || !v["type"].is_string())
      bad("response_format", "must be an object {\"type\": \"text\" | \"json_object\" | \"json_schema\"}", v);
    const std::string& type = v["type"].get_ref<const std::string&>();
    if (type == "json_object") {
      grammar::Constraint c;
      c.kind = ConstraintKind::JSON_OBJECT;
      set_constraint(r, "response_format", c);
    } else if (type == "json_schema") {
      const json& js = field(v, "json_schema");
      if (!js.is_object() || !js.contains("schema"))
        bad("response_format.json_schema", "must be an object {\"name\", \"schema\", \"strict\"} with a schema", js);
      if (const json& n = field(js, "name"); !n.is_null() && !n.is_string()) bad("response_format.json_schema.name", "must be a string", n);
      if (const json& st = field(js, "strict"); !st.is_null()) boolean("response_format.json_schema.strict", st);
      set_constraint(r, "response_format", schema_constraint("response_format.json_schema.schema", js["schema"]));
    } else if (type != "text" && type != "structural_tag") {
      bad("response_format.type", "must be \"text\", \"json_object\" or \"json_schema\"", v["type"]);
    }
  }
  if (const json& v = field(j, "structured_outputs"); !v.is_null()) {
    if (!v.is_object()) bad("structured_outputs", "must be an object with one of json, regex, choice, grammar", v);
    if (const json& x = field(v, "json"); !x.is_null())
      set_constraint(r, "structured_outputs", schema_constraint("structured_outputs.json", x));
    if (const json& x = field(v, "regex"); !x.is_null())
      set_constraint(r, "structured_outputs", text_constraint("structured_outputs.regex", x, ConstraintKind::REGEX));
    if (const json& x = field(v, "choice"); !x.is_null())
      set_constraint(r, "structured_outputs", choice_constraint("structured_outputs.choice", x));
    if (const json& x = field(v, "grammar"); !x.is_null())
      set_constraint(r, "structured_outputs", text_constraint("structured_outputs.grammar", x, ConstraintKind::GBNF));
    if (const json& x = field(v, "json_object"); !x.is_null() && boolean("structured_outputs.json_object", x)) {
      grammar::Constraint c;
      c.kind = ConstraintKind::JSON_OBJECT;
      set_constraint(r, "structured_outputs", c);
    }
    if (!r.constraint && !v.contains("any_whitespace"))
      bad("structured_outputs", "must hold one of json, regex, choice, grammar, json_object", v);
  }
  if (const json& v = field(j, "guided_json"); !v.is_null()) set_constraint(r, "guided_json", schema_constraint("guided_json", v));
  if (const json& v = field(j, "guided_regex"); !v.is_null())
    set_constraint(r, "guided_regex", text_constraint("guided_regex", v, ConstraintKind::REGEX));
  if (const json& v = field(j, "guided_choice"); !v.is_null()) set_constraint(r, "guided_choice", choice_constraint("guided_choice", v));
  if (const json& v = field(j, "guided_grammar"); !v.is_null())
    set_constraint(r, "guided_grammar", text_constraint("guided_grammar", v, ConstraintKind::GBNF));
  if (const json& v = field(j, "grammar"); !v.is_null()) set_constraint(r, "grammar", text_constraint("grammar", v, ConstraintKind::GBNF));
  if (const json& v = field(j, "json_schema"); !v.is_null()) set_constraint(r, "json_schema", schema_constraint("json_schema", v));
  // Whitespace between JSON tokens (xgrammar's any_whitespace): none unless asked for, whichever
  // field gave the JSON constraint.
  if (const json& so = field(j, "structured_outputs"); so.is_object()) {
    if (const json& w = field(so, "any_whitespace"); !w.is_null()) {
      const bool any = boolean("structured_outputs.any_whitespace", w);
      if (r.constraint) r.constraint->any_whitespace = any;
    }
  }
}

// Fields vLLM reads that ask for what this server does not do: an error rather than an answer
// the client would take for what it asked.
void unsupported_fields(const json& j, RequestApi api, const OpenAiRequest& r) {
  if (const json& v = field(j, "response_format"); !v.is_null() && v.is_object() && v.contains("type") &&
                                                   v["type"] == "structural_tag")
    throw RequestError("response_format", "response_format type \"structural_tag\" is not supported");
  if (api != RequestApi::Chat && !r.is_chat && !field(j, "suffix").is_null())
    throw RequestError("suffix", "suffix is not supported, got " + shown(field(j, "suffix")));
  // The drafter and its pool are made when the engine starts, for every request alike.
  if (const json& v = field(j, "speculative_config"); !v.is_null())
    throw RequestError("speculative_config",
                       std::string("speculative_config is not a request field: speculative decoding is set for the "
                                   "whole ") +
                           (api == RequestApi::Batch ? "run (kestrel batch --speculative-config)"
                                                     : "server (kestrel serve --speculative-config)") +
                           ", got " + shown(v));
}

// min_tokens and stop_token_ids (vLLM's), once max_tokens is known.
void stop_token_fields(const json& j, OpenAiRequest& r) {
  if (const json& v = field(j, "min_tokens"); !v.is_null()) {
    r.min_tokens = integer("min_tokens", v, 0, std::numeric_limits<int64_t>::max(), "in [0, 9223372036854775807]");
    // The limit as the client named it (chat's newer max_completion_tokens, or max_tokens).
    const char* limit = field(j, "max_tokens").is_null() && !field(j, "max_completion_tokens").is_null()
                            ? "max_completion_tokens"
                            : "max_tokens";
    if (r.max_tokens >= 0 && r.min_tokens > r.max_tokens)
      bad("min_tokens",
          std::string("must be at most ") + limit + " (" + std::to_string(r.max_tokens) +
              (r.max_tokens_given ? ")" : ", its default)"),
          v);
  }
  if (const json& v = field(j, "stop_token_ids"); !v.is_null()) {
    if (!v.is_array()) bad("stop_token_ids", "must be an array of token ids", v);
    r.stop_token_ids.reserve(v.size());
    for (size_t i = 0; i < v.size(); ++i)
      r.stop_token_ids.push_back(static_cast<int32_t>(integer("stop_token_ids[" + std::to_string(i) + "]", v[i], 0,
                                                              std::numeric_limits<int32_t>::max(), kTokenIdRange)));
  }
}

// vLLM's output and token-filter fields, and its priority (refused unless 0: no priority policy).
void vllm_fields(const json& j, OpenAiRequest& r) {
  for (const auto& [name, member] : {std::pair{"include_stop_str_in_output", &OpenAiRequest::include_stop_str_in_output},
                                     std::pair{"skip_special_tokens", &OpenAiRequest::skip_special_tokens},
                                     std::pair{"spaces_between_special_tokens",
                                               &OpenAiRequest::spaces_between_special_tokens}})
    if (const json& v = field(j, name); !v.is_null()) r.*member = boolean(name, v);
  if (const json& v = field(j, "allowed_token_ids"); !v.is_null()) {
    if (!v.is_array()) bad("allowed_token_ids", "must be an array of token ids", v);
    // vLLM refuses an empty list: it would rule out every token.
    r.allowed_token_ids = token_ids("allowed_token_ids", v, "must be a token id");
  }
  if (const json& v = field(j, "bad_words"); !v.is_null()) {
    if (!v.is_array()) bad("bad_words", "must be an array of strings", v);
    if (v.size() > kMaxBadWords) bad("bad_words", "must have at most " + std::to_string(kMaxBadWords) + " strings", v);
    for (size_t i = 0; i < v.size(); ++i) {
      const std::string name = "bad_words[" + std::to_string(i) + "]";
      if (!v[i].is_string()) bad(name, "must be a string", v[i]);
      const std::string& w = v[i].get_ref<const std::string&>();
      // vLLM strips leading whitespace before tokenizing; nothing left would be a word of no tokens.
      if (w.find_first_not_of(" \t\n\r\f\v") == std::string::npos) bad(name, "must have a non-space character", v[i]);
      r.bad_words.push_back(w);
    }
  }
  if (const json& v = field(j, "truncate_prompt_tokens"); !v.is_null()) {
    r.truncate_prompt_tokens = integer("truncate_prompt_tokens", v, -1, std::numeric_limits<int64_t>::max(),
                                       "-1 (the context) or in [1, 9223372036854775807]");
    if (r.truncate_prompt_tokens == 0) bad("truncate_prompt_tokens", "must be -1 (the context) or >= 1", v);
  }
  if (const json& v = field(j, "priority"); !v.is_null()) {
    const int64_t p = integer("priority", v, std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max(),
                              "an integer in [-2^63, 2^63 - 1]");
    if (p != 0)
      bad("priority", "must be 0: kestrel has no priority scheduling (requests are served in arrival order)", v);
  }
}

// use_beam_search, best_of, length_penalty, early_stopping (after n and the sampling fields).
void beam_fields(const json& j, RequestApi api, OpenAiRequest& r) {
  if (const json& v = field(j, "use_beam_search"); !v.is_null()) r.use_beam_search = boolean("use_beam_search", v);
  if (const json& v = field(j, "best_of"); !v.is_null()) {
    r.best_of = static_cast<int32_t>(integer("best_of", v, 1, kMaxN, "in [1, " + std::to_string(kMaxN) + "]"));
    if (r.best_of < r.n) bad("best_of", "must be >= n (" + std::to_string(r.n) + ")", v);
    if (r.best_of > r.n && !r.use_beam_search) {
      if (api == RequestApi::Chat) bad("best_of", "above n is a completions field (or give use_beam_search)", v);
      if (api == RequestApi::Batch) bad("best_of", "above n is served by `kestrel serve` (or give use_beam_search)", v);
      if (r.stream) bad("best_of", "above n cannot be streamed (the best are known only at the end)", v);
    }
  }
  if (const json& v = field(j, "length_penalty"); !v.is_null()) r.length_penalty = number("length_penalty", v);
  if (const json& v = field(j, "early_stopping"); !v.is_null()) {
    if (v.is_boolean()) r.early_stopping = v.get<bool>() ? EarlyStopping::Done : EarlyStopping::Heuristic;
    else if (v == "never") r.early_stopping = EarlyStopping::Never;
    else bad("early_stopping", "must be true, false or \"never\"", v);
  }
  if (!r.use_beam_search) return;
  // Beams rank the raw log-probabilities (vLLM refused the same sampling fields with beam search).
  const SamplingParams neutral;
  const SamplingParams& s = r.sampling;
  if (const json& v = field(j, "temperature"); !v.is_null() && s.temperature != 0.0f)
    bad("temperature", "must be 0 (or absent) with use_beam_search: beams rank the model's log-probabilities", v);
  auto refuse = [&](const char* name, bool set) {
    if (set) bad(name, "cannot be used with use_beam_search (beams rank the model's log-probabilities)", field(j, name));
  };
  refuse("top_p", s.top_p != neutral.top_p);
  refuse("top_k", s.top_k != neutral.top_k);
  refuse("min_p", s.min_p != neutral.min_p);
  refuse("presence_penalty", s.presence_penalty != neutral.presence_penalty);
  refuse("frequency_penalty", s.frequency_penalty != neutral.frequency_penalty);
  refuse("repetition_penalty", s.repetition_penalty != neutral.repetition_penalty);
  refuse("logit_bias", !s.logit_bias.empty());
  refuse("stop", !r.stop.empty());
  refuse("logprobs", r.logprobs >= 0);
  refuse("prompt_logprobs", r.prompt_logprobs >= 0);
  refuse("min_tokens", r.min_tokens > 0);
  refuse("allowed_token_ids", !r.allowed_token_ids.empty());
  refuse("bad_words", !r.bad_words.empty());
  if (r.max_tokens == 0) {
    const char* name = field(j, "max_tokens").is_null() ? "max_completion_tokens" : "max_tokens";
    bad(name, "must be >= 1 with use_beam_search", field(j, name));
  }
  if (r.constraint) bad(r.constraint_param, "cannot be used with use_beam_search", field(j, r.constraint_param.c_str()));
}

// Fields only the server reads.
void server_fields(const json& j, RequestApi api, OpenAiRequest& r) {
  if (const json& v = field(j, "n"); !v.is_null())
    r.n = static_cast<int32_t>(integer("n", v, 1, kMaxN, "in [1, " + std::to_string(kMaxN) + "]"));
  logprobs_fields(j, api, r);
  if (api == RequestApi::Completions) {
    if (const json& v = field(j, "echo"); !v.is_null()) r.echo = boolean("echo", v);
  }
  if (const json& v = field(j, "stream"); !v.is_null()) r.stream = boolean("stream", v);
  if (const json& v = field(j, "prompt_logprobs"); !v.is_null()) {
    r.prompt_logprobs = static_cast<int32_t>(
        integer("prompt_logprobs", v, 0, kMaxLogprobs,
                "in [0, " + std::to_string(kMaxLogprobs) + "] (-1, the whole vocabulary, is not served)"));
    // vLLM refuses them streamed as well: the answer carries them once, at the end.
    if (r.stream) bad("prompt_logprobs", "cannot be used with stream: true", v);
  }
  if (const json& v = field(j, "stream_options"); !v.is_null()) {
    if (!v.is_object()) bad("stream_options", "must be an object", v);
    // As OpenAI's API and vLLM refuse it: the options shape a stream only.
    if (!r.stream) bad("stream_options", "can only be set with stream: true", v);
    if (const json& u = field(v, "include_usage"); !u.is_null())
      r.include_usage = boolean("stream_options.include_usage", u);
  }
  if (const json& v = field(j, "model"); !v.is_null()) {
    if (!v.is_string()) bad("model", "must be a string", v);
    r.model = v.get<std::string>();
  }
}

}  // namespace

bool is_known_field(const std::string& key, RequestApi api) {
  static const char* const kCommon[] = {
      "prompt",     "messages", "max_tokens",       "max_completion_tokens", "temperature", "top_p",
      "top_k",      "min_p",    "seed",             "stop",                  "ignore_eos",  "n",
      "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "model", "user",
      "response_format", "best_of", "suffix", "tools", "tool_choice", "structured_outputs", "guided_json",
      "guided_regex", "guided_choice", "guided_grammar", "grammar", "json_schema", "use_beam_search",
      "length_penalty", "early_stopping", "min_tokens", "stop_token_ids", "prompt_logprobs", "speculative_config",
      "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens", "allowed_token_ids",
      "bad_words", "truncate_prompt_tokens", "priority", "chat_template_kwargs", "add_generation_prompt"};
  static const char* const kServer[] = {"logprobs", "top_logprobs", "echo", "stream", "stream_options"};
  for (const char* k : kCommon)
    if (key == k) return true;
  if (api == RequestApi::Batch) return key == "id";
  for (const char* k : kServer)
    if (key == k) return true;
  return false;
}

OpenAiRequest parse_openai_request(const json& j, RequestApi api) {
  OpenAiRequest r;
  prompt_or_messages(j, api, r);

  // max_completion_tokens is OpenAI's newer name for max_tokens. An explicit null means "until
  // max_model_len", as vLLM reads it; the server's default is the same.
  if (api != RequestApi::Batch) r.max_tokens = -1;
  // Completions take 0 as OpenAI's legacy API does (the echo alone, for scoring a prompt).
  const int64_t min_max_tokens = api == RequestApi::Completions ? 0 : 1;
  const std::string max_tokens_range =
      min_max_tokens == 0 ? ">= 0 and < 2^63 (0: generate nothing)" : ">= 1 and < 2^63";
  // A null one beside a number is "not set" (vLLM takes whichever is given).
  std::optional<int64_t> limit;
  bool null_limit = false;
  for (const char* name : {"max_tokens", "max_completion_tokens"}) {
    const auto it = j.find(name);
    if (it == j.end()) continue;
    if (it->is_null()) {
      null_limit = true;
      continue;
    }
    const int64_t n = integer(name, *it, min_max_tokens, std::numeric_limits<int64_t>::max(), max_tokens_range);
    if (limit && *limit != n)
      throw RequestError(name, std::string("max_tokens (") + shown(field(j, "max_tokens")) +
                                   ") and max_completion_tokens (" + shown(*it) + ") disagree; give one of them");
    limit = n;
  }
  if (!limit && null_limit) limit = -1;
  if (limit) {
    r.max_tokens = *limit;
    r.max_tokens_given = *limit >= 0;
  }

  sampling_fields(j, r.sampling);
  if (const json& v = field(j, "seed"); !v.is_null()) r.seed = seed_field(v);
  if (const json& v = field(j, "stop"); !v.is_null()) r.stop = stop_field(v);
  if (const json& v = field(j, "ignore_eos"); !v.is_null()) r.ignore_eos = boolean("ignore_eos", v);
  if (r.is_chat) {
    parse_chat_tools(j, r);
    if (const json& v = field(j, "chat_template_kwargs"); !v.is_null()) {
      if (!v.is_object()) bad("chat_template_kwargs", "must be an object of template variables", v);
      r.chat_template_kwargs = v;
    }
    if (const json& v = field(j, "add_generation_prompt"); !v.is_null())
      r.add_generation_prompt = boolean("add_generation_prompt", v);
  }
  stop_token_fields(j, r);
  vllm_fields(j, r);
  if (api == RequestApi::Batch) {
    if (const json& v = field(j, "n"); !v.is_null() && v != 1) {
      // With use_beam_search, n is the beam width when best_of is absent, as in the server; a batch
      // result is the best beam, so the request keeps n = 1 and the width in best_of.
      const json& beam = field(j, "use_beam_search");
      if (!beam.is_boolean() || !beam.get<bool>())
        bad("n", "must be 1 (one completion per request; with use_beam_search, the beam width)", v);
      const auto width = static_cast<int32_t>(integer("n", v, 1, kMaxN, "in [1, " + std::to_string(kMaxN) + "]"));
      if (const json& b = field(j, "best_of"); b.is_null()) {
        r.best_of = width;
      } else if (b.is_number_integer() && b.get<int64_t>() < width) {
        bad("best_of", "must be >= n (" + std::to_string(width) + ")", b);
      }
    }
    if (const json& v = field(j, "prompt_logprobs"); !v.is_null())
      bad("prompt_logprobs", "is served by `kestrel serve` (a batch result carries no logprobs)", v);
  } else {
    server_fields(j, api, r);
    if (r.prompts.size() * static_cast<size_t>(r.n) > kMaxChoices)
      throw RequestError("prompt", std::to_string(r.prompts.size()) + " prompts with n = " + std::to_string(r.n) +
                                       " make " + std::to_string(r.prompts.size() * static_cast<size_t>(r.n)) +
                                       " choices; at most " + std::to_string(kMaxChoices) + " per request");
  }
  unsupported_fields(j, api, r);
  structured_output_fields(j, r);
  beam_fields(j, api, r);
  return r;
}

PromptFormat PromptFormat::for_model(const LlamaModel& model, const Tokenizer& tokenizer) {
  PromptFormat f;
  f.tokenizer = &tokenizer;
  f.n_vocab = static_cast<int32_t>(model.hparams().n_vocab);
  f.template_source = model.chat_template();
  if (!f.template_source.empty()) {
    try {
      f.jinja_template = std::make_shared<const jinja::Template>(jinja::Template::parse(f.template_source));
    } catch (const jinja::TemplateError& e) {
      f.template_error = e.what();
    }
  }
  if (tokenizer.bos_id() >= 0) f.bos_token = tokenizer.token(tokenizer.bos_id()).text;
  if (tokenizer.eos_id() >= 0) f.eos_token = tokenizer.token(tokenizer.eos_id()).text;
  f.chat_template = ChatTemplate::detect(model.chat_template(), tokenizer.token_id("<|im_start|>").has_value(),
                                         tokenizer.token_id("<start_of_turn>").has_value());
  for (int32_t id = 0; id < tokenizer.n_vocab(); ++id)
    if (tokenizer.is_eog(id)) f.stop_ids.push_back(id);
  if (const std::string eot = f.chat_template.end_of_turn(); !eot.empty()) f.end_of_turn_id = tokenizer.token_id(eot);
  f.grammars = grammar::GrammarCache::for_tokenizer(tokenizer);
  return f;
}

namespace {

// vLLM's truncate_prompt_tokens: the prompt's last N tokens (its tokenizer truncates on the left).
bool truncate_prompt(const OpenAiRequest& request, const PromptFormat& format, std::vector<int32_t>& prompt) {
  int64_t keep = request.truncate_prompt_tokens;
  if (keep == 0) return false;
  if (format.max_model_len > 0 && keep > format.max_model_len)
    throw RequestError("truncate_prompt_tokens",
                       "truncate_prompt_tokens (" + std::to_string(keep) + ") is greater than max_model_len (" +
                           std::to_string(format.max_model_len) + "); give a smaller truncation size");
  if (keep < 0) keep = format.max_model_len > 0 ? format.max_model_len : static_cast<int64_t>(prompt.size());
  if (static_cast<int64_t>(prompt.size()) <= keep) return false;
  prompt.erase(prompt.begin(), prompt.end() - keep);
  return true;
}

// vLLM's SamplingParams.update_from_tokenizer: each word tokenized without special tokens as it is
// (leading whitespace stripped) and with one leading space; the second is kept only when it starts
// with another token and has as many tokens (a new word token, not the same word split otherwise).
std::vector<std::vector<int32_t>> bad_word_ids(const std::vector<std::string>& words, const Tokenizer& tok) {
  std::vector<std::vector<int32_t>> out;
  for (size_t i = 0; i < words.size(); ++i) {
    const size_t start = words[i].find_first_not_of(" \t\n\r\f\v");
    const std::string word = start == std::string::npos ? std::string() : words[i].substr(start);
    std::vector<int32_t> plain = tok.encode(word, /*add_special=*/false, /*parse_special=*/true);
    std::vector<int32_t> spaced = tok.encode(" " + word, /*add_special=*/false, /*parse_special=*/true);
    if (plain.empty())
      throw RequestError("bad_words", "bad_words[" + std::to_string(i) + "] " + shown(json(words[i])) + " has no tokens");
    const bool spaced_too = !spaced.empty() && spaced[0] != plain[0] && spaced.size() == plain.size();
    out.push_back(std::move(plain));
    if (spaced_too) out.push_back(std::move(spaced));
  }
  return out;
}

}  // namespace

std::vector<int32_t> reported_stop_ids(const OpenAiRequest& request, const PromptFormat& format) {
  std::vector<int32_t> out;
  for (const int32_t id : request.stop_token_ids) {
    const bool eos = std::find(format.stop_ids.begin(), format.stop_ids.end(), id) != format.stop_ids.end() ||
                     (request.is_chat && format.end_of_turn_id == id);
    if (request.ignore_eos || !eos) out.push_back(id);
  }
  return out;
}

Json stop_reason_json(const RequestOutput& o, std::span<const int32_t> reported_stop_ids) {
  if (o.finish_reason != "stop") return nullptr;
  if (!o.stop_string.empty()) return o.stop_string;
  if (std::find(reported_stop_ids.begin(), reported_stop_ids.end(), o.stop_token) != reported_stop_ids.end())
    return o.stop_token;
  return nullptr;
}

std::string prompt_text(const OpenAiRequest& request, const Tokenizer& tokenizer, size_t prompt_index) {
  if (prompt_index >= request.prompts.size()) return "";
  const PromptInput& p = request.prompts[prompt_index];
  if (!p.ids) return p.text;
  // With their special tokens: the ids are echoed as sent (BOS included), as vLLM does.
  return tokenizer.decode(*p.ids, /*skip_special=*/false);
}

std::string render_chat_prompt(const OpenAiRequest& request, const PromptFormat& format) {
  return render_chat(format, request.messages_json, request.add_generation_prompt, request.tools,
                     request.chat_template_kwargs);
}

Request to_engine_request(const OpenAiRequest& request, const PromptFormat& format, uint64_t random_seed,
                          size_t prompt_index, bool* truncated) {
  const Tokenizer& tok = *format.tokenizer;
  const int32_t n_vocab = format.n_vocab > 0 ? format.n_vocab : tok.n_vocab();
  Request out;
  if (!request.is_chat && prompt_index >= request.prompts.size())
    throw RequestError("prompt", "prompt " + std::to_string(prompt_index) + " does not exist (the request has " +
                                     std::to_string(request.prompts.size()) + ")");
  const PromptInput* p = request.is_chat ? nullptr : &request.prompts[prompt_index];
  if (p != nullptr && p->ids) {
    // Named as the client wrote it: prompt[i] for one prompt, prompt[p][i] in a list of prompts.
    const std::string name =
        request.prompts.size() > 1 ? "prompt[" + std::to_string(prompt_index) + "]" : std::string("prompt");
    for (size_t i = 0; i < p->ids->size(); ++i)
      if ((*p->ids)[i] >= n_vocab)
        throw RequestError("prompt", name + "[" + std::to_string(i) + "] = " + std::to_string((*p->ids)[i]) +
                                         " is outside the vocabulary (" + std::to_string(n_vocab) + " tokens)");
    out.prompt = *p->ids;
  } else {
    const std::string text = !request.is_chat       ? p->text
                             : request.chat_prompt ? *request.chat_prompt
                                                   : render_chat_prompt(request, format);
    // A template that writes the BOS text itself (Llama 2 and 3, Mistral) must not get a second one.
    const bool has_bos = request.is_chat && format.starts_with_bos(text);
    out.prompt = tok.encode(text, /*add_special=*/!has_bos, /*parse_special=*/true);
    if (out.prompt.empty())
      throw RequestError(request.is_chat ? "messages" : "prompt",
                         "prompt " + shown(json(text)) + " has no tokens (the model adds no BOS)");
  }
  const bool cut = truncate_prompt(request, format, out.prompt);
  if (truncated != nullptr) *truncated = cut;
  // max_tokens 0: the engine runs the prompt (echo's logprobs come with a first token) and its one
  // token is not reported (as vLLM serves it).
  out.max_tokens = request.max_tokens == 0 ? 1 : request.max_tokens;
  out.min_tokens = request.min_tokens;
  out.sampling = request.sampling;
  out.sampling.seed = request.seed.value_or(random_seed);
  out.logprobs = request.logprobs;
  // echo with logprobs and prompt_logprobs: the prompt tokens' logprobs (the engine then computes
  // the whole prompt), with the top alternatives of whichever asks for more.
  out.prompt_logprobs = request.prompt_logprobs;
  if (request.echo && request.logprobs >= 0) out.prompt_logprobs = std::max(out.prompt_logprobs, request.logprobs);
  for (const auto& [id, bias] : out.sampling.logit_bias)
    if (id >= n_vocab)
      throw RequestError("logit_bias", "logit_bias token id " + std::to_string(id) + " is outside the vocabulary (" +
                                           std::to_string(n_vocab) + " tokens)");
  if (!request.ignore_eos) {
    out.stop_ids = format.stop_ids;
    if (request.is_chat && format.end_of_turn_id && !tok.is_eog(*format.end_of_turn_id))
      out.stop_ids.push_back(*format.end_of_turn_id);
  }
  // stop_token_ids end generation with ignore_eos too (vLLM: it ignores EOS alone).
  for (size_t i = 0; i < request.stop_token_ids.size(); ++i) {
    const int32_t id = request.stop_token_ids[i];
    if (id >= n_vocab)
      throw RequestError("stop_token_ids", "stop_token_ids[" + std::to_string(i) + "] = " + std::to_string(id) +
                                               " is outside the vocabulary (" + std::to_string(n_vocab) + " tokens)");
    out.stop_ids.push_back(id);
  }
  out.stop = request.stop;
  out.include_stop_str_in_output = request.include_stop_str_in_output;
  out.skip_special_tokens = request.skip_special_tokens;
  for (size_t i = 0; i < request.allowed_token_ids.size(); ++i)
    if (request.allowed_token_ids[i] >= n_vocab)
      throw RequestError("allowed_token_ids", "allowed_token_ids[" + std::to_string(i) + "] = " +
                                                  std::to_string(request.allowed_token_ids[i]) +
                                                  " is outside the vocabulary (" + std::to_string(n_vocab) + " tokens)");
  out.allowed_token_ids = request.allowed_token_ids;
  out.bad_words = bad_word_ids(request.bad_words, tok);
  if (request.use_beam_search) {
    out.beam.beam_width = request.beam_width();
    out.beam.n_best = request.n;
    out.beam.length_penalty = request.length_penalty;
    out.beam.early_stopping = request.early_stopping;
  }
  if (request.constraint) {
    if (!format.grammars) throw RequestError(request.constraint_param, "structured output needs the model's tokenizer");
    try {
      out.grammar = format.grammars->get(*request.constraint);
    } catch (const grammar::GrammarError& e) {
      throw RequestError(request.constraint_param, request.constraint_param + ": " + e.what() + " (" + e.keyword() + ")");
    }
  }
  return out;
}

}  // namespace kestrel::cli
