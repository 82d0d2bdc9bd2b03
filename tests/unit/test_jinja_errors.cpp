// Jinja errors: syntax errors name the line and column, runtime errors name where they happened,
// raise_exception's message comes through as is, and untrusted templates hit the limits
// (work, output and value size, nesting, recursion) as TemplateError(Limit) instead of running
// away or overflowing the stack.
#include <gtest/gtest.h>

#include <chrono>
#include <string>

#include <nlohmann/json.hpp>

#include "template/chat_render.h"
#include "template/jinja.h"

namespace kestrel::jinja {
namespace {

const nlohmann::ordered_json& context() {
  static const auto ctx = nlohmann::ordered_json::parse(R"({
    "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]})");
  return ctx;
}

// Renders; returns the error (the test fails when there is none).
TemplateError error_of(const std::string& source, const RenderOptions& options = {}) {
  try {
    Template::parse(source).render(context(), options);
  } catch (const TemplateError& e) {
    return e;
  }
  ADD_FAILURE() << "no error for: " << source.substr(0, 200);
  return TemplateError(TemplateError::Kind::Runtime, "");
}

struct SyntaxCase {
  const char* source;
  int line;
  int column;
  const char* message;  // a part of what()
};

TEST(JinjaErrors, SyntaxErrorsNameLineAndColumn) {
  const SyntaxCase cases[] = {
      {"Hello\n{% if x %}\nno end", 3, 7, "expected 'elif' or 'else' or 'endif' to close the 'if' at line 2, column 1"},
      {"{{ 1 + }}", 1, 8, "unexpected '}}': expected an expression"},
      {"a\n  {{ x | nosuch }}", 2, 10, "no filter named 'nosuch'"},
      {"{{ x is nosuch }}", 1, 9, "no test named 'nosuch'"},
      {"{% for x in y %}\n{% endif %}", 2, 4, "unexpected 'endif' (the innermost open block is 'for')"},
      {"{{ 'unterminated }}", 1, 4, "unterminated string literal"},
      {"x\n\n  {# never closed", 3, 3, "missing end of comment tag"},
      {"{% foo %}", 1, 4, "unknown tag 'foo'"},
      {"{% break %}", 1, 4, "'break' outside of a loop"},
      {"{{ [1, 2 }}", 1, 10, "unexpected '}', expected ']'"},
      {"{{ x", 1, 1, "'{{' not closed with '}}'"},
      {"{% if true %}", 1, 14, "expected 'elif' or 'else' or 'endif'"},
      {"h\xc3\xa9llo {{ 1 + }}", 1, 14, "unexpected '}}'"},  // columns count characters, not bytes
      {"{% include 'other.jinja' %}", 1, 4, "'include' is not supported"},
      {"{{ a $ b }}", 1, 6, "unexpected character '$'"},
      {"{% set x.y %}", 1, 12, "expected '='"},
      {"{% macro m(a %}{% endmacro %}", 1, 15, "unexpected '}', expected ')'"},
      {"{{ 99999999999999999999 }}", 1, 4, "integer literal too large"},
      {"{% raw %}x", 1, 1, "missing '{% endraw %}'"},
  };
  for (const SyntaxCase& c : cases) {
    SCOPED_TRACE(c.source);
    try {
      Template::parse(c.source);
      ADD_FAILURE() << "parsed";
    } catch (const TemplateError& e) {
      EXPECT_EQ(e.kind(), TemplateError::Kind::Syntax);
      EXPECT_EQ(e.line(), c.line);
      EXPECT_EQ(e.column(), c.column);
      const std::string where = "template syntax error at line " + std::to_string(c.line) + ", column " + std::to_string(c.column) + ": ";
      EXPECT_EQ(std::string(e.what()).rfind(where, 0), 0u) << e.what();
      EXPECT_NE(std::string(e.what()).find(c.message), std::string::npos) << e.what();
    }
  }
}

struct RuntimeCase {
  const char* source;
  int line;
  int column;
  const char* message;
};

TEST(JinjaErrors, RuntimeErrorsNameWhereTheyHappened) {
  const RuntimeCase cases[] = {
      {"{{ undefined_fn() }}", 1, 16, "'undefined_fn' is undefined"},
      {"{{ 'abc'.nomethod() }}", 1, 18, "'str object' has no attribute 'nomethod'"},
      {"{{ 1 + 'a' }}", 1, 4, "unsupported operand type(s) for +: 'int' and 'str'"},
      {"line one\n  {{ messages[0].content + 1 }}", 2, 6, "unsupported operand type(s) for +: 'str' and 'int'"},
      {"{{ 1 ~ 2 + 3 }}", 1, 4, "unsupported operand type(s) for +: 'str' and 'int'"},  // ~ binds tighter than +
      {"{{ messages.append(1) }}", 1, 19, "lists and dicts cannot be changed"},
      {"{% for a, b in [1] %}{% endfor %}", 1, 1, "'int' object is not iterable"},
      {"{% for x in none %}{% endfor %}", 1, 1, "'NoneType' object is not iterable"},
      {"{{ x < 1 }}", 1, 4, "'x' is undefined"},
      {"{{ undefined_var.attr + 1 }}", 1, 4, "'undefined_var' is undefined"},
      {"{{ 1 // 0 }}", 1, 4, "division or modulo by zero"},
      {"{{ range(200000)|length }}", 1, 9, "range too big"},
      {"{{ 2 ** 64 }}", 1, 4, "integer overflow"},
      {"{{ x|tojson }}", 1, 6, "Object of type Undefined is not JSON serializable"},
      {"{{ [1, 'a']|sort }}", 1, 13, "'<' not supported between instances of 'str' and 'int'"},
      {"{{ 'x'|center('wide') }}", 1, 8, "center width must be an integer"},
      {"{{ 'a'|replace('a') }}", 1, 8, "replace() needs old and new strings"},
      {"{{ 'a'|trim(1, 2) }}", 1, 8, "trim() takes at most 1 argument"},
      {"{{ 'a'.split(sep=',', bad=1) }}", 1, 13, "unexpected keyword argument 'bad'"},
      {"{% set x = 1 %}{% set x.y = 2 %}", 1, 16, "non-namespace object"},
      {"{{ {[1]: 2} }}", 1, 4, "unhashable type: 'list'"},
      {"{{ '%d' % 'x' }}", 1, 4, "a number is required"},
      {"{{ '%s %s' % ('a',) }}", 1, 4, "not enough arguments for format string"},
      {"{{ '{}'.format() }}", 1, 15, "out of range"},
  };
  for (const RuntimeCase& c : cases) {
    SCOPED_TRACE(c.source);
    const TemplateError e = error_of(c.source);
    EXPECT_EQ(e.kind(), TemplateError::Kind::Runtime);
    EXPECT_EQ(e.line(), c.line);
    EXPECT_EQ(e.column(), c.column);
    const std::string where = "template error at line " + std::to_string(c.line) + ", column " + std::to_string(c.column) + ": ";
    EXPECT_EQ(std::string(e.what()).rfind(where, 0), 0u) << e.what();
    EXPECT_NE(std::string(e.what()).find(c.message), std::string::npos) << e.what();
  }
}

TEST(JinjaErrors, RaiseExceptionGivesItsMessage) {
  const TemplateError e =
      error_of("{% for m in messages %}{% if m.role == 'assistant' %}{{ raise_exception('Only user messages, got ' ~ m.role) }}{% endif %}{% endfor %}");
  EXPECT_EQ(e.kind(), TemplateError::Kind::Raised);
  EXPECT_STREQ(e.what(), "Only user messages, got assistant");

  ChatTemplateInputs in;
  in.messages = nlohmann::ordered_json::parse(R"([{"role": "tool", "content": "x"}])");
  try {
    render_chat_template("{% if messages[0].role == 'tool' %}{{ raise_exception('Tool first') }}{% endif %}", in);
    ADD_FAILURE() << "no error";
  } catch (const TemplateError& err) {
    EXPECT_EQ(err.kind(), TemplateError::Kind::Raised);
    EXPECT_STREQ(err.what(), "Tool first");
  }
}

TEST(JinjaErrors, TemplateErrorIsAKestrelError) {
  try {
    Template::parse("{% if %}");
    ADD_FAILURE() << "parsed";
  } catch (const kestrel::Error& e) {  // what the server turns into HTTP 400
    EXPECT_NE(std::string(e.what()).find("line 1, column 7"), std::string::npos);
  }
}

// ---- limits ----

// A smaller work budget than the default keeps these tests quick (sanitizer builds too); one
// case below runs with the default budget.
RenderOptions small_budget() {
  RenderOptions o;
  o.limits.max_work = 2'000'000;
  return o;
}

void expect_limit(const std::string& source, const RenderOptions& options = small_budget()) {
  SCOPED_TRACE(source.substr(0, 120));
  const auto start = std::chrono::steady_clock::now();
  const TemplateError e = error_of(source, options);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(e.kind(), TemplateError::Kind::Limit) << e.what();
  EXPECT_LT(seconds, 60.0);  // bounded (release builds take well under a second)
}

TEST(JinjaErrors, RecursionIsBounded) {
  expect_limit("{% macro r(n) %}{{ r(n + 1) }}{% endmacro %}{{ r(0) }}");
  expect_limit("{% macro a() %}{{ b() }}{% endmacro %}{% macro b() %}{{ a() }}{% endmacro %}{{ a() }}");
  // Exponential call trees stop on the work budget.
  expect_limit("{% macro d(n) %}{% if n > 0 %}{{ d(n - 1) }}{{ d(n - 1) }}{% else %}x{% endif %}{% endmacro %}{{ d(40) }}");
}

TEST(JinjaErrors, LoopsAreBounded) {
  expect_limit("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}");
  // The default budget (5e7 units) stops 1e10 iterations too.
  expect_limit("{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}{% endfor %}", RenderOptions{});
}

TEST(JinjaErrors, OutputAndValuesAreBounded) {
  RenderOptions small = small_budget();
  small.limits.max_output_bytes = 1 << 20;  // 1 MiB instead of 64: the same checks, less copying
  expect_limit("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", small);
  expect_limit("{{ 'a' * 1000000000000 }}", small);
  expect_limit("{% set ns = namespace(s='ab') %}{% for i in range(100) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", small);
  expect_limit("{% set ns = namespace(s='ab') %}{% for i in range(100) %}{% set ns.s = ns.s + ns.s %}{% endfor %}", small);
  expect_limit("{% set ns = namespace(l=[1]) %}{% for i in range(100) %}{% set ns.l = ns.l + ns.l %}{% endfor %}", small);
  expect_limit("{% set ns = namespace(l=[1]) %}{% for i in range(100) %}{% set ns.l = ns.l * 2 %}{% endfor %}{{ ns.l|length }}", small);
  expect_limit("{% set ns = namespace(s='ab') %}{% for i in range(100) %}{% set ns.s = ns.s|replace('a', 'aa') %}{% endfor %}", small);
  expect_limit("{% set ns = namespace(l=[]) %}{% for i in range(100000) %}{% set ns.l = [ns.l] %}{% endfor %}", small);
  // A shared string printed many times through a list: the output limit, not memory, stops it.
  expect_limit("{% set s = 'x' * 1000000 %}{% set l = [s] * 100000 %}{{ l }}", small);
  expect_limit("{% set s = 'x' * 1000000 %}{% set l = [s] * 100000 %}{{ l|tojson }}", small);
  expect_limit("{% set s = 'x' * 1000000 %}{% set l = [s] * 100000 %}{{ l|join }}", small);
}

TEST(JinjaErrors, NestingIsBoundedWhileParsing) {
  auto expect_syntax = [](const std::string& source) {
    SCOPED_TRACE(source.substr(0, 60));
    try {
      Template::parse(source);
      ADD_FAILURE() << "parsed";
    } catch (const TemplateError& e) {
      EXPECT_EQ(e.kind(), TemplateError::Kind::Syntax);
      EXPECT_NE(std::string(e.what()).find("nested too deeply"), std::string::npos) << e.what();
    }
  };
  const auto repeat = [](const std::string& s, int n) {
    std::string out;
    for (int i = 0; i < n; ++i) out += s;
    return out;
  };
  expect_syntax("{{ " + repeat("(", 100000) + "1" + repeat(")", 100000) + " }}");
  expect_syntax("{{ " + repeat("[", 100000) + repeat("]", 100000) + " }}");
  expect_syntax("{{ " + repeat("-", 100000) + "1 }}");
  expect_syntax("{{ " + repeat("not ", 100000) + "x }}");
  expect_syntax("{{ 1" + repeat(" + 1", 100000) + " }}");
  expect_syntax("{{ x" + repeat("|abs", 100000) + " }}");
  expect_syntax("{{ x" + repeat(".a", 100000) + " }}");
  expect_syntax("{{ x" + repeat("[0]", 100000) + " }}");
  expect_syntax("{{ f" + repeat("()", 100000) + " }}");
  expect_syntax("{{ a" + repeat(" and a", 100000) + " }}");
  expect_syntax(repeat("{% if true %}", 100000));
  expect_syntax(repeat("{% for x in y %}", 100000));
  // Long flat templates are fine.
  EXPECT_EQ(Template::parse(repeat("{{ 'a' }}", 100000)).render(nlohmann::json::object()).size(), 100000u);
  EXPECT_EQ(Template::parse("{{ 'a'" + repeat(" ~ 'a'", 10000) + " }}").render(nlohmann::json::object()).size(), 10001u);
}

TEST(JinjaErrors, DeepJsonInputIsALimit) {
  nlohmann::json deep = 1;
  for (int i = 0; i < 1000; ++i) deep = nlohmann::json::array({deep});
  try {
    Template::parse("{{ x }}").render(nlohmann::json{{"x", deep}});
    ADD_FAILURE() << "rendered";
  } catch (const TemplateError& e) {
    EXPECT_EQ(e.kind(), TemplateError::Kind::Limit);
  }
  try {
    Template::parse("{{ x }}").render(nlohmann::json::array({1}));
    ADD_FAILURE() << "rendered";
  } catch (const TemplateError& e) {
    EXPECT_NE(std::string(e.what()).find("must be a JSON object"), std::string::npos);
  }
}

}  // namespace
}  // namespace kestrel::jinja
