// The JSON side of `kestrel batch`: one input line -> a validated request (openai_request.h, the
// fields the server reads too) -> an engine Request; an engine result -> one output line.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "engine/engine.h"
#include "openai_request.h"

namespace kestrel::cli {

// A request line after JSON validation (prompt or messages, OpenAI sampling fields).
using BatchRequest = OpenAiRequest;
inline constexpr size_t kBatchMaxStopStrings = kMaxStopStrings;

// A parsed line: a request, or the error to report for it. The id is known even for most errors.
struct BatchLine {
  Json id;                               // the line's "id" (string or number) as given, else the line index
  std::optional<BatchRequest> request;   // set exactly when error is empty
  std::string error;                     // names the field and the bad value
  std::vector<std::string> unknown_fields;  // ignored keys, for a warning
};

// True for a line of only whitespace (such lines are skipped, not counted as requests).
bool is_blank_line(std::string_view line);

// Parses one line of the input file. line_index is 0-based (the id when the line has none). Never
// throws for bad input: every problem ends up in BatchLine::error.
BatchLine parse_batch_line(std::string_view line, int64_t line_index);

// Everything one request produced, gathered over the engine's steps.
struct BatchResult {
  std::vector<int32_t> output_ids;  // every new token, stop ids included
  std::string text;                 // the text deltas joined (stop strings cut off)
  std::string finish_reason;        // "stop", "length" or "abort"
  Json stop_reason;                 // vLLM's: the stop string or stop token id that ended it, else null
  RequestMetrics metrics;
  std::optional<double> cumulative_logprob;  // beam search: the best beam's (output_ids and text are its)
};

// {"id", "output_ids", "text", "finish_reason", "stop_reason", "usage": {"prompt_tokens", "completion_tokens",
// "total_tokens", "cached_tokens"}, "ttft_ms", "tpot_ms"}, and with beam search "cumulative_logprob"
Json result_json(const Json& id, const BatchResult& result);
// {"id", "error": {"message", "line"}}; line is 1-based, as editors count.
Json error_json(const Json& id, const std::string& message, int64_t line_number);
// One output line: compact JSON, invalid UTF-8 replaced by U+FFFD, then "\n".
std::string to_json_line(const Json& j);

}  // namespace kestrel::cli
