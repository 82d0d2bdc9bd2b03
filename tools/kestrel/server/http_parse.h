// Boost.Beast's request parser with the server's limits, and what its results mean for the checks
// of http_head.h: the head's fields as HeadFields, a parse error as the HttpError to answer.
#pragma once

#include <boost/beast/core/error.hpp>
#include <boost/beast/http/message.hpp>
#include <boost/beast/http/parser.hpp>
#include <boost/beast/http/string_body.hpp>

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

// Line endings (RFC 9112 2.2): every line of the head, chunk-size lines and trailer fields must end
// in CRLF. A bare LF is refused with 400 rather than taken as a line end (which the RFC allows as a
// MAY): an intermediary that does not split lines there would frame the request differently, and
// Beast itself neither accepts it (a request line ending in LF read as a bad version) nor rejects it
// in a chunk-size line (it waits for a CRLF until the body deadline). `unparsed`: the bytes the
// parser has not consumed. Before the head is parsed (in_body false) only the head is scanned, up
// to its first empty line; in a chunked body, what the parser holds back after asking for more is
// one incomplete line (a chunk size or a trailer field), which is scanned whole.
std::optional<HttpError> check_line_endings(std::string_view unparsed, bool in_body);

// The answer to a parse error (header or body), or nullopt for one that needs none: the client
// closed or reset the connection before a request began.
std::optional<HttpError> parse_error(const boost::beast::error_code& ec, const HttpLimits& limits, bool in_body);

}  // namespace kestrel::cli
