// Boost.Beast's request parser with the server's limits, and what its results mean for the checks
// of http_head.h: the head's fields as HeadFields, a parse error as the HttpError to answer.
#pragma once

#include <boost/beast/core/error.hpp>
#include <boost/beast/http/message.hpp>
#include <boost/beast/http/parser.hpp>
#include <boost/beast/http/string_body.hpp>

#include <cstdint>
#include <functional>
#include <optional>
#include <string_view>

#include "server/http_head.h"

namespace kestrel::cli {

using RequestParser = boost::beast::http::request_parser<boost::beast::http::string_body>;

// A parser for one request: the header byte limit set, no body limit yet (check_head answers an
// oversized Content-Length with a 413 that names the flag; call limit_body before the body).
void configure_parser(RequestParser& parser, const HttpLimits& limits);
// Before reading the body: a chunked body is cut at the limit too (413).
void limit_body(RequestParser& parser, const HttpLimits& limits);

// The fields check_head reads; views into parser's head (valid while it lives).
HeadFields head_fields(const RequestParser& parser);

// Line endings (RFC 9112 2.2): a CR must be followed by LF (a bare CR is refused: 400); every line of the head, chunk-size lines and trailer fields must end
// in CRLF. A bare LF is refused with 400 rather than taken as a line end (which the RFC allows as a
// MAY): an intermediary that does not split lines there would frame the request differently, and
// Beast itself neither accepts it (a request line ending in LF read as a bad version) nor rejects it
// in a chunk-size line (it waits for a CRLF until the body deadline). `unparsed`: the bytes the
// parser has not consumed. Before the head is parsed (in_body false) only the head is scanned, up
// to its first empty line; in a chunked body, what the parser holds back after asking for more is
// one incomplete line (a chunk size or a trailer field), which is scanned whole.
std::optional<HttpError> check_line_endings(std::string_view unparsed, bool in_body);

// The answer to a parse error (header or body), or nullopt for one that needs none: the client
// closed or reset the connection before a request began. `chunked`: the parser had already seen
// Transfer-Encoding: chunked (tells a second chunked coding from a Content-Length conflict).
std::optional<HttpError> parse_error(const boost::beast::error_code& ec, const HttpLimits& limits, bool in_body,
                                     bool chunked = false);

// Where a chunked body's parser stands between reads: the chunk-data octets still to come, and
// whether a chunk has been read (its data is then followed by a CRLF before the next chunk-size).
struct ChunkPosition {
  uint64_t left = 0;
  bool after_chunk = false;
  // The parser's chunk callbacks (Beast keeps references to them).
  std::function<void(std::uint64_t, boost::beast::string_view, boost::beast::error_code&)> on_header;
  std::function<std::size_t(std::uint64_t, boost::beast::string_view, boost::beast::error_code&)> on_body;
};

// Before the body: stores chunk data in the body itself and keeps `pos` up to date (`pos` must
// outlive the parser's use).
void track_chunks(RequestParser& parser, ChunkPosition& pos);

// Feeds body bytes to the parser (which must have been set up with track_chunks when chunked) and
// returns how many were used. The trailer section of a chunked body is checked to be field lines
// and then discarded, never given to the parser: RFC 9110 6.5.1 forbids merging trailer fields
// into the header, and Beast would merge them, reading Connection, Content-Length and
// Transfer-Encoding there as framing.
size_t put_body(RequestParser& parser, const ChunkPosition& pos, std::string_view data, boost::beast::error_code& ec);

}  // namespace kestrel::cli
