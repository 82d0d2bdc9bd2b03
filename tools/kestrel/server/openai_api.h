// The OpenAI response objects the server writes: completions ("text_completion") and chat
// ("chat.completion", "chat.completion.chunk"), their logprobs, usage, server-sent event framing
// and error bodies. Pure functions of native values; the HTTP layer (http_server.cpp) sends them.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/engine.h"
#include "openai_request.h"
#include "sampling/logprobs.h"
#include "tokenizer/tokenizer.h"

namespace kestrel::cli {

// What every object of one response shares.
struct ResponseHeader {
  std::string id;      // "cmpl-..." or "chatcmpl-..."
  int64_t created = 0; // Unix seconds
  std::string model;   // the served model name
  bool chat = false;
};

// {"error": {"message", "type", "param", "code"}}; param and code are null when empty.
Json error_body(const std::string& message, const std::string& type = "invalid_request_error",
                const std::string& param = "", const std::string& code = "");

// A fresh id with the prefix ("cmpl-", "chatcmpl-"): 24 random hex digits.
std::string new_response_id(const char* prefix);

// The tokens of one output whose logprobs are reported: every sampled token, a final stop id (EOS,
// end of turn) included, as OpenAI and vLLM list them (lm-evaluation-harness reads the last
// entry as the answer's last token); empty when the request did not ask for logprobs.
struct LoggedTokens {
  std::vector<int32_t> ids;
  std::vector<LogprobSummary> logprobs;  // [ids.size()]
};
LoggedTokens logged_tokens(const RequestOutput& output);

// Completions logprobs: {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}.
// *text_offset: characters of the choice's text before the first token; advanced past these tokens.
// Special tokens (a final EOS, an end of turn) are listed but add no characters: the output text
// leaves them out (the engine decodes with skip_special).
Json completion_logprobs(const Tokenizer& tokenizer, const LoggedTokens& tokens, int64_t* text_offset);
// Completions logprobs of an echoed prompt (echo with logprobs): every prompt token, the first with
// null logprob and top_logprobs (nothing precedes it), the others with prompt_logprobs[i - 1]
// (Request::prompt_logprobs). echo_text: the echoed prompt as the response returns it
// (prompt_text: the text as given, or the ids decoded with their special tokens). Each token's
// text_offset is where its text starts in echo_text (plus *text_offset on entry); a token whose
// text is not there (a BOS the server added to a text prompt) adds no characters. *text_offset
// ends advanced past echo_text's characters that the tokens covered. Tokens (and the alternatives
// in top_logprobs) are listed as the prompt decodes: the first word's token without the leading
// space SentencePiece gave it ("Once", not " Once"), as the text it covers has none.
Json echo_logprobs(const Tokenizer& tokenizer, std::span<const int32_t> prompt,
                   std::span<const LogprobSummary> prompt_logprobs, std::string_view echo_text,
                   int64_t* text_offset);
// vLLM's prompt_logprobs: one entry per prompt token, null for the first (nothing precedes it) and
// for any position without logprobs (prompt_logprobs[i - 1] scores token i), else
// {"<token id>": {"logprob", "rank", "decoded_token"}}: the prompt token first, with its rank in
// the vocabulary, then the n_top likeliest alternatives (ranks 1..n_top; one already listed is not
// repeated). decoded_token is the token's own text.
Json prompt_logprobs_json(const Tokenizer& tokenizer, std::span<const int32_t> prompt,
                          std::span<const LogprobSummary> prompt_logprobs, int32_t n_top);
// Appends the entries of completions logprobs object `more` to `into` (a null `into` becomes `more`).
void append_completion_logprobs(Json& into, const Json& more);
// Chat logprobs: {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}.
Json chat_logprobs(const Tokenizer& tokenizer, const LoggedTokens& tokens);

Json usage_json(int64_t prompt_tokens, int64_t completion_tokens);

// One streamed chunk of one choice. Completions: {"text", "logprobs", "finish_reason"}; chat:
// {"delta": {"role"?, "content"?}, "logprobs", "finish_reason"}; the last chunk of a choice (the
// one with its finish_reason) also has "stop_reason". with_usage_null adds "usage": null
// (stream_options.include_usage: every chunk but the last has it).
struct ChunkChoice {
  int32_t index = 0;
  std::optional<std::string> text;           // chat: the delta's content, absent for {} deltas
  bool role = false;                         // chat: the first chunk of a choice names the role
  Json logprobs;                             // null or a logprobs object
  std::optional<std::string> finish_reason;  // null until the last chunk of the choice
  Json stop_reason;                          // vLLM's, written with finish_reason (stop_reason_json)
  std::optional<double> cumulative_logprob;  // beam search: the beam's sum of log-probabilities (vLLM's name)
};
Json stream_chunk(const ResponseHeader& h, const ChunkChoice& c, bool with_usage_null);
// The last chunk of an include_usage stream: "choices": [] and the usage.
Json usage_chunk(const ResponseHeader& h, const Json& usage);

// A finished choice of a non-streamed response.
struct FinalChoice {
  int32_t index = 0;
  std::string text;
  Json logprobs;  // null or a logprobs object
  Json prompt_logprobs;  // completions: vLLM's prompt_logprobs (prompt_logprobs_json); absent when null
  std::string finish_reason;
  Json stop_reason;  // vLLM's: the stop string or stop token id that ended the choice, else null
  // Beam search and best_of: the choice's sum of token log-probabilities (natural log), as vLLM's
  // CompletionOutput names it; absent otherwise.
  std::optional<double> cumulative_logprob;
};
Json full_response(const ResponseHeader& h, const std::vector<FinalChoice>& choices, const Json& usage);

// "data: <compact JSON>\n\n" (invalid UTF-8 replaced by U+FFFD; nothing ever breaks the framing).
std::string sse_event(const Json& j);
inline constexpr const char* kSseDone = "data: [DONE]\n\n";
// Compact JSON with invalid UTF-8 replaced by U+FFFD.
std::string dump(const Json& j);

}  // namespace kestrel::cli
