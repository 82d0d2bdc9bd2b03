// The JSON side of `kestrel batch`: one input line -> a validated request (OpenAI field names and
// meanings) -> an engine Request; an engine result -> one output line. The engine itself never
// sees JSON (docs/architecture.md: only the server and the tools know it).
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "engine/engine.h"
#include "model/llama_weights.h"
#include "sampling/sampling_params.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace kestrel::cli {

// JSON objects that keep their key order, so every output line starts with "id".
using Json = nlohmann::ordered_json;

// One max_tokens default for prompt and messages requests alike (the OpenAI completions API says
// 16, chat says "until the context ends"; neither suits an offline batch).
inline constexpr int64_t kBatchDefaultMaxTokens = 256;
inline constexpr size_t kBatchMaxStopStrings = 4;  // OpenAI's limit for `stop`

// A request line after JSON validation, before tokenization. Sampling defaults are the OpenAI /
// vLLM ones: temperature 1, top_p 1, top_k off, min_p off, no penalties.
struct BatchRequest {
  bool is_chat = false;               // messages (chat template) rather than prompt
  std::string prompt;                 // when !is_chat and prompt_ids is empty
  std::vector<int32_t> prompt_ids;    // a prompt given as token ids (OpenAI completions), used as is
  std::vector<ChatMessage> messages;  // when is_chat; at least one
  int64_t max_tokens = kBatchDefaultMaxTokens;  // >= 1, or -1 (JSON null): until max_model_len
  SamplingParams sampling;            // validated; its seed is filled in by to_engine_request
  std::optional<uint64_t> seed;       // absent: a random seed per request
  std::vector<std::string> stop;      // at most kBatchMaxStopStrings, none empty
  bool ignore_eos = false;            // no stop ids at all (neither EOS nor end of turn)
};

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

// What turning a request into prompt tokens needs from the loaded model.
struct PromptFormat {
  const Tokenizer* tokenizer = nullptr;
  ChatTemplate chat_template;
  std::vector<int32_t> stop_ids;          // the tokenizer's end-of-generation ids
  std::optional<int32_t> end_of_turn_id;  // the chat template's end-of-turn token, when it is one token

  // The chat template of the model (LlamaModel::chat_template, as `kestrel chat` picks it).
  static PromptFormat for_model(const LlamaModel& model, const Tokenizer& tokenizer);
};

// Tokenizes the prompt (BOS as the model wants it; special-token text such as <|im_start|> is
// parsed, as `kestrel generate` and `kestrel chat` do) and fills in stop ids and the seed
// (random_seed when the request has none). Throws kestrel::Error for a prompt with no tokens or a
// logit_bias id outside the vocabulary; the engine's add_request checks the rest.
Request to_engine_request(const BatchRequest& request, const PromptFormat& format, uint64_t random_seed);

// Everything one request produced, gathered over the engine's steps.
struct BatchResult {
  std::vector<int32_t> output_ids;  // every new token, stop ids included
  std::string text;                 // the text deltas joined (stop strings cut off)
  std::string finish_reason;        // "stop", "length" or "abort"
  RequestMetrics metrics;
};

// {"id", "output_ids", "text", "finish_reason", "usage": {"prompt_tokens", "completion_tokens",
// "total_tokens", "cached_tokens"}, "ttft_ms", "tpot_ms"}
Json result_json(const Json& id, const BatchResult& result);
// {"id", "error": {"message", "line"}}; line is 1-based, as editors count.
Json error_json(const Json& id, const std::string& message, int64_t line_number);
// One output line: compact JSON, invalid UTF-8 replaced by U+FFFD, then "\n".
std::string to_json_line(const Json& j);

}  // namespace kestrel::cli
