// Request bodies before validation (openai_request.h): parse_request_body's limits, enforced while
// parsing, and the paths that handle hostile shapes (deep nesting, many keys) without recursion.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>

#include <string>

#include "batch_request.h"

#include "openai_request.h"

namespace kestrel::cli {
namespace {

// The value a message shows: compact JSON cut at 60 characters, written without recursion and
// without writing the whole value.
TEST(RequestBody, ShownIsShortAndIterative) {
  // Keys as written (error messages show the client's value as it sent it).
  EXPECT_EQ(shown(RequestJson::parse(R"({"b": [1, 2.5, "x"], "a": null})")), R"({"b":[1,2.5,"x"],"a":null})");
  EXPECT_EQ(shown(RequestJson::parse("[]")), "[]");
  EXPECT_EQ(shown(RequestJson::parse("{}")), "{}");
  EXPECT_EQ(shown(RequestJson("\xc3\xa9")), "\"\xc3\xa9\"");
  const std::string long_text(1000, 'y');
  EXPECT_EQ(shown(RequestJson(long_text)), "\"" + std::string(56, 'y') + "...");
  // 100,000 levels (built in a loop; the value's destructor is iterative in nlohmann >= 3.10).
  RequestJson deep = RequestJson::array();
  for (int i = 0; i < 100000; ++i) deep = RequestJson::array({std::move(deep)});
  EXPECT_EQ(shown(deep), std::string(57, '[') + "...");
}

// Request bodies: limits are enforced while parsing, and each error names its limit.
TEST(RequestBody, Limits) {
  const auto body_error = [](const std::string& body, const JsonLimits& limits = {}) -> std::string {
    try {
      parse_request_body(body, limits);
    } catch (const RequestError& e) {
      EXPECT_EQ(e.param(), "");
      return e.what();
    }
    return "<none>";
  };
  // 64 levels (the body's object is the first) parse; 65 do not.
  const auto nested = [](int levels) {
    return R"({"prompt": "a", "x": )" + std::string(static_cast<size_t>(levels - 1), '[') +
           std::string(static_cast<size_t>(levels - 1), ']') + "}";
  };
  EXPECT_EQ(body_error(nested(64)), "<none>");
  EXPECT_NE(body_error(nested(65)).find("deeper than 64 levels (the nesting limit)"), std::string::npos)
      << body_error(nested(65));
  JsonLimits small;
  small.max_keys = 3;
  small.max_values = 6;
  EXPECT_EQ(body_error(R"({"a": 1, "b": {"c": 2}})", small), "<none>");
  EXPECT_NE(body_error(R"({"a": 1, "b": {"c": 2, "d": 3}})", small).find("more than 3 object keys (the key limit)"),
            std::string::npos);
  EXPECT_NE(body_error("[1, 2, 3, 4, 5, 6]", small).find("more than 6 JSON values (the value limit)"),
            std::string::npos);
  EXPECT_EQ(body_error("[1, 2, 3, 4, 5]", small), "<none>");
  // Syntax errors keep the parser's message.
  EXPECT_NE(body_error(R"({"prompt": )").find("invalid JSON body: "), std::string::npos);
  EXPECT_NE(body_error("{\"prompt\": \"\xff\"}").find("invalid JSON body: "), std::string::npos);
}

std::string nested(size_t levels, const std::string& inner = "") {
  return std::string(levels, '[') + inner + std::string(levels, ']');
}

// The message of the RequestError f throws ("<none>" when it throws none).
template <typename F>
std::string request_error(F f) {
  try {
    f();
  } catch (const RequestError& e) {
    return e.what();
  }
  return "<none>";
}

// 80,000 levels of arrays in a validated field (a 160 KB body) used to overflow the stack when the
// error message dumped the value or prompt_field recursed into it. The body parser now stops at
// the nesting limit, long before the value is built.
// nlohmann's lexer ends the input at a NUL byte: without the check, the text before it parsed
// and the rest (a second batch line, garbage) vanished without an error.
TEST(RequestBody, NulByteIsAnErrorNotTheEndOfInput) {
  const std::string body = std::string(R"({"prompt": "x"})") + '\0' + R"({"prompt": "y"})";
  try {
    parse_request_body(body);
    ADD_FAILURE() << "a body with a NUL byte parsed";
  } catch (const RequestError& e) {
    EXPECT_NE(std::string(e.what()).find("NUL byte at offset 15"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(parse_request_body(R"({"prompt": "x\u0000y"})"));  // escaped in a string: fine
}

TEST(RequestBody, DeepNestingStopsAtTheLimit) {
  for (const char* field : {"temperature", "prompt", "logit_bias", "stop", "messages"}) {
    const std::string body = std::string(R"({"prompt": "a", ")") + field + "\": " + nested(80000) + "}";
    const std::string e = request_error([&] { parse_request_body(body); });
    EXPECT_NE(e.find("deeper than 64 levels (the nesting limit)"), std::string::npos) << field << ": " << e;
  }
  // Objects nest the same way.
  std::string objects;
  for (int i = 0; i < 80000; ++i) objects += R"({"a": )";
  objects += "1" + std::string(80000, '}');
  EXPECT_NE(request_error([&] { parse_request_body(objects); }).find("the nesting limit"), std::string::npos);
}

// Validation itself does not recurse either: a deep value built in code (no body limit) gets the
// field's error, its value shown cut short.
TEST(RequestBody, DeepValuesInFieldsAreErrorsNotRecursion) {
  RequestJson deep = RequestJson::array();
  for (int i = 0; i < 80000; ++i) deep = RequestJson::array({std::move(deep)});
  RequestJson j = RequestJson::object();
  j["prompt"] = "a";
  j["temperature"] = std::move(deep);
  const std::string e = request_error([&] { parse_openai_request(j, RequestApi::Completions); });
  EXPECT_EQ(e.rfind("temperature must be a number, got [[[[", 0), 0u) << e.substr(0, 200);
  EXPECT_LT(e.size(), 120u);

  j["prompt"] = std::move(j["temperature"]);
  j.erase("temperature");
  try {
    parse_openai_request(j, RequestApi::Completions);
    ADD_FAILURE() << "no error";
  } catch (const RequestError& err) {
    EXPECT_EQ(err.param(), "prompt[0][0]");
    EXPECT_EQ(std::string(err.what()).rfind("prompt[0][0] must be a token id, got [[[[", 0), 0u) << err.what();
  }
}

// kestrel batch's lines go through the same parser: a nested id is an error line, not a crash.
TEST(RequestBody, BatchLineWithANestedId) {
  const BatchLine deep = parse_batch_line(R"({"prompt": "a", "id": )" + nested(80000, "1") + "}", 4);
  EXPECT_FALSE(deep.request.has_value());
  EXPECT_EQ(deep.id, 4);
  EXPECT_NE(deep.error.find("the nesting limit"), std::string::npos) << deep.error;
  // Within the limit: the id's own rule, the value cut short.
  const BatchLine shallow = parse_batch_line(R"({"prompt": "a", "id": )" + nested(60, "1") + "}", 4);
  EXPECT_FALSE(shallow.request.has_value());
  EXPECT_EQ(shallow.error.rfind("id must be a string or a number, got [[[[", 0), 0u) << shallow.error;
  EXPECT_LT(shallow.error.size(), 120u);
}

// An unknown field holding 100,000 keys (1.5 MB) took 24 s of a core with ordered_json's
// duplicate scan; the key limit ends it at 65,536 keys, and the parser's per-object key index
// inserts in O(1).
TEST(RequestBody, ManyKeysStopAtTheKeyLimit) {
  const auto body = [](int n_keys) {
    std::string b = R"({"prompt": "a", "junk": {)";
    for (int i = 0; i < n_keys; ++i) b += (i ? ",\"k" : "\"k") + std::to_string(i) + "\":0";
    return b + "}}";
  };
  EXPECT_NE(request_error([&] { parse_request_body(body(100000)); }).find("more than 65536 object keys (the key limit)"),
            std::string::npos);
  // Just under the limit the body parses and validates (the unknown field is ignored).
  const RequestJson j = parse_request_body(body(65000));
  EXPECT_EQ(j.at("junk").size(), 65000u);
  EXPECT_EQ(parse_openai_request(j, RequestApi::Completions).prompts.size(), 1u);
  // The same keys at the top level, where every field is looked up (by a scan of the keys).
  std::string top = R"({"prompt": "a")";
  for (int i = 0; i < 65000; ++i) top += ",\"k" + std::to_string(i) + "\":0";
  top += "}";
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(parse_openai_request(parse_request_body(top), RequestApi::Completions).prompts.size(), 1u);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("65,000 top-level keys: parsed and validated in %.3f s\n", s);
}

// Keys keep the order written: a JSON schema's properties reach the grammar in the schema's order
// (generated output follows it, as with OpenAI's structured outputs), whatever their names.
TEST(RequestBody, SchemaPropertiesKeepTheirOrder) {
  const RequestJson j = parse_request_body(
      R"({"prompt": "a", "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema":
         {"type": "object", "properties": {"zeta": {"type": "string"}, "alpha": {"type": "integer"}},
          "required": ["zeta", "alpha"]}}}})");
  const OpenAiRequest r = parse_openai_request(j, RequestApi::Completions);
  ASSERT_TRUE(r.constraint.has_value());
  const std::string& text = r.constraint->text;
  ASSERT_NE(text.find("zeta"), std::string::npos);
  EXPECT_LT(text.find("zeta"), text.find("alpha")) << text;
}

}  // namespace
}  // namespace kestrel::cli
