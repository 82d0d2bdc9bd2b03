#include "server/http_parse.h"

#include <boost/asio/error.hpp>
#include <boost/beast/http/error.hpp>

#include <algorithm>
#include <cctype>
#include <iterator>
#include <string>

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
  f.has_transfer_encoding = h.find(http::field::transfer_encoding) != h.end();
  f.authorization_count = h.count(http::field::authorization);
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
  // A CR as the last byte may be followed by its LF in the next read.
  for (size_t i = scanned.find('\r'); i != std::string_view::npos && i + 1 < scanned.size();
       i = scanned.find('\r', i + 1)) {
    if (scanned[i + 1] == '\n') continue;
    return HttpError{400,
                     std::string(in_body ? "a chunk-size or trailer line" : "the request head") +
                         " has a bare CR (not followed by LF); end every line with CRLF (RFC 9112 2.2)",
                     "bad_line_ending", "invalid_request_error", ""};
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

std::optional<HttpError> parse_error(const boost::beast::error_code& ec, const HttpLimits& limits, bool in_body,
                                     bool chunked) {
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
  if ((ec == http::error::bad_content_length && chunked) || (ec == http::error::bad_transfer_encoding && !chunked))
    return error(400, "Content-Length and Transfer-Encoding together are refused (RFC 9112 6.1)",
                 "bad_transfer_encoding");
  if (ec == http::error::bad_transfer_encoding)
    return error(400, "chunked is applied more than once in Transfer-Encoding (RFC 9112 6.1 forbids it)",
                 "bad_transfer_encoding");
  if (ec == http::error::bad_content_length)
    return error(400, "invalid Content-Length: it must be one non-negative decimal number", "bad_content_length");
  if (ec == http::error::bad_chunk || ec == http::error::bad_chunk_extension)
    return error(400, "malformed chunked body: " + ec.message(), "bad_chunk");
  if (ec == http::error::bad_version)
    return error(505, "unsupported HTTP version: send HTTP/1.1 or HTTP/1.0", "http_version_not_supported");
  return error(400, "malformed HTTP request: " + ec.message(), "bad_request");
}

namespace {
bool is_tchar(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) || std::string_view("!#$%&'*+-.^_`|~").find(c) != std::string_view::npos;
}

// field-name ":" OWS field-value OWS (RFC 9110 5.1, 5.5): a token, then a value of visible octets,
// spaces and tabs (obs-text allowed).
bool is_field_line(std::string_view line) {
  const size_t colon = line.find(':');
  if (colon == 0 || colon == std::string_view::npos) return false;
  for (char c : line.substr(0, colon))
    if (!is_tchar(c)) return false;
  for (char c : line.substr(colon + 1)) {
    const auto u = static_cast<unsigned char>(c);
    if ((u < 0x20 && c != '\t') || u == 0x7f) return false;
  }
  return true;
}

struct LastChunk {
  bool whole = false;  // false: it may be a last chunk, but not all of it is here yet
  size_t line_end = 0;  // after the CRLF of the last-chunk line
  size_t end = 0;       // after the empty line that ends the trailer section
};

// `data` from a chunk boundary: [CRLF after the previous chunk's data] last-chunk trailer-part CRLF
// (RFC 9112 7.1). nullopt when it is certainly not a last chunk (another chunk, or bytes the
// parser refuses).
std::optional<LastChunk> find_last_chunk(std::string_view data, bool after_chunk) {
  size_t i = 0;
  if (after_chunk) {
    if (data.size() < 2) return data == "\r" ? std::optional<LastChunk>(LastChunk{}) : std::nullopt;
    if (data.substr(0, 2) != "\r\n") return std::nullopt;
    i = 2;
  }
  size_t j = i;
  while (j < data.size() && data[j] == '0') ++j;
  if (j == data.size()) return LastChunk{};
  if (j == i || std::isxdigit(static_cast<unsigned char>(data[j]))) return std::nullopt;
  const size_t eol = data.find("\r\n", j);
  if (eol == std::string_view::npos) return LastChunk{};
  if (data.substr(eol + 2, 2) == "\r\n") return LastChunk{true, eol + 2, eol + 4};
  const size_t end = data.find("\r\n\r\n", eol);
  if (end == std::string_view::npos) return LastChunk{};
  return LastChunk{true, eol + 2, end + 4};
}
}  // namespace

void track_chunks(RequestParser& parser, ChunkPosition& pos) {
  pos.on_header = [&pos](std::uint64_t size, boost::beast::string_view, boost::beast::error_code&) {
    pos.left = size;
    pos.after_chunk = true;
  };
  pos.on_body = [&pos, &parser](std::uint64_t remain, boost::beast::string_view body, boost::beast::error_code&) {
    parser.get().body().append(body.data(), body.size());
    pos.left = remain - body.size();
    return body.size();
  };
  parser.on_chunk_header(pos.on_header);
  parser.on_chunk_body(pos.on_body);
}

size_t put_body(RequestParser& parser, const ChunkPosition& pos, std::string_view data, boost::beast::error_code& ec) {
  const auto put = [&](std::string_view part) { return parser.put(boost::asio::buffer(part.data(), part.size()), ec); };
  if (!parser.chunked()) return put(data);
  // Beast parses as far as it is given: it gets one chunk at a time, so that it never reaches the
  // trailer section on its own.
  if (pos.left > 0) return put(data.substr(0, static_cast<size_t>(std::min<uint64_t>(pos.left, data.size()))));
  const auto last = find_last_chunk(data, pos.after_chunk);
  if (!last) {
    const size_t start = pos.after_chunk && data.substr(0, 2) == "\r\n" ? 2 : 0;
    const size_t eol = data.find("\r\n", start);
    uint64_t size = 0;
    size_t digits = 0;
    for (size_t i = start; i < data.size() && std::isxdigit(static_cast<unsigned char>(data[i])) && digits <= 16;
         ++i, ++digits)
      size = size * 16 + static_cast<uint64_t>(std::isdigit(static_cast<unsigned char>(data[i]))
                                                   ? data[i] - '0'
                                                   : std::tolower(static_cast<unsigned char>(data[i])) - 'a' + 10);
    // An incomplete or invalid chunk-size line goes whole: the parser waits or refuses it.
    if (eol == std::string_view::npos || digits == 0 || digits > 16) return put(data);
    if (size >= data.size()) return put(data);
    return put(data.substr(0, std::min<size_t>(eol + 2 + static_cast<size_t>(size), data.size())));
  }
  if (!last->whole) {
    // Held back: Beast would remember how far it had searched for the end of the trailers.
    ec = http::error::need_more;
    return 0;
  }
  std::string_view trailer = data.substr(last->line_end, last->end - 2 - last->line_end);
  while (!trailer.empty()) {
    const size_t eol = trailer.find("\r\n");
    if (!is_field_line(trailer.substr(0, eol))) {
      ec = http::error::bad_field;
      return 0;
    }
    trailer.remove_prefix(eol + 2);
  }
  std::string framed(data.substr(0, last->line_end));
  framed += "\r\n";
  const size_t n = parser.put(boost::asio::buffer(framed), ec);
  return !ec && parser.is_done() ? last->end : std::min(n, last->line_end);
}

}  // namespace kestrel::cli
