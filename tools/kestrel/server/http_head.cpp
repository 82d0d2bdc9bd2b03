#include "server/http_head.h"

#include <algorithm>
#include <array>
#include <cctype>

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

bool is_digit(char c) { return c >= '0' && c <= '9'; }

// RFC 3986 2.2-2.3: unreserved, sub-delims and '%' (of a pct-encoding): the characters of a reg-name.
bool is_reg_name_char(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) || std::string_view("-._~%!$&'()*+,;=").find(c) != std::string_view::npos;
}

// uri-host [ ":" port ] (RFC 9110 7.2, RFC 3986 3.2.2-3.2.3): an IP-literal in brackets, or a
// reg-name / IPv4 address; the port, when present, digits only. No userinfo ('@').
bool valid_authority(std::string_view a) {
  std::string_view rest;
  if (!a.empty() && a.front() == '[') {
    const size_t close = a.find(']');
    if (close == std::string_view::npos || close == 1) return false;
    for (char c : a.substr(1, close - 1))
      if (!is_reg_name_char(c) && c != ':') return false;
    rest = a.substr(close + 1);
  } else {
    const size_t colon = a.find(':');
    for (char c : a.substr(0, colon))
      if (!is_reg_name_char(c)) return false;
    rest = colon == std::string_view::npos ? std::string_view() : a.substr(colon);
  }
  if (rest.empty()) return true;
  if (rest.front() != ':') return false;
  return std::all_of(rest.begin() + 1, rest.end(), is_digit);
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
    {"/v1/models", Route::Models, "GET", false},  // GET routes answer HEAD too
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

std::optional<std::string_view> target_path(std::string_view target) {
  std::string_view path = target;
  if (path.empty() || path.front() != '/') {
    // absolute-form: "http" or "https" (any case), "://", the authority, then path-abempty.
    const size_t sep = target.find("://");
    if (sep == std::string_view::npos) return std::nullopt;
    const std::string_view scheme = target.substr(0, sep);
    if (!iequals(scheme, "http") && !iequals(scheme, "https")) return std::nullopt;
    const std::string_view rest = target.substr(sep + 3);
    const size_t end = rest.find_first_of("/?");
    const std::string_view authority = rest.substr(0, end);
    // RFC 9110 4.2.1: an http URI with an empty host is invalid.
    if (authority.empty() || authority.front() == ':' || !valid_authority(authority)) return std::nullopt;
    path = end == std::string_view::npos ? std::string_view() : rest.substr(end);
    if (path.empty() || path.front() == '?') return std::string_view("/");
  }
  if (const size_t q = path.find('?'); q != std::string_view::npos) path = path.substr(0, q);
  return path;
}

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
  if (head.has_transfer_encoding && trim(head.transfer_encoding).empty())
    return fail(400, "Transfer-Encoding is empty; send chunked or leave the field out", "bad_transfer_encoding");
  size_t chunked_codings = 0;
  for (std::string_view list = head.transfer_encoding; !list.empty();) {
    const size_t comma = list.find(',');
    if (iequals(trim(list.substr(0, comma)), "chunked")) ++chunked_codings;
    list = comma == std::string_view::npos ? std::string_view() : list.substr(comma + 1);
  }
  if (chunked_codings > 1)
    return fail(400, "chunked is applied more than once in Transfer-Encoding (RFC 9112 6.1 forbids it)",
                "bad_transfer_encoding");
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
  if (head.authorization_count > 1)
    return fail(400,
                "the request has " + std::to_string(head.authorization_count) +
                    " Authorization header fields; send at most one",
                "bad_authorization");
  if (head.host_count > 1)
    return fail(400, "the request has " + std::to_string(head.host_count) + " Host header fields; send exactly one",
                "bad_host");
  if (head.host_count == 0 && head.version == 11)
    return fail(400, "an HTTP/1.1 request needs a Host header field (RFC 9112 3.2)", "bad_host");
  if (!head.host.empty() && !valid_authority(head.host))
    return fail(400, "invalid Host header field \"" + shown_value(head.host) + "\": expected host[:port]",
                "bad_host");
  const auto target = target_path(head.target);
  if (!target)
    return fail(400,
                "the request target must be an absolute path such as /v1/completions or an http URI such as "
                "http://host:8000/v1/completions, got \"" +
                    shown_value(head.target) + "\"",
                "bad_request_target");
  const std::string_view path = *target;

  const RouteInfo* info = nullptr;
  HeadDecision d;
  for (const RouteInfo& r : kRoutes)
    if (path == r.path) info = &r;
  static constexpr RouteInfo kModel{kModelPrefix, Route::Model, "GET", false};
  if (info == nullptr && path.size() > kModelPrefix.size() && path.substr(0, kModelPrefix.size()) == kModelPrefix) {
    info = &kModel;
    d.model_id = std::string(path.substr(kModelPrefix.size()));
  }
  static constexpr std::string_view kKvPrefix = "/v1/kv_transfer/";
  static constexpr RouteInfo kKv{kKvPrefix, Route::KvTransfer, "GET", false};
  static constexpr RouteInfo kKvIpc{kKvPrefix, Route::KvTransferIpc, "GET", false};
  static constexpr RouteInfo kKvRelease{kKvPrefix, Route::KvRelease, "DELETE", false};
  static constexpr std::string_view kIpcSuffix = "/cuda_ipc";
  if (info == nullptr && path.size() > kKvPrefix.size() && path.substr(0, kKvPrefix.size()) == kKvPrefix) {
    std::string_view id = path.substr(kKvPrefix.size());
    info = head.method == "DELETE" ? &kKvRelease : &kKv;
    if (id.size() > kIpcSuffix.size() && id.substr(id.size() - kIpcSuffix.size()) == kIpcSuffix) {
      info = &kKvIpc;
      id.remove_suffix(kIpcSuffix.size());
    }
    d.model_id = std::string(id);
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
  // RFC 9110 9.3.2: HEAD is GET without the body, so GET routes answer it (as Starlette's do); all but
  // the KV pull, which hands the held blocks over once and frees them: a HEAD there would drop them.
  const bool answers_head = info->method == "GET" && info->route != Route::KvTransfer && info->route != Route::KvTransferIpc;
  if (head.method != info->method && !(answers_head && head.method == "HEAD")) {
    const std::string allow = answers_head ? "GET, HEAD" : std::string(info->method);
    HeadDecision e = fail(405, shown_value(head.method) + " is not allowed on " + std::string(info->path) + " (use " +
                                   allow + ")",
                          "method_not_allowed");
    e.error->allow = allow;
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
