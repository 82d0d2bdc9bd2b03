#include "server/http_head.h"

#include <algorithm>
#include <array>

namespace kestrel::cli {

namespace {
bool is_ows(char c) { return c == ' ' || c == '\t'; }

std::string_view trim(std::string_view s) {
  while (!s.empty() && is_ows(s.front())) s.remove_prefix(1);
  while (!s.empty() && is_ows(s.back())) s.remove_suffix(1);
  return s;
}

bool iequals(std::string_view a, std::string_view b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
           return std::tolower(static_cast<unsigned char>(x)) == std::tolower(static_cast<unsigned char>(y));
         });
}

// A header value for a message: at most 100 bytes, printable ASCII only.
std::string shown_value(std::string_view v) {
  std::string out;
  for (char c : v.substr(0, 100)) out += (c >= 0x20 && c < 0x7f) ? c : '?';
  if (v.size() > 100) out += "...";
  return out;
}

struct RouteInfo {
  std::string_view path;
  Route route;
  std::string_view method;  // the one allowed
  bool json_body;           // POST routes: a JSON body
};
constexpr std::array<RouteInfo, 8> kRoutes{{
    {"/v1/completions", Route::Completions, "POST", true},
    {"/v1/chat/completions", Route::ChatCompletions, "POST", true},
    {"/v1/models", Route::Models, "GET", false},
    {"/health", Route::Health, "GET", false},
    {"/metrics", Route::Metrics, "GET", false},
    {"/tokenize", Route::Tokenize, "POST", true},
    {"/detokenize", Route::Detokenize, "POST", true},
    {"/tokenizer_info", Route::TokenizerInfo, "GET", false},
}};
constexpr std::string_view kModelPrefix = "/v1/models/";

HeadDecision fail(int status, std::string message, std::string code, std::string type = "invalid_request_error") {
  HeadDecision d;
  d.error = HttpError{status, std::move(message), std::move(code), std::move(type), ""};
  return d;
}
}  // namespace

bool is_json_media_type(std::string_view content_type) {
  std::string_view t = trim(content_type);
  if (t.empty()) return true;
  if (const size_t semi = t.find(';'); semi != std::string_view::npos) t = trim(t.substr(0, semi));
  return iequals(t, "application/json");
}

std::optional<std::string_view> bearer_token(std::string_view authorization) {
  std::string_view a = trim(authorization);
  constexpr std::string_view kScheme = "bearer";
  if (a.size() <= kScheme.size() || !iequals(a.substr(0, kScheme.size()), kScheme) || !is_ows(a[kScheme.size()]))
    return std::nullopt;
  return trim(a.substr(kScheme.size()));
}

bool same_secret(std::string_view a, std::string_view b) {
  unsigned diff = a.size() != b.size();
  const size_t nb = std::max<size_t>(1, b.size());
  for (size_t i = 0; i < a.size(); ++i)
    diff |= static_cast<unsigned char>(a[i]) ^ static_cast<unsigned char>(b.empty() ? 0 : b[i % nb]);
  return diff == 0;
}

HeadDecision check_head(const HeadFields& head, const HttpLimits& limits, const std::string& api_key) {
  if (head.version != 10 && head.version != 11)
    return fail(505,
                "HTTP/" + std::to_string(head.version / 10) + "." + std::to_string(head.version % 10) +
                    " is not supported; send HTTP/1.1 or HTTP/1.0",
                "http_version_not_supported");
  if (!head.transfer_encoding.empty() && !iequals(trim(head.transfer_encoding), "chunked"))
    return fail(501,
                "Transfer-Encoding: " + shown_value(head.transfer_encoding) +
                    " is not supported; send the body with Content-Length or Transfer-Encoding: chunked",
                "unsupported_transfer_encoding");
  if (head.header_count > limits.max_header_count)
    return fail(431,
                "the request has " + std::to_string(head.header_count) + " header fields; at most " +
                    std::to_string(limits.max_header_count) + " are allowed",
                "request_header_fields_too_large");
  std::string_view path = head.target;
  if (path.empty() || path.front() != '/')
    return fail(400, "the request target must be an absolute path such as /v1/completions, got \"" +
                         shown_value(head.target) + "\"",
                "bad_request_target");
  if (const size_t q = path.find('?'); q != std::string_view::npos) path = path.substr(0, q);

  const RouteInfo* info = nullptr;
  HeadDecision d;
  for (const RouteInfo& r : kRoutes)
    if (path == r.path) info = &r;
  static constexpr RouteInfo kModel{kModelPrefix, Route::Model, "GET", false};
  if (info == nullptr && path.size() > kModelPrefix.size() && path.substr(0, kModelPrefix.size()) == kModelPrefix) {
    info = &kModel;
    d.model_id = std::string(path.substr(kModelPrefix.size()));
  }

  // The key guards every /v1/ path (as vLLM does), known or not, so an unknown one tells nothing.
  if (!api_key.empty() && path.substr(0, 4) == "/v1/") {
    const auto token = bearer_token(head.authorization);
    if (!token || !same_secret(*token, api_key))
      return fail(401, "missing or incorrect API key: send the header Authorization: Bearer <key>",
                  "invalid_api_key");
  }
  if (info == nullptr) return fail(404, "no route " + shown_value(head.method) + " " + shown_value(path), "not_found");
  d.route = info->route;
  if (head.method != info->method) {
    HeadDecision e = fail(405,
                          shown_value(head.method) + " is not allowed on " + std::string(info->path) + " (use " +
                              std::string(info->method) + ")",
                          "method_not_allowed");
    e.error->allow = std::string(info->method);
    return e;
  }
  // Every route: the body reader reserves Content-Length bytes up front.
  if (head.content_length && *head.content_length > limits.max_body_bytes)
    return fail(413,
                "the request body has " + std::to_string(*head.content_length) + " bytes; the limit is " +
                    std::to_string(limits.max_body_bytes) + " bytes (--max-body-size)",
                "request_too_large");
  if (!info->json_body) return d;

  if (!head.content_encoding.empty() && !iequals(trim(head.content_encoding), "identity"))
    return fail(415,
                "Content-Encoding: " + shown_value(head.content_encoding) +
                    " is not supported; send the JSON body uncompressed",
                "unsupported_media_type");
  if (!is_json_media_type(head.content_type))
    return fail(415,
                "Content-Type must be application/json, got " + shown_value(head.content_type) +
                    " (curl: -H 'Content-Type: application/json')",
                "unsupported_media_type");
  return d;
}

}  // namespace kestrel::cli
