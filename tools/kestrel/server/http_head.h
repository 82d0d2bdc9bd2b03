// What the server decides from a request head alone, before it reads the body: the route, the
// method, the API key, the body's media type, encoding and length, and the header limits. Pure
// functions of the head (no I/O), so they can be tested and fuzzed on their own.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace kestrel::cli {

// The HTTP layer's limits and deadlines (flags of `kestrel serve`; defaults as uvicorn/vLLM).
struct HttpLimits {
  size_t max_header_bytes = 16 * 1024;  // request line + header fields; more: 431
  size_t max_header_count = 100;        // header fields; more: 431
  uint64_t max_body_bytes = 8 << 20;    // request body; more: 413 (checked from Content-Length first)
  // --timeout-request-head, --timeout-request-body, --timeout-keep-alive, --timeout-write:
  std::chrono::milliseconds head_timeout{10'000};       // whole request head, from its first byte (408)
  std::chrono::milliseconds body_timeout{30'000};       // whole request body, from the end of the head (408)
  std::chrono::milliseconds keep_alive_timeout{5'000};  // idle between requests on one connection (closed)
  std::chrono::milliseconds write_timeout{30'000};      // one write to a client that stopped reading (closed)
};

enum class Route {
  Completions,      // POST /v1/completions
  ChatCompletions,  // POST /v1/chat/completions
  Models,           // GET /v1/models
  Model,            // GET /v1/models/{id}
  Health,           // GET /health
  Metrics,          // GET /metrics
  Tokenize,         // POST /tokenize (vLLM's shape)
  Detokenize,       // POST /detokenize
  TokenizerInfo,    // GET /tokenizer_info
  KvTransfer,       // GET /v1/kv_transfer/{remote_request_id}: a producer's held K/V (kv_transfer_config.h)
  KvTransferIpc,    // GET /v1/kv_transfer/{remote_request_id}/cuda_ipc: their CUDA IPC handles, kept held
  KvRelease,        // DELETE /v1/kv_transfer/{remote_request_id}: the consumer has copied them
};

// An error the HTTP layer answers itself, as an OpenAI error body {"error": {message, type, param,
// code}} with this status.
struct HttpError {
  int status = 400;
  std::string message;  // what was wrong, naming the header or limit
  std::string code;     // OpenAI-style code ("" -> null)
  std::string type = "invalid_request_error";
  std::string allow;    // 405: the Allow header's value
};

// The parts of a request head the checks read (views into the parsed head).
struct HeadFields {
  std::string_view method;  // as sent ("POST")
  std::string_view target;  // request-target ("/v1/completions?x=1" or "http://host/v1/completions")
  unsigned version = 11;    // 10 or 11 are served (major * 10 + minor)
  std::string_view host;    // the first Host field's value; "" when absent
  size_t host_count = 0;    // Host fields in the head
  std::string_view content_type, content_encoding, authorization;  // "" when absent
  std::string_view transfer_encoding;       // "" when absent (Beast refuses two such fields itself)
  bool has_transfer_encoding = false;       // the field is present (its value may be empty)
  size_t authorization_count = 0;           // Authorization fields in the head
  std::optional<uint64_t> content_length;  // absent: none or chunked
  bool chunked = false;                    // Transfer-Encoding: chunked
  size_t header_count = 0;
};

struct HeadDecision {
  Route route = Route::Health;
  std::string model_id;  // Route::Model and the Route::Kv* routes: the {id} part
  std::optional<HttpError> error;  // set: answer it and close; the route is then meaningless
};

// Checks in this order: HTTP version (505 unless 1.0 or 1.1); Transfer-Encoding (400 when present
// with an empty value or with chunked listed more than once, RFC 9112 6.1; 501 unless absent or
// exactly "chunked": RFC 9112 6.3, a request whose final coding is not chunked cannot be framed,
// and reading its body as empty would take the body for the next request); header count (431);
// more than one Authorization field (400: which credential counts would be a guess);
// Host (400, RFC 9112 3.2: none in an HTTP/1.1 request, more than one, or a value that is not a
// uri-host[:port]); target (400 unless origin-form or absolute-form, see target_path) and route
// (404); API key on /v1/* when api_key is not empty (401, RFC 7235 credentials: scheme "Bearer" in
// any case, one or more spaces or tabs, the key compared in constant time); method (405 with Allow;
// HEAD is allowed wherever GET is, RFC 9110 9.3.2); the body length on every route (413 over the
// limit); for routes with a JSON body: Content-Encoding (415, any but "identity") and Content-Type
// (415 unless absent or exactly application/json, parameters allowed).
HeadDecision check_head(const HeadFields& head, const HttpLimits& limits, const std::string& api_key);

// The path a request-target routes by, without its query: the target itself in origin-form
// ("/v1/models?x" -> "/v1/models"); in absolute-form (RFC 9112 3.2.2, which a server MUST accept)
// the path of an http or https URI whose authority is a valid host[:port] ("http://h:8000/health"
// -> "/health"; an empty path is "/"). nullopt for anything else (authority-form, asterisk-form,
// another scheme, userinfo in the authority). The result views `target` (or a literal "/").
std::optional<std::string_view> target_path(std::string_view target);

// True when `content_type` is absent or its media type is exactly application/json (RFC 9110
// 8.3.1: case-insensitive type/subtype, optional parameters after ';').
bool is_json_media_type(std::string_view content_type);

// The key of an RFC 7235 "Bearer <token>" credential (scheme case-insensitive, any run of spaces
// or tabs after it, trailing whitespace ignored); nullopt for another scheme or none.
std::optional<std::string_view> bearer_token(std::string_view authorization);

// Compares without an early exit, so the time taken does not tell how much of a key matched.
bool same_secret(std::string_view a, std::string_view b);

}  // namespace kestrel::cli
