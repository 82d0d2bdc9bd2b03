// libFuzzer target: bytes as a client would send them -> Boost.Beast's request parser with the
// server's limits (tools/kestrel/server/http_parse.h) -> the head checks (http_head.h) -> the body
// with its limit -> end of stream, with the line-ending check the session makes before the head
// and on what a chunked body's parser holds back. Only the documented answers may come out: a parse
// error maps to 400/408/413/431 (or none, for a closed connection), a head to a route or 400/401/
// 404/405/413/415/431/501/505; a decision that lets a request through must agree with the limits it
// claims to enforce (one Host, or none in HTTP/1.0; HEAD only where GET is routed, never on the KV pull).
#include <boost/asio/buffer.hpp>
#include <boost/beast/http/error.hpp>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "server/http_head.h"
#include "server/http_parse.h"

using namespace kestrel::cli;

namespace {
void require(bool ok) {
  if (!ok) std::abort();
}

void check_error(const HttpError& e) {
  require(e.status == 400 || e.status == 401 || e.status == 404 || e.status == 405 || e.status == 408 ||
          e.status == 413 || e.status == 415 || e.status == 431 || e.status == 501 || e.status == 505);
  require(!e.message.empty() && !e.code.empty());
  require((e.status == 405) == !e.allow.empty());
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  HttpLimits limits;
  limits.max_body_bytes = 4096;  // small, so that the body limit is reached too
  limits.max_header_bytes = 2048;
  const std::string api_key = size > 0 && (data[0] & 1) ? "k3y" : "";
  RequestParser parser;
  configure_parser(parser, limits);
  boost::beast::error_code ec;
  const auto* p = reinterpret_cast<const char*>(data);
  if (auto e = check_line_endings(std::string_view(p, size), false)) {
    check_error(*e);
    require(e->status == 400);
    return 0;
  }
  size_t used = parser.put(boost::asio::buffer(p, size), ec);
  if (ec == boost::beast::http::error::need_more) {
    // The client closed with the head incomplete (as Beast's read reports it: end_of_stream
    // before the first byte, else partial_message).
    ec = boost::beast::http::error::end_of_stream;
    if (parser.got_some()) parser.put_eof(ec);
    if (ec) {
      if (auto e = parse_error(ec, limits, false)) check_error(*e);
    }
    return 0;
  }
  if (ec) {
    if (auto e = parse_error(ec, limits, false)) check_error(*e);
    return 0;
  }
  require(parser.is_header_done());
  const HeadFields f = head_fields(parser);
  const HeadDecision d = check_head(f, limits, api_key);
  if (d.error) {
    check_error(*d.error);
    return 0;
  }
  require(f.header_count <= limits.max_header_count && (f.version == 10 || f.version == 11));
  // A body is framed by Content-Length or by chunked alone: anything else was answered 501.
  require(f.transfer_encoding.empty() || f.chunked);
  // Beast's body reader reserves Content-Length bytes: a head let through never asks for more.
  require(!f.content_length || *f.content_length <= limits.max_body_bytes);
  const bool json_route = d.route == Route::Completions || d.route == Route::ChatCompletions ||
                          d.route == Route::Tokenize || d.route == Route::Detokenize;
  if (json_route) {
    require(is_json_media_type(f.content_type));
  }
  const auto path = target_path(f.target);
  require(path.has_value() && !path->empty() && path->front() == '/');
  if (!api_key.empty() && path->substr(0, 4) == "/v1/") require(bearer_token(f.authorization).has_value());
  require(f.host_count == 1 || (f.host_count == 0 && f.version == 10));
  const bool get_route = d.route == Route::Models || d.route == Route::Model || d.route == Route::Health ||
                         d.route == Route::Metrics || d.route == Route::TokenizerInfo;
  // The KV pulls are GET alone: the host pull hands the held blocks over once, so a HEAD would
  // lose them; the release is DELETE.
  const bool kv_pull = d.route == Route::KvTransfer || d.route == Route::KvTransferIpc;
  require(f.method == (get_route || kv_pull ? "GET" : d.route == Route::KvRelease ? "DELETE" : "POST") ||
          (get_route && f.method == "HEAD"));
  limit_body(parser, limits);
  parser.eager(true);
  while (!ec && !parser.is_done() && used < size) {
    const size_t n = parser.put(boost::asio::buffer(p + used, size - used), ec);
    used += n;
    if (ec == boost::beast::http::error::need_more) {
      ec = {};
      if (parser.chunked()) {
        if (auto e = check_line_endings(std::string_view(p + used, size - used), true)) {
          check_error(*e);
          require(e->status == 400);
          return 0;
        }
      }
      if (n == 0) break;
    }
  }
  if (!ec && !parser.is_done()) parser.put_eof(ec);  // got_some: the head is in
  if (ec) {
    if (auto e = parse_error(ec, limits, true)) check_error(*e);
    return 0;
  }
  require(parser.get().body().size() <= limits.max_body_bytes);
  return 0;
}
