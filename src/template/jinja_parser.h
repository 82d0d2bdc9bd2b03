// The Jinja parser: tokens -> statement and expression trees, with Jinja2's operator precedence
// (lowest first): a if c else b; or; and; not; comparisons, in, not in; + -; ~; * / // %; **;
// unary - +; then postfix .attr [index] [a:b:c] (call), filters |f(...) and tests "is [not] t".
#pragma once

#include <string_view>

#include "template/jinja_ast.h"
#include "template/jinja_lexer.h"

namespace kestrel::jinja {

// Errors: TemplateError (Syntax) with line and column: unexpected tokens, unknown tags, filters
// or tests, unclosed blocks, break/continue outside a loop, nesting deeper than the limits.
StmtList parse_template(const LexResult& lexed);

// The filter and test names the engine knows (jinja_filters.cpp), checked while parsing.
bool is_known_filter(std::string_view name);
bool is_known_test(std::string_view name);

}  // namespace kestrel::jinja
