// The OpenAI request fields shared by `kestrel batch` and `kestrel serve`: a JSON object -> a
// validated request (OpenAI field names and meanings, errors naming the field) -> engine Requests.
// The engine itself never sees JSON (docs/architecture.md: only the server and the tools know it).
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "engine/engine.h"
#include "model/llama_weights.h"
#include "sampling/grammar/constraint.h"
#include "sampling/sampling_params.h"
#include "template/jinja.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace kestrel::cli {

// JSON objects that keep their key order (result lines start with "id", responses with "id").
using Json = nlohmann::ordered_json;
// Request bodies keep their keys in the order written, as Python's json.loads does: a JSON schema's
// properties are generated in the schema's order (OpenAI's structured outputs, vLLM), and tool
// schemas reach the chat template as the client wrote them. parse_request_body builds objects in
// time linear in the body (BoundedBuilder's per-object key index), not by ordered_json's insert,
// which scans an object's keys for each new one.
using RequestJson = nlohmann::ordered_json;

// A request that cannot be served as given. param names the field at fault as OpenAI error bodies
// do ("temperature", "messages[1].content"), "" when no single field is; the message names the
// field and shows the bad value.
class RequestError : public Error {
 public:
  RequestError(std::string param, const std::string& message) : Error(message), param_(std::move(param)) {}
  const std::string& param() const { return param_; }

 private:
  std::string param_;
};

// Which endpoint's rules apply. Batch: prompt or messages, n = 1, no logprobs/echo/stream, default
// max_tokens 256. Completions (/v1/completions): prompt; Chat (/v1/chat/completions): messages;
// both with n, logprobs, stream, and no max_tokens default (until the context ends).
enum class RequestApi { Batch, Completions, Chat };

inline constexpr int64_t kBatchDefaultMaxTokens = 256;
inline constexpr size_t kMaxStopStrings = 4;  // OpenAI's limit for `stop`
inline constexpr int32_t kMaxN = 128;         // choices per request at most
inline constexpr int32_t kMaxLogprobs = 20;   // top alternatives per token at most (OpenAI chat's limit)
inline constexpr size_t kMaxChoices = 2048;   // prompts x n in one completions request at most
inline constexpr size_t kMaxBadWords = 128;   // bad_words strings at most (each is tokenized twice)

// What a request body may hold; parse_request_body enforces it while parsing, so a body beyond a
// limit costs no more than the limit.
struct JsonLimits {
  int max_depth = 64;             // nesting levels of arrays/objects (the body's own object is level 1)
  size_t max_keys = 65536;        // object keys in the whole body
  size_t max_values = 1 << 20;    // JSON values in the whole body (containers included)
};

// Parses a request body (RFC 8259 JSON, UTF-8) with nlohmann's iterative SAX parser and a handler
// that counts depth, keys and values as they arrive and builds the value in time linear in the
// body (nothing recurses once per nesting level; a repeated key's last value wins). Throws
// RequestError (param "") whose message names the limit and its value ("the request body nests
// arrays and objects deeper than 64 levels (the nesting limit)"), or "invalid JSON body: <parser
// message>".
RequestJson parse_request_body(std::string_view body, const JsonLimits& limits = {});

// JSON text inside a request (a tool call's `arguments`) parsed as parse_request_body parses a
// body, into an ordered_json that keeps the keys in the order written (as Python's json.loads
// does; a template's tojson shows that order). A repeated key keeps its first place and its last
// value. Returns nullopt when text is not JSON (a raw NUL byte included); throws RequestError
// (param) "<subject> has more than 65536 object keys (the key limit)" and the like past a limit.
std::optional<Json> parse_ordered_json(std::string_view text, const std::string& param, const std::string& subject,
                                       const JsonLimits& limits = {});

// A completions prompt: text (tokenized with the model's BOS), or token ids used as given.
struct PromptInput {
  std::string text;                         // when !ids
  std::optional<std::vector<int32_t>> ids;  // when the prompt was given as token ids
};

// A request after JSON validation, before tokenization. Sampling defaults are the OpenAI / vLLM
// ones: temperature 1, top_p 1, top_k off, min_p off, no penalties.
struct OpenAiRequest {
  bool is_chat = false;               // messages (chat template) rather than prompt
  // When !is_chat: completions, one or more (OpenAI's batched `prompt`: a list of strings or a list
  // of token-id lists; a string or a flat token-id list is one prompt); batch, exactly one. Chat:
  // empty (messages instead).
  std::vector<PromptInput> prompts;
  std::vector<ChatMessage> messages;  // when is_chat; at least one
  // The same messages as the chat template sees them (chat_request.h: content flattened to a
  // string; name, tool_calls, tool_call_id when given).
  Json messages_json;
  Json tools;                         // the template's `tools` (tool_choice "none"); null when not given
  // Chat: more variables for the model's Jinja chat template (vLLM's chat_template_kwargs, e.g.
  // {"enable_thinking": false}), overriding the ones it is given (transformers' apply_chat_template
  // kwargs); an object, or null when not given.
  Json chat_template_kwargs;
  // Chat: whether the template ends the prompt with the assistant's turn opening (vLLM's and
  // transformers' add_generation_prompt; a key of the same name in chat_template_kwargs wins).
  bool add_generation_prompt = true;
  // Chat: the messages rendered by the chat template (render_chat with tools and
  // chat_template_kwargs), when the caller has rendered them already (the server does, to check the
  // prompt's size first); to_engine_request renders them when empty.
  std::optional<std::string> chat_prompt;
  // >= 1, or -1 (JSON null, or absent for the server): until max_model_len. Completions also take
  // 0 (OpenAI's legacy API): nothing is generated, the choice is the echo (if any) with
  // finish_reason "length"; the engine still runs the prompt (for echo's logprobs), with one token
  // that is not reported.
  int64_t max_tokens = kBatchDefaultMaxTokens;
  bool max_tokens_given = false;      // the client set max_tokens / max_completion_tokens to a number
  // vLLM's min_tokens (Request::min_tokens): in [0, max_tokens] (max_tokens' default in batch).
  int64_t min_tokens = 0;
  // vLLM's stop_token_ids: more ids that end generation as EOS does (also with ignore_eos), their
  // text left out; checked against the vocabulary by to_engine_request.
  std::vector<int32_t> stop_token_ids;
  // vLLM's prompt_logprobs (server only, not streamed): the logprob of every prompt token after the
  // first plus this many top alternatives; -1: none.
  int32_t prompt_logprobs = -1;
  SamplingParams sampling;            // validated; its seed is filled in by to_engine_request
  std::optional<uint64_t> seed;       // absent: a random seed per request
  std::vector<std::string> stop;      // at most kMaxStopStrings, none empty
  // vLLM's output fields (Request's): include_stop_str_in_output, skip_special_tokens, and
  // spaces_between_special_tokens, validated but needing no action: kestrel's decoder writes a
  // special token's text with no space around it, as vLLM's fast (tokenizers) detokenizer does for
  // a byte-level BPE vocabulary with either value (false strips only a space the tokenizer's
  // decoder put before a special token that follows another).
  bool include_stop_str_in_output = false;
  bool skip_special_tokens = true;
  bool spaces_between_special_tokens = true;
  // vLLM's allowed_token_ids (not empty when given; checked against the vocabulary by
  // to_engine_request) and bad_words (at most kMaxBadWords, each with a non-space character;
  // tokenized by to_engine_request as vLLM's SamplingParams.update_from_tokenizer does).
  std::vector<int32_t> allowed_token_ids;
  std::vector<std::string> bad_words;
  // vLLM's truncate_prompt_tokens: 0 (absent or null): none; N >= 1: only the prompt's last N tokens
  // are kept (left truncation, after the chat template for chat); -1: the last max_model_len.
  int64_t truncate_prompt_tokens = 0;
  bool ignore_eos = false;            // no stop ids at all (neither EOS nor end of turn)
  int32_t n = 1;                      // choices (server only)
  int32_t logprobs = -1;              // -1: none; else the chosen token's logprob plus this many top ones
  bool echo = false;                  // completions: the prompt text comes first in the output
  bool stream = false;                // server-sent events
  bool include_usage = false;         // stream_options.include_usage: a last chunk with usage
  std::string model;                  // "" when absent
  // Structured output: the one constraint asked for by response_format (json_object,
  // json_schema), structured_outputs / guided_json / guided_regex / guided_choice / guided_grammar
  // (vLLM), or grammar / json_schema (llama.cpp); constraint_param names the field it came from.
  std::optional<grammar::Constraint> constraint;
  std::string constraint_param;
  // Beam search (vLLM's use_beam_search): beam width best_of if given, else n; n beams returned
  // (batch: the best one). length_penalty and early_stopping as transformers' generate takes them.
  // Beams rank the model's raw log-probabilities: sampling fields other than their neutral values
  // (temperature 0 or absent, top_p 1, top_k and min_p off, no penalties, no logit_bias) are
  // refused, and so are stop strings, logprobs and structured output.
  bool use_beam_search = false;
  int32_t best_of = 0;  // 0: not given. Without beam search (completions): the best n of best_of sampled choices by cumulative logprob
  double length_penalty = 1.0;
  EarlyStopping early_stopping = EarlyStopping::Heuristic;
  // The beam width of a beam-search request (0 otherwise).
  int32_t beam_width() const { return use_beam_search ? (best_of > 0 ? best_of : n) : 0; }
};

// Validates one request object (j must be an object, as parse_request_body returns it). Throws
// RequestError naming the field for a missing field, a wrong type or an out-of-range value (NaN and
// infinities are not JSON, so they arrive as huge numbers or strings and are rejected as such).
// Unknown fields are ignored. Fields asking for what the server does not do are refused (vLLM's
// answers where it has them): response_format type structural_tag, best_of below n (or above it
// for chat without beam search, or streamed), a completions `suffix`, tool_choice other than
// "none" (chat_request.h), prompt_logprobs streamed or in a batch line, speculative_config (a
// setting of the server or batch run, --speculative-config, not of one request), and a priority
// other than 0 (vLLM's answer when its scheduling policy is not "priority": kestrel's scheduler
// serves requests in arrival order).
OpenAiRequest parse_openai_request(const RequestJson& j, RequestApi api);

// Fields parse_openai_request reads for this API, plus OpenAI fields that change nothing here (for
// the batch command's unknown-field warnings).
bool is_known_field(const std::string& key, RequestApi api);

// The value as it was written, short enough for a message (cut at a UTF-8 character boundary).
// Writes at most about that much, whatever the value's size or depth (no recursion).
std::string shown(const RequestJson& v);

// What turning a request into prompt tokens needs from the loaded model.
struct PromptFormat {
  const Tokenizer* tokenizer = nullptr;
  int32_t n_vocab = 0;                    // the model's; may exceed the tokenizer's (padded embedding rows)
  ChatTemplate chat_template;             // the recognised family: end of turn; the format when the model has no template
  std::string template_source;            // the model's Jinja chat template ("" when it has none)
  std::shared_ptr<const jinja::Template> jinja_template;  // template_source parsed, when it parses
  std::string template_error;             // why template_source does not parse ("" when it does)
  std::string bos_token, eos_token;       // their text, for the template
  std::vector<int32_t> stop_ids;          // the tokenizer's end-of-generation ids
  std::optional<int32_t> end_of_turn_id;  // the chat template's end-of-turn token, when it is one token
  std::shared_ptr<grammar::GrammarCache> grammars;  // structured-output grammars on this tokenizer's vocabulary
  // The engine's context per sequence (EngineConfig::max_model_len) for truncate_prompt_tokens; 0:
  // unknown (truncate_prompt_tokens is then not checked against it, and -1 keeps the whole prompt).
  int64_t max_model_len = 0;

  // True when text starts with the BOS text: a chat template that writes it itself (Llama 2 and 3,
  // Mistral) must not get a second one from the tokenizer.
  bool starts_with_bos(std::string_view text) const {
    return !bos_token.empty() && text.substr(0, bos_token.size()) == bos_token;
  }

  // The chat template of the model (LlamaModel::chat_template), parsed once; a template that does
  // not parse is kept as template_error (chat requests then get it as their error).
  static PromptFormat for_model(const LlamaModel& model, const Tokenizer& tokenizer);
};

// vLLM's stop_reason. reported_stop_ids: the request's stop_token_ids whose id is reported, that is
// all of them less the model's end-of-generation ids (format.stop_ids, and for chat the end-of-turn
// token), which vLLM takes for EOS (stop_reason null) unless ignore_eos. stop_reason_json: for an
// output that finished with "stop", the stop string that matched, or the stop id sampled when it is
// one of those; null otherwise (EOS, a grammar's end, "length", ...).
std::vector<int32_t> reported_stop_ids(const OpenAiRequest& request, const PromptFormat& format);
Json stop_reason_json(const RequestOutput& o, std::span<const int32_t> reported_stop_ids);

// The text of prompt prompt_index of a completions request, for echo: the string as given, or the
// token ids decoded with their special tokens ("<s>Once upon a time").
std::string prompt_text(const OpenAiRequest& request, const Tokenizer& tokenizer, size_t prompt_index = 0);

// Tokenizes prompt prompt_index (which must be below request.prompts.size(); RequestError
// otherwise), or for chat the messages through render_chat (BOS as the model wants it; special-token
// text such as <|im_start|> is parsed, as `kestrel generate` and `kestrel chat` do), and fills in
// logprobs, stop ids and the seed (random_seed when the request has none). Throws RequestError for
// a prompt with no tokens, a token id or a logit_bias id outside the model's vocabulary, a chat
// template error, or a structured-output constraint that does not compile (param: its field; the
// message names the keyword or construct), a stop_token_ids or allowed_token_ids id outside the
// vocabulary, a bad word with no tokens, or truncate_prompt_tokens above format.max_model_len; the
// engine's add_request checks the rest. truncate_prompt_tokens applies to the tokenized prompt;
// *truncated (when given) tells whether it cut tokens.
// A chat request's messages in the model's chat template with the request's own inputs (tools,
// chat_template_kwargs, add_generation_prompt). Errors: the template's (render_chat).
std::string render_chat_prompt(const OpenAiRequest& request, const PromptFormat& format);

Request to_engine_request(const OpenAiRequest& request, const PromptFormat& format, uint64_t random_seed,
                          size_t prompt_index = 0, bool* truncated = nullptr);

}  // namespace kestrel::cli
