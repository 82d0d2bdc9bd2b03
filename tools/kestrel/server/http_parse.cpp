#include "server/http_parse.h"

#include <boost/asio/error.hpp>
#include <boost/beast/http/error.hpp>

#include <iterator>

namespace kestrel::cli {

namespace http = boost::beast::http;

void configure_parser(RequestParser& parser, const HttpLimits& limits) {
  parser.header_limit(static_cast<std::uint32_t>(limits.max_header_bytes));
  parser.body_limit(boost::none);
}

void limit_body(RequestParser& parser, const HttpLimits& limits) { parser.body_limit(limits.max_body_bytes); }

HeadFields head_fields(const RequestParser& parser) {
  const auto& h = parser.get();
  HeadFields f;
  f.method = std::string_view(h.method_string().data(), h.method_string().size());
  f.target = std::string_view(h.target().data(), h.target().size());
  f.version = h.version();
  if (const auto it = h.find(http::field::host); it != h.end()) f.host = std::string_view(it->value().data(), it->value().size());
  f.host_count = h.count(http::field::host);
  auto field = [&](http::field name) {
    const auto it = h.find(name);
    return it == h.end() ? std::string_view() : std::string_view(it->value().data(), it->value().size());
  };
  f.content_type = field(http::field::content_type);
  f.content_encoding = field(http::field::content_encoding);
  f.authorization = field(http::field::authorization);
  f.transfer_encoding = field(http::field::transfer_encoding);
  if (const auto n = parser.content_length()) f.content_length = *n;
  f.chunked = parser.chunked();
  f.header_count = static_cast<size_t>(std::distance(h.begin(), h.end()));
  return f;
}

std::optional<HttpError> check_line_endings(std::string_view unparsed, bool in_body) {
  std::string_view scanned = unparsed;
  if (!in_body) {
    if (const size_t end = unparsed.find("\r\n\r\n"); end != std::string_view::npos) scanned = unparsed.substr(0, end + 4);
  }
  for (size_t i = scanned.find('\n'); i != std::string_view::npos; i = scanned.find('\n', i + 1)) {
    if (i > 0 && scanned[i - 1] == '\r') continue;
    return HttpError{400,
                     std::string(in_body ? "a chunk-size or trailer line" : "a line of the request head") +
                         " ends in a bare LF; end every line with CRLF (RFC 9112 2.2)",
                     "bad_line_ending", "invalid_request_error", ""};
  }
  return std::nullopt;
}

std::optional<HttpError> parse_error(const boost::beast::error_code& ec, const HttpLimits& limits, bool in_body) {
  const auto error = [](int status, std::string message, std::string code) {
    return HttpError{status, std::move(message), std::move(code), "invalid_request_error", ""};
  };
  if (ec == http::error::end_of_stream || ec == boost::asio::error::eof) {
    if (!in_body) return std::nullopt;  // closed between requests
    return error(400, "the connection ended before the request body was complete", "incomplete_body");
  }
  if (ec == boost::asio::error::connection_reset || ec == boost::asio::error::operation_aborted ||
      ec == boost::asio::error::broken_pipe || ec == boost::asio::error::bad_descriptor)
    return std::nullopt;
  if (ec == http::error::partial_message)
    return error(400, in_body ? "the connection ended before the request body was complete"
                              : "the connection ended inside the request head",
                 "incomplete_request");
  if (ec == http::error::header_limit)
    return error(431,
                 "the request head is larger than " + std::to_string(limits.max_header_bytes) +
                     " bytes (request line and header fields)",
                 "request_header_fields_too_large");
  if (ec == http::error::buffer_overflow)
    return error(431, "a line of the request (a chunk header with its extensions, or a trailer field) is too long",
                 "request_header_fields_too_large");
  if (ec == http::error::body_limit)
    return error(413,
                 "the request body is larger than the limit of " + std::to_string(limits.max_body_bytes) +
                     " bytes (--max-body-size)",
                 "request_too_large");
  if (ec == http::error::bad_content_length)
    return error(400, "invalid Content-Length: it must be one non-negative decimal number", "bad_content_length");
  if (ec == http::error::bad_transfer_encoding)
    return error(400, "invalid Transfer-Encoding: only chunked is supported", "bad_transfer_encoding");
  if (ec == http::error::bad_chunk || ec == http::error::bad_chunk_extension)
    return error(400, "malformed chunked body: " + ec.message(), "bad_chunk");
  if (ec == http::error::bad_version)
    return error(505, "unsupported HTTP version: send HTTP/1.1 or HTTP/1.0", "http_version_not_supported");
  return error(400, "malformed HTTP request: " + ec.message(), "bad_request");
}

}  // namespace kestrel::cli
