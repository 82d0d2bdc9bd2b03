#include "batch_request.h"

#include "core/error.h"

namespace kestrel::cli {

namespace {
using json = Json;

// nlohmann's message says "parse error at line 1, column C: ..."; the line is always 1 here and
// would contradict the file line the result reports, so keep the column on. Limit errors stay as
// they are.
std::string json_error_text(const std::string& what) {
  constexpr std::string_view kSyntax = "invalid JSON body: ";
  if (what.rfind(kSyntax, 0) != 0) return what;
  const size_t at = what.find("column ");
  return "invalid JSON: " + (at == std::string::npos ? what.substr(kSyntax.size()) : "at " + what.substr(at));
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
  RequestJson j;
  try {
    j = parse_request_body(line);
  } catch (const RequestError& e) {
    out.error = json_error_text(e.what());
    return out;
  }
  if (!j.is_object()) {
    out.error = std::string("a request must be a JSON object, got ") + j.type_name();
    return out;
  }
  for (const auto& [key, value] : j.items())
    if (!is_known_field(key, RequestApi::Batch)) out.unknown_fields.push_back(key);
  try {
    if (const auto id = j.find("id"); id != j.end() && !id->is_null()) {
      if (!id->is_string() && !id->is_number()) throw Error("id must be a string or a number, got " + shown(*id));
      out.id = id->is_string() ? json(id->get<std::string>()) : json::parse(id->dump());
    }
    out.request = parse_openai_request(j, RequestApi::Batch);
  } catch (const Error& e) {
    out.error = e.what();
  } catch (const RequestJson::exception& e) {  // not expected: every access above checks the type first
    out.error = std::string("bad request: ") + e.what();
  }
  return out;
}

json result_json(const json& id, const BatchResult& result) {
  const RequestMetrics& m = result.metrics;
  json j;
  j["id"] = id;
  j["output_ids"] = result.output_ids;
  j["text"] = result.text;
  j["finish_reason"] = result.finish_reason;
  j["stop_reason"] = result.stop_reason;
  if (result.cumulative_logprob) j["cumulative_logprob"] = *result.cumulative_logprob;
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
