// The server's side of the OpenAI request parser (openai_request.h): the fields only
// /v1/completions and /v1/chat/completions read, the defaults that differ from batch mode, and the
// parameter each error names (the `param` of the OpenAI error body).
#include <gtest/gtest.h>

#include <limits>
#include <string>
#include <vector>

#include "chat_prompt.h"
#include "openai_request.h"

namespace kestrel::cli {
namespace {

OpenAiRequest parse(const std::string& text, RequestApi api) {
  return parse_openai_request(parse_request_body(text), api);
}

// The param of the RequestError the text raises ("<none>" when it parses).
std::string param_of(const std::string& text, RequestApi api) {
  try {
    parse(text, api);
  } catch (const RequestError& e) {
    return e.param();
  }
  return "<none>";
}

// A prompt format with the Jinja template `source` and bos_token "<s>".
PromptFormat jinja_format(const std::string& source) {
  PromptFormat f;
  f.bos_token = "<s>";
  f.jinja_template = std::make_shared<const jinja::Template>(jinja::Template::parse(source));
  return f;
}

TEST(OpenAiRequest, ServerDefaults) {
  const OpenAiRequest r = parse(R"({"prompt": "a"})", RequestApi::Completions);
  EXPECT_EQ(r.max_tokens, -1);  // until the context ends
  EXPECT_FALSE(r.max_tokens_given);
  EXPECT_EQ(r.n, 1);
  EXPECT_EQ(r.logprobs, -1);
  EXPECT_FALSE(r.echo || r.stream || r.include_usage);
  EXPECT_EQ(r.model, "");
  EXPECT_EQ(parse(R"({"prompt": "a"})", RequestApi::Batch).max_tokens, kBatchDefaultMaxTokens);
}

TEST(OpenAiRequest, ServerFields) {
  const OpenAiRequest r = parse(
      R"({"prompt": "a", "n": 3, "logprobs": 5, "stream": true, "max_tokens": 7,
          "stream_options": {"include_usage": true}, "model": "m", "unknown": {"x": 1}})",
      RequestApi::Completions);
  EXPECT_EQ(r.n, 3);
  EXPECT_EQ(r.logprobs, 5);
  EXPECT_TRUE(r.stream && r.include_usage && r.max_tokens_given);
  EXPECT_EQ(r.model, "m");
  EXPECT_TRUE(parse(R"({"prompt": "a", "echo": true})", RequestApi::Completions).echo);
  // echo with logprobs: the prompt's logprobs too (the engine's prompt_logprobs; see
  // tests/server/test_echo_logprobs.py for the response).
  const OpenAiRequest e = parse(R"({"prompt": "a", "echo": true, "logprobs": 1})", RequestApi::Completions);
  EXPECT_TRUE(e.echo);
  EXPECT_EQ(e.logprobs, 1);
}

TEST(OpenAiRequest, ChatLogprobsAreABooleanPlusTopLogprobs) {
  const std::string m = R"("messages": [{"role": "user", "content": "hi"}])";
  EXPECT_EQ(parse("{" + m + "}", RequestApi::Chat).logprobs, -1);
  EXPECT_EQ(parse("{" + m + R"(, "logprobs": false})", RequestApi::Chat).logprobs, -1);
  EXPECT_EQ(parse("{" + m + R"(, "logprobs": true})", RequestApi::Chat).logprobs, 0);
  EXPECT_EQ(parse("{" + m + R"(, "logprobs": true, "top_logprobs": 4})", RequestApi::Chat).logprobs, 4);
  EXPECT_EQ(param_of("{" + m + R"(, "top_logprobs": 4})", RequestApi::Chat), "top_logprobs");
  EXPECT_EQ(param_of("{" + m + R"(, "logprobs": 2})", RequestApi::Chat), "logprobs");
  const OpenAiRequest r = parse("{" + m + "}", RequestApi::Chat);
  ASSERT_TRUE(r.is_chat);
  EXPECT_EQ(r.messages_json, Json::parse(R"([{"role": "user", "content": "hi"}])"));
}

// The message of the RequestError the text raises ("<none>" when it parses).
std::string error_of(const std::string& text, RequestApi api) {
  try {
    parse(text, api);
  } catch (const RequestError& e) {
    return e.what();
  }
  return "<none>";
}

// "param: message" of the RequestError the text raises ("<none>" when it parses).
std::string failure_of(const std::string& text, RequestApi api) {
  try {
    parse(text, api);
  } catch (const RequestError& e) {
    return std::string(e.param()) + ": " + e.what();
  }
  return "<none>";
}

std::vector<std::string> texts(const OpenAiRequest& r) {
  std::vector<std::string> out;
  for (const PromptInput& p : r.prompts) out.push_back(p.ids ? "<ids>" : p.text);
  return out;
}

TEST(OpenAiRequest, PromptForms) {
  using Ids = std::vector<int32_t>;
  EXPECT_EQ(texts(parse(R"({"prompt": "x"})", RequestApi::Completions)), (std::vector<std::string>{"x"}));
  EXPECT_EQ(texts(parse(R"({"prompt": ["x"]})", RequestApi::Completions)), (std::vector<std::string>{"x"}));
  EXPECT_EQ(*parse(R"({"prompt": [1, 2, 3]})", RequestApi::Completions).prompts.at(0).ids, (Ids{1, 2, 3}));
  EXPECT_EQ(*parse(R"({"prompt": [[4, 5]]})", RequestApi::Completions).prompts.at(0).ids, (Ids{4, 5}));
  EXPECT_EQ(*parse(R"({"prompt": [7]})", RequestApi::Batch).prompts.at(0).ids, (Ids{7}));
  EXPECT_EQ(*parse(R"({"prompt": [[7]]})", RequestApi::Batch).prompts.at(0).ids, (Ids{7}));
  EXPECT_EQ(param_of(R"({"prompt": [1, -2]})", RequestApi::Completions), "prompt[1]");
  EXPECT_EQ(param_of(R"({"prompt": []})", RequestApi::Completions), "prompt");
  EXPECT_EQ(param_of(R"({"prompt": 5})", RequestApi::Completions), "prompt");
  // Each endpoint takes its own input and ignores the other's.
  EXPECT_EQ(param_of(R"({"messages": [{"role": "user", "content": "hi"}]})", RequestApi::Completions), "prompt");
  EXPECT_EQ(param_of(R"({"prompt": "a"})", RequestApi::Chat), "messages");
  EXPECT_TRUE(parse(R"({"messages": [{"role": "user", "content": "hi"}]})", RequestApi::Chat).prompts.empty());
}

// OpenAI's batched prompt: a list of strings or of token-id lists, one prompt each, in order.
TEST(OpenAiRequest, BatchedPrompts) {
  using Ids = std::vector<int32_t>;
  EXPECT_EQ(texts(parse(R"({"prompt": ["a", "", "c d"]})", RequestApi::Completions)),
            (std::vector<std::string>{"a", "", "c d"}));
  const OpenAiRequest r = parse(R"({"prompt": [[1, 2], [3], [4, 5, 6]], "n": 2})", RequestApi::Completions);
  ASSERT_EQ(r.prompts.size(), 3u);
  EXPECT_EQ(*r.prompts[0].ids, (Ids{1, 2}));
  EXPECT_EQ(*r.prompts[1].ids, (Ids{3}));
  EXPECT_EQ(*r.prompts[2].ids, (Ids{4, 5, 6}));
  EXPECT_EQ(r.n, 2);

  // Mixed lists and empty inner lists: 400 naming the element.
  const struct {
    const char* body;
    const char* param;
    const char* phrase;
  } bad[] = {
      {R"({"prompt": ["a", 1]})", "prompt[1]", "must be a string like prompt[0]"},
      {R"({"prompt": [1, "a"]})", "prompt[1]", "must be a token id like prompt[0]"},
      {R"({"prompt": [[1], "a"]})", "prompt[1]", "must be an array of token ids like prompt[0]"},
      {R"({"prompt": ["a", [1]]})", "prompt[1]", "must be a string like prompt[0]"},
      {R"({"prompt": [[1], []]})", "prompt[1]", "must not be an empty array"},
      {R"({"prompt": [[1, [2]]]})", "prompt[0][1]", "must be a token id"},
      {R"({"prompt": [{"a": 1}]})", "prompt[0]", "must be a token id, a string or an array of token ids"},
      {R"({"prompt": [true]})", "prompt[0]", "must be a token id, a string or an array of token ids"},
      {R"({"prompt": []})", "prompt", "must not be an empty array"},
  };
  for (const auto& c : bad) {
    EXPECT_EQ(param_of(c.body, RequestApi::Completions), c.param) << c.body;
    EXPECT_NE(error_of(c.body, RequestApi::Completions).find(c.phrase), std::string::npos)
        << c.body << " -> " << error_of(c.body, RequestApi::Completions);
  }
  // A batch line holds one prompt.
  EXPECT_NE(error_of(R"({"prompt": ["a", "b"]})", RequestApi::Batch).find("one prompt on a batch line"),
            std::string::npos);
  EXPECT_EQ(param_of(R"({"prompt": [[1], [2]]})", RequestApi::Batch), "prompt");
  // prompts x n is capped.
  std::string many = R"({"n": 2, "prompt": [)";
  for (size_t i = 0; i < kMaxChoices / 2 + 1; ++i) many += std::string(i ? "," : "") + "\"p\"";
  many += "]}";
  EXPECT_NE(error_of(many, RequestApi::Completions).find("at most 2048 per request"), std::string::npos)
      << error_of(many, RequestApi::Completions);
}

TEST(OpenAiRequest, ErrorsNameTheParameter) {
  const struct {
    const char* body;
    const char* param;
  } cases[] = {
      {R"({"prompt": "a", "n": 0})", "n"},
      {R"({"prompt": "a", "n": 129})", "n"},
      {R"({"prompt": "a", "logprobs": 21})", "logprobs"},
      {R"({"prompt": "a", "echo": 1})", "echo"},
      {R"({"prompt": "a", "stream": "yes"})", "stream"},
      {R"({"prompt": "a", "stream": true, "stream_options": {"include_usage": 1}})", "stream_options.include_usage"},
      {R"({"prompt": "a", "stream_options": {"include_usage": true}})", "stream_options"},  // not streamed
      {R"({"prompt": "a", "model": 1})", "model"},
      {R"({"prompt": "a", "logit_bias": {"x": 1}})", "logit_bias"},
      {R"({"prompt": "a", "logit_bias": {"3": "x"}})", "logit_bias"},
      {R"({"prompt": "a", "stop": ["a", 2]})", "stop[1]"},
      {R"({"prompt": "a", "top_p": 0})", "top_p"},
      {R"({"prompt": "a", "max_tokens": -1})", "max_tokens"},
      {R"({"prompt": "a", "max_tokens": 1, "max_completion_tokens": 2})", "max_completion_tokens"},
      {R"({"prompt": "a", "min_tokens": -1})", "min_tokens"},
      {R"({"prompt": "a", "max_tokens": 4, "min_tokens": 5})", "min_tokens"},
      {R"({"prompt": "a", "stop_token_ids": 5})", "stop_token_ids"},
      {R"({"prompt": "a", "stop_token_ids": [5, -1]})", "stop_token_ids[1]"},
      {R"({"prompt": "a", "stop_token_ids": [5, "6"]})", "stop_token_ids[1]"},
      {R"({"prompt": "a", "prompt_logprobs": -1})", "prompt_logprobs"},
      {R"({"prompt": "a", "prompt_logprobs": 21})", "prompt_logprobs"},
      {R"({"prompt": "a", "prompt_logprobs": 1, "stream": true})", "prompt_logprobs"},
      {R"({"prompt": "a", "speculative_config": {"method": "ngram"}})", "speculative_config"},
  };
  for (const auto& c : cases) EXPECT_EQ(param_of(c.body, RequestApi::Completions), c.param) << c.body;
  EXPECT_EQ(param_of(R"({"messages": [{"role": "user", "content": 1}]})", RequestApi::Chat), "messages[0].content");
  EXPECT_EQ(param_of(R"({"messages": [{"role": "bot", "content": "x"}]})", RequestApi::Chat), "messages[0].role");
}

// max_tokens at the int64 edge: 2^63 - 1 parses (the server's context check, written as a
// difference, refuses it); a double at or past 2^63 (9223372036854775807.0 is 2^63 as a double) is
// an error, where it was cast to int64_t with undefined behaviour.
TEST(OpenAiRequest, MaxTokensAtTheInt64Edge) {
  EXPECT_EQ(parse(R"({"prompt": "a", "max_tokens": 9223372036854775807})", RequestApi::Completions).max_tokens,
            std::numeric_limits<int64_t>::max());
  EXPECT_EQ(parse(R"({"prompt": "a", "max_tokens": 4611686018427387904.0})", RequestApi::Completions).max_tokens,
            int64_t{1} << 62);
  for (const char* v : {"9223372036854775807.0", "9223372036854775808.0", "9.3e18", "1e300", "-9.3e18",
                        "9223372036854775808", "18446744073709551615", "-9223372036854775808"}) {
    const std::string body = std::string(R"({"prompt": "a", "max_tokens": )") + v + "}";
    EXPECT_EQ(param_of(body, RequestApi::Completions), "max_tokens") << v;
    EXPECT_NE(error_of(body, RequestApi::Completions).find("must be >= 0 and < 2^63"), std::string::npos)
        << error_of(body, RequestApi::Completions);
    const std::string chat = std::string(R"({"messages": [{"role": "user", "content": "hi"}], "max_tokens": )") + v + "}";
    EXPECT_NE(error_of(chat, RequestApi::Chat).find("must be >= 1 and < 2^63"), std::string::npos)
        << error_of(chat, RequestApi::Chat);
  }
  // The same rule for top_k's int32 range: no cast outside it.
  EXPECT_EQ(param_of(R"({"prompt": "a", "top_k": 1e19})", RequestApi::Completions), "top_k");
  EXPECT_EQ(param_of(R"({"prompt": "a", "top_k": 2147483648.0})", RequestApi::Completions), "top_k");
}

// logit_bias keys are token ids in decimal digits: whitespace (" 5" was read as 5), signs, hex,
// exponents, non-ASCII digits and ids past int32 are errors naming logit_bias.
TEST(OpenAiRequest, LogitBiasKeysAreDigits) {
  for (const char* key : {" 5", "5 ", "\\t5", "+5", "-5", "0x5", "5.0", "1e2", "", "\u0665", "2147483648",
                          "99999999999"}) {
    const std::string body = std::string(R"({"prompt": "a", "logit_bias": {")") + key + R"(": 1}})";
    EXPECT_EQ(param_of(body, RequestApi::Completions), "logit_bias") << key;
  }
  const OpenAiRequest r =
      parse(R"({"prompt": "a", "logit_bias": {"05": 1, "2147483647": -1, "0": 2}})", RequestApi::Completions);
  EXPECT_EQ(r.sampling.logit_bias.at(5), 1.0f);
  EXPECT_EQ(r.sampling.logit_bias.at(2147483647), -1.0f);
  EXPECT_EQ(r.sampling.logit_bias.at(0), 2.0f);
}

// vLLM's min_tokens and stop_token_ids, for every API (batch lines too): min_tokens within
// [0, max_tokens] (batch: its default 256 counts), stop_token_ids a list of ids.
TEST(OpenAiRequest, MinTokensAndStopTokenIds) {
  const OpenAiRequest r =
      parse(R"({"prompt": "a", "max_tokens": 8, "min_tokens": 8, "stop_token_ids": [3, 0, 3]})", RequestApi::Completions);
  EXPECT_EQ(r.min_tokens, 8);
  EXPECT_EQ(r.stop_token_ids, (std::vector<int32_t>{3, 0, 3}));
  EXPECT_EQ(parse(R"({"prompt": "a", "min_tokens": 100000})", RequestApi::Completions).min_tokens, 100000);  // no max_tokens
  EXPECT_EQ(parse(R"({"prompt": "a", "min_tokens": null, "stop_token_ids": null})", RequestApi::Completions).min_tokens, 0);
  EXPECT_TRUE(parse(R"({"prompt": "a", "stop_token_ids": []})", RequestApi::Completions).stop_token_ids.empty());
  const std::string m = R"("messages": [{"role": "user", "content": "hi"}])";
  EXPECT_EQ(parse("{" + m + R"(, "min_tokens": 3, "stop_token_ids": [7]})", RequestApi::Chat).stop_token_ids,
            (std::vector<int32_t>{7}));
  EXPECT_EQ(parse(R"({"prompt": "a", "min_tokens": 256})", RequestApi::Batch).min_tokens, 256);
  EXPECT_EQ(failure_of(R"({"prompt": "a", "min_tokens": 257})", RequestApi::Batch),
            "min_tokens: min_tokens must be at most max_tokens (256, its default), got 257");
  EXPECT_EQ(failure_of(R"({"prompt": "a", "max_completion_tokens": 2, "min_tokens": 3})", RequestApi::Completions),
            "min_tokens: min_tokens must be at most max_completion_tokens (2), got 3");  // the name sent
  EXPECT_EQ(failure_of("{" + m + R"(, "max_completion_tokens": 2, "min_tokens": 3})", RequestApi::Chat),
            "min_tokens: min_tokens must be at most max_completion_tokens (2), got 3");
  EXPECT_EQ(failure_of("{" + m + R"(, "max_tokens": 2, "min_tokens": 3})", RequestApi::Chat),
            "min_tokens: min_tokens must be at most max_tokens (2), got 3");
  EXPECT_EQ(param_of(R"({"prompt": "a", "stop_token_ids": [2147483648]})", RequestApi::Batch), "stop_token_ids[0]");
  EXPECT_EQ(param_of(R"({"prompt": "a", "stop_token_ids": [1.5]})", RequestApi::Batch), "stop_token_ids[0]");
  EXPECT_EQ(param_of(R"({"prompt": "a", "use_beam_search": true, "min_tokens": 2})", RequestApi::Completions),
            "min_tokens");
  for (const char* f : {"min_tokens", "stop_token_ids"}) EXPECT_TRUE(is_known_field(f, RequestApi::Batch)) << f;
}

// vLLM's output and token-filter fields, on every API (they share the parser): their defaults,
// values, and a 400 naming the field for a wrong type or value; priority other than 0 is refused.
TEST(OpenAiRequest, VllmOutputAndFilterFields) {
  const std::string m = R"("messages": [{"role": "user", "content": "hi"}])";
  for (const auto& [body, api] : {std::pair{std::string(R"({"prompt": "a"})"), RequestApi::Completions},
                                  std::pair{"{" + m + "}", RequestApi::Chat},
                                  std::pair{std::string(R"({"prompt": "a"})"), RequestApi::Batch}}) {
    const OpenAiRequest d = parse(body, api);
    EXPECT_FALSE(d.include_stop_str_in_output);
    EXPECT_TRUE(d.skip_special_tokens && d.spaces_between_special_tokens);
    EXPECT_TRUE(d.allowed_token_ids.empty() && d.bad_words.empty());
    EXPECT_EQ(d.truncate_prompt_tokens, 0);
    const std::string with = body.substr(0, body.size() - 1) +
                             R"(, "include_stop_str_in_output": true, "skip_special_tokens": false,
                                 "spaces_between_special_tokens": false, "allowed_token_ids": [5, 0, 5],
                                 "bad_words": ["  hello", "a b"], "truncate_prompt_tokens": 7, "priority": 0})";
    const OpenAiRequest r = parse(with, api);
    EXPECT_TRUE(r.include_stop_str_in_output);
    EXPECT_FALSE(r.skip_special_tokens || r.spaces_between_special_tokens);
    EXPECT_EQ(r.allowed_token_ids, (std::vector<int32_t>{5, 0, 5}));
    EXPECT_EQ(r.bad_words, (std::vector<std::string>{"  hello", "a b"}));
    EXPECT_EQ(r.truncate_prompt_tokens, 7);
  }
  EXPECT_EQ(parse(R"({"prompt": "a", "truncate_prompt_tokens": -1})", RequestApi::Completions).truncate_prompt_tokens, -1);
  EXPECT_EQ(failure_of(R"({"prompt": "a", "allowed_token_ids": null, "bad_words": null, "truncate_prompt_tokens": null,
                          "priority": null, "skip_special_tokens": null})",
                       RequestApi::Completions),
            "<none>");
  const auto c = RequestApi::Completions;
  for (const auto& [body, param] : std::vector<std::pair<std::string, std::string>>{
           {R"({"prompt": "a", "include_stop_str_in_output": 1})", "include_stop_str_in_output"},
           {R"({"prompt": "a", "skip_special_tokens": "false"})", "skip_special_tokens"},
           {R"({"prompt": "a", "spaces_between_special_tokens": 0})", "spaces_between_special_tokens"},
           {R"({"prompt": "a", "allowed_token_ids": []})", "allowed_token_ids"},  // vLLM: would rule out every token
           {R"({"prompt": "a", "allowed_token_ids": 5})", "allowed_token_ids"},
           {R"({"prompt": "a", "allowed_token_ids": [1, -1]})", "allowed_token_ids[1]"},
           {R"({"prompt": "a", "allowed_token_ids": ["5"]})", "allowed_token_ids[0]"},
           {R"({"prompt": "a", "allowed_token_ids": [2147483648]})", "allowed_token_ids[0]"},
           {R"({"prompt": "a", "bad_words": "word"})", "bad_words"},
           {R"({"prompt": "a", "bad_words": ["ok", 3]})", "bad_words[1]"},
           {R"({"prompt": "a", "bad_words": [" \t"]})", "bad_words[0]"},
           {R"({"prompt": "a", "bad_words": [""]})", "bad_words[0]"},
           {R"({"prompt": "a", "truncate_prompt_tokens": 0})", "truncate_prompt_tokens"},
           {R"({"prompt": "a", "truncate_prompt_tokens": -2})", "truncate_prompt_tokens"},
           {R"({"prompt": "a", "truncate_prompt_tokens": 1.5})", "truncate_prompt_tokens"},
           {R"({"prompt": "a", "truncate_prompt_tokens": "8"})", "truncate_prompt_tokens"},
           {R"({"prompt": "a", "priority": 1})", "priority"},
           {R"({"prompt": "a", "priority": -3})", "priority"},
           {R"({"prompt": "a", "priority": "high"})", "priority"},
           {R"({"prompt": "a", "priority": 1e30})", "priority"},
           {R"({"prompt": "a", "use_beam_search": true, "allowed_token_ids": [1]})", "allowed_token_ids"},
           {R"({"prompt": "a", "use_beam_search": true, "bad_words": ["x"]})", "bad_words"}})
    EXPECT_EQ(param_of(body, c), param) << body;
  std::string many = R"({"prompt": "a", "bad_words": [)";
  for (size_t i = 0; i <= kMaxBadWords; ++i) many += std::string(i ? "," : "") + "\"w\"";
  EXPECT_EQ(param_of(many + "]}", c), "bad_words");
  EXPECT_EQ(failure_of(R"({"prompt": "a", "priority": 2})", c),
            "priority: priority must be 0: kestrel has no priority scheduling (requests are served in arrival "
            "order), got 2");
  EXPECT_EQ(failure_of(R"({"prompt": "a", "truncate_prompt_tokens": 0})", c),
            "truncate_prompt_tokens: truncate_prompt_tokens must be -1 (the context) or >= 1, got 0");
  for (const char* f : {"include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
                        "allowed_token_ids", "bad_words", "truncate_prompt_tokens", "priority"})
    EXPECT_TRUE(is_known_field(f, RequestApi::Batch)) << f;
}

// An integer past int64 (or int32 for token ids) is refused with the range the field takes, not
// only its lower bound.
TEST(OpenAiRequest, IntegerErrorsStateTheRange) {
  const auto c = RequestApi::Completions;
  for (const char* v : {"18446744073709551615", "9223372036854775808", "1e19", "-1"})
    EXPECT_EQ(failure_of(std::string(R"({"prompt": "a", "min_tokens": )") + v + "}", c),
              std::string("min_tokens: min_tokens must be in [0, 9223372036854775807], got ") +
                  shown(parse_request_body(v)))
        << v;
  EXPECT_EQ(failure_of(R"({"prompt": "a", "stop_token_ids": [4294967296]})", c),
            "stop_token_ids[0]: stop_token_ids[0] must be a token id in [0, 2147483647], got 4294967296");
  EXPECT_EQ(failure_of(R"({"prompt": [1, 18446744073709551615]})", c),
            "prompt[1]: prompt[1] must be a token id in [0, 2147483647], got 18446744073709551615");
  EXPECT_EQ(failure_of(R"({"prompt": "a", "top_k": 9223372036854775808})", c),
            "top_k: top_k must be in [-1, 2147483647] (0 or -1 = off), got 9223372036854775808");
  EXPECT_EQ(failure_of(R"({"prompt": "a", "truncate_prompt_tokens": 18446744073709551615})", c),
            "truncate_prompt_tokens: truncate_prompt_tokens must be -1 (the context) or in [1, 9223372036854775807], "
            "got 18446744073709551615");
}

// A sampling value that is nonzero in the JSON but zero as a 32-bit float is named as such, not
// reported against a range it seems to satisfy.
TEST(OpenAiRequest, SamplingValueBelowTheSmallestFloatIsNamed) {
  EXPECT_EQ(failure_of(R"({"prompt": "a", "top_p": 1e-320})", RequestApi::Completions),
            "top_p: top_p is too small for a 32-bit float (magnitude under 1.4e-45), got 1e-320");
  EXPECT_EQ(parse(R"({"prompt": "a", "top_p": 1e-30})", RequestApi::Completions).sampling.top_p, 1e-30f);
  EXPECT_EQ(parse(R"({"prompt": "a", "temperature": 0.0})", RequestApi::Completions).sampling.temperature, 0.0f);
}

// max_tokens and max_completion_tokens: a null one beside a number is not set (vLLM takes the one
// given); both null is "until max_model_len"; two numbers must agree.
TEST(OpenAiRequest, NullMaxTokensBesideTheOtherNameIsUnset) {
  const RequestApi c = RequestApi::Completions;
  const OpenAiRequest a = parse(R"({"prompt": "a", "max_tokens": null, "max_completion_tokens": 3})", c);
  EXPECT_EQ(a.max_tokens, 3);
  EXPECT_TRUE(a.max_tokens_given);
  EXPECT_EQ(parse(R"({"prompt": "a", "max_tokens": 5, "max_completion_tokens": null})", c).max_tokens, 5);
  const OpenAiRequest b = parse(R"({"prompt": "a", "max_tokens": null, "max_completion_tokens": null})", c);
  EXPECT_EQ(b.max_tokens, -1);
  EXPECT_FALSE(b.max_tokens_given);
  EXPECT_EQ(param_of(R"({"prompt": "a", "max_tokens": 4, "max_completion_tokens": 3})", c), "max_completion_tokens");
}

// max_tokens 0: completions (OpenAI's legacy API: the echo alone), not chat or batch lines.
TEST(OpenAiRequest, MaxTokensZeroIsForCompletions) {
  EXPECT_EQ(parse(R"({"prompt": "a", "max_tokens": 0, "echo": true})", RequestApi::Completions).max_tokens, 0);
  EXPECT_EQ(parse(R"({"prompt": "a", "max_completion_tokens": 0})", RequestApi::Completions).max_tokens, 0);
  EXPECT_EQ(param_of(R"({"prompt": "a", "max_tokens": 0, "min_tokens": 1})", RequestApi::Completions), "min_tokens");
  EXPECT_EQ(param_of(R"({"prompt": "a", "max_tokens": 0})", RequestApi::Batch), "max_tokens");
  EXPECT_EQ(param_of(R"({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0})", RequestApi::Chat),
            "max_tokens");
  EXPECT_EQ(param_of(R"({"prompt": "a", "max_tokens": 0, "use_beam_search": true})", RequestApi::Completions),
            "max_tokens");
}

// vLLM's prompt_logprobs: the server's, not streamed; a batch line has no logprobs to give.
// speculative_config is the server's (or batch run's) flag, never one request's.
TEST(OpenAiRequest, PromptLogprobsAndSpeculativeConfig) {
  EXPECT_EQ(parse(R"({"prompt": "a"})", RequestApi::Completions).prompt_logprobs, -1);
  EXPECT_EQ(parse(R"({"prompt": "a", "prompt_logprobs": 0})", RequestApi::Completions).prompt_logprobs, 0);
  EXPECT_EQ(parse(R"({"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 20})", RequestApi::Chat)
                .prompt_logprobs,
            20);
  EXPECT_EQ(param_of(R"({"prompt": "a", "prompt_logprobs": 1})", RequestApi::Batch), "prompt_logprobs");
  EXPECT_NE(error_of(R"({"prompt": "a", "prompt_logprobs": 1})", RequestApi::Batch).find("kestrel serve"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"prompt": "a", "prompt_logprobs": -1})", RequestApi::Completions).find("whole vocabulary"),
            std::string::npos);
  EXPECT_EQ(param_of(R"({"prompt": "a", "use_beam_search": true, "prompt_logprobs": 1})", RequestApi::Completions),
            "prompt_logprobs");
  EXPECT_NE(error_of(R"({"prompt": "a", "speculative_config": {"method": "ngram"}})", RequestApi::Completions)
                .find("kestrel serve --speculative-config"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"prompt": "a", "speculative_config": {}})", RequestApi::Batch)
                .find("kestrel batch --speculative-config"),
            std::string::npos);
  EXPECT_EQ(failure_of(R"({"prompt": "a", "speculative_config": null})", RequestApi::Completions), "<none>");
}

TEST(OpenAiRequest, KnownFields) {
  EXPECT_TRUE(is_known_field("logprobs", RequestApi::Completions));
  EXPECT_TRUE(is_known_field("stream_options", RequestApi::Chat));
  EXPECT_FALSE(is_known_field("logprobs", RequestApi::Batch));
  EXPECT_TRUE(is_known_field("id", RequestApi::Batch));
  EXPECT_FALSE(is_known_field("id", RequestApi::Completions));
}

// render_chat: the model's Jinja template with the special tokens; its failures name `messages`.
TEST(OpenAiRequest, RenderChatUsesTheJinjaTemplate) {
  const PromptFormat f = jinja_format(
      "{{ bos_token }}{% for m in messages %}[{{ m.role }}|{{ m.content }}]{% endfor %}"
      "{% if add_generation_prompt %}>{% endif %}{% if messages|length > 2 %}{{ raise_exception('too long') }}{% endif %}");
  const Json two = Json::parse(R"([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])");
  EXPECT_EQ(render_chat(f, two, true), "<s>[system|s][user|u]>");
  EXPECT_EQ(render_chat(f, two, false), "<s>[system|s][user|u]");
  Json three = two;
  three.push_back(Json{{"role", "assistant"}, {"content", "a"}});
  try {
    render_chat(f, three, true);
    ADD_FAILURE() << "no error";
  } catch (const RequestError& e) {
    EXPECT_EQ(e.param(), "messages");
    EXPECT_NE(std::string(e.what()).find("too long"), std::string::npos) << e.what();
  }
  PromptFormat broken;
  broken.template_error = "unexpected end of template at line 1";
  try {
    render_chat(broken, two, true);
    ADD_FAILURE() << "no error";
  } catch (const RequestError& e) {
    EXPECT_EQ(e.param(), "messages");
    EXPECT_NE(std::string(e.what()).find("line 1"), std::string::npos) << e.what();
  }
}

// chat_template_kwargs (vLLM's): an object of more template variables, which reach the template
// and override the ones it is given (as transformers' apply_chat_template kwargs do); any other
// type is a 400 naming it; completions do not read it.
TEST(OpenAiRequest, ChatTemplateKwargsReachTheTemplate) {
  const PromptFormat f = jinja_format(
      "{{ bos_token }}{% for m in messages %}[{{ m.content }}]{% endfor %}"
      "{% if enable_thinking is defined and not enable_thinking %}<no-think>{% endif %}");
  const OpenAiRequest r = parse(
      R"({"messages": [{"role": "user", "content": "u"}], "chat_template_kwargs": {"enable_thinking": false,
          "bos_token": "<B>"}})",
      RequestApi::Chat);
  EXPECT_EQ(render_chat(f, r.messages_json, true, r.tools, r.chat_template_kwargs), "<B>[u]<no-think>");
  EXPECT_EQ(render_chat(f, r.messages_json, true), "<s>[u]");
  EXPECT_TRUE(parse(R"({"messages": [{"role": "user", "content": "u"}], "chat_template_kwargs": null})",
                    RequestApi::Chat)
                  .chat_template_kwargs.is_null());
  for (const char* v : {"[]", "\"x\"", "1", "true"})
    EXPECT_EQ(param_of(std::string(R"({"messages": [{"role": "user", "content": "u"}], "chat_template_kwargs": )") +
                           v + "}",
                       RequestApi::Chat),
              "chat_template_kwargs")
        << v;
  EXPECT_TRUE(parse(R"({"prompt": "a", "chat_template_kwargs": 1})", RequestApi::Completions)
                  .chat_template_kwargs.is_null());
  EXPECT_TRUE(is_known_field("chat_template_kwargs", RequestApi::Chat));
}

TEST(OpenAiRequest, AddGenerationPromptIsReadForChat) {
  const std::string msgs = R"("messages": [{"role": "user", "content": "u"}])";
  EXPECT_TRUE(parse("{" + msgs + "}", RequestApi::Chat).add_generation_prompt);
  EXPECT_FALSE(parse("{" + msgs + R"(, "add_generation_prompt": false})", RequestApi::Chat).add_generation_prompt);
  EXPECT_TRUE(parse("{" + msgs + R"(, "add_generation_prompt": null})", RequestApi::Chat).add_generation_prompt);
  for (const char* v : {"\"no\"", "0", "[]"})
    EXPECT_EQ(param_of("{" + msgs + R"(, "add_generation_prompt": )" + v + "}", RequestApi::Chat),
              "add_generation_prompt")
        << v;
  EXPECT_TRUE(is_known_field("add_generation_prompt", RequestApi::Chat));
}



// developer and tool messages reach the template with their role as given (they were refused);
// a tool message keeps its tool_call_id, any message its name.
TEST(OpenAiRequest, DeveloperAndToolRolesPassToTheTemplate) {
  const OpenAiRequest r = parse(
      R"({"messages": [{"role": "developer", "content": "Be terse."},
                       {"role": "user", "content": "Weather?", "name": "ann"},
                       {"role": "tool", "content": [{"type": "text", "text": "22C"}, {"type": "text", "text": "sunny"}],
                        "tool_call_id": "call_1"}]})",
      RequestApi::Chat);
  EXPECT_EQ(r.messages_json, Json::parse(R"([{"role": "developer", "content": "Be terse."},
                                             {"role": "user", "content": "Weather?", "name": "ann"},
                                             {"role": "tool", "content": "22C\nsunny", "tool_call_id": "call_1"}])"));
  ASSERT_EQ(r.messages.size(), 3u);
  EXPECT_EQ(r.messages[2].role, "tool");
  EXPECT_TRUE(r.tools.is_null());
  EXPECT_EQ(param_of(R"({"messages": [{"role": "bot", "content": "x"}]})", RequestApi::Chat), "messages[0].role");
  EXPECT_EQ(param_of(R"({"messages": [{"role": "tool", "content": "x", "tool_call_id": 5}]})", RequestApi::Chat),
            "messages[0].tool_call_id");
  EXPECT_EQ(param_of(R"({"messages": [{"role": "user", "content": "x", "name": 5}]})", RequestApi::Chat),
            "messages[0].name");
}

// An assistant turn that called a tool: content null, tool_calls as the template expects them
// (arguments as the value; vLLM's {} for text that is not JSON). It was a 400.
TEST(OpenAiRequest, AssistantToolCallsWithNullContent) {
  const OpenAiRequest r = parse(
      R"({"messages": [{"role": "user", "content": "Weather in Paris?"},
                       {"role": "assistant", "content": null, "tool_calls": [
                         {"id": "call_1", "type": "function",
                          "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"days\": 2}"}},
                         {"id": "call_2", "function": {"name": "noop", "arguments": "not json"}}]},
                       {"role": "tool", "tool_call_id": "call_1", "content": "22C"}]})",
      RequestApi::Chat);
  ASSERT_EQ(r.messages_json.size(), 3u);
  const Json& a = r.messages_json[1];
  EXPECT_EQ(a["content"], "");
  EXPECT_EQ(a["tool_calls"], Json::parse(R"([
      {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}},
      {"id": "call_2", "type": "function", "function": {"name": "noop", "arguments": {}}}])"));
  // Key order as written (tojson shows it).
  EXPECT_EQ(a["tool_calls"][0]["function"]["arguments"].dump(), R"({"city":"Paris","days":2})");
  // content absent with tool_calls is the same; without tool_calls content is required.
  EXPECT_EQ(parse(R"({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}]}]})",
                  RequestApi::Chat).messages_json[0]["content"], "");
  EXPECT_EQ(param_of(R"({"messages": [{"role": "assistant", "content": null}]})", RequestApi::Chat), "messages[0].content");
  EXPECT_EQ(param_of(R"({"messages": [{"role": "user", "content": null}]})", RequestApi::Chat), "messages[0].content");
  EXPECT_EQ(param_of(R"({"messages": [{"role": "assistant", "content": null, "tool_calls": [{"function": {"name": "f"}}]}]})",
                     RequestApi::Chat), "messages[0].tool_calls[0].id");
  EXPECT_EQ(param_of(R"({"messages": [{"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "x", "function": {"name": "f"}}]}]})",
                     RequestApi::Chat), "messages[0].tool_calls[0].type");
  EXPECT_EQ(param_of(R"({"messages": [{"role": "assistant", "content": null, "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]}]})",
                     RequestApi::Chat), "messages[0].tool_calls[0].function.name");
  EXPECT_EQ(param_of(R"({"messages": [{"role": "assistant", "content": null, "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": 5}}]}]})",
                     RequestApi::Chat), "messages[0].tool_calls[0].function.arguments");
  // Arguments nested past the body's nesting limit: refused, not walked by the template.
  const std::string deep = std::string(100, '[') + std::string(100, ']');
  EXPECT_EQ(param_of(R"({"messages": [{"role": "assistant", "content": null, "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": ")" +
                         deep + R"("}}]}]})", RequestApi::Chat), "messages[0].tool_calls[0].function.arguments");
}

// A tool call's arguments are held to the body's limits (they had only the nesting limit, and a
// 200,000-key object took minutes to parse); within them, keys keep the order written and a
// repeated key keeps its first place and its last value.
TEST(OpenAiRequest, ToolCallArgumentsLimitsAndKeyOrder) {
  const auto body = [](const std::string& args) {
    return R"({"messages": [{"role": "assistant", "content": null, "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": )" +
           Json(args).dump() + "}}]}]}";
  };
  std::string many = "{";
  for (int i = 0; i < 70000; ++i) many += (i ? ",\"k" : "\"k") + std::to_string(i) + "\":0";
  many += "}";
  try {
    parse(body(many), RequestApi::Chat);
    ADD_FAILURE() << "70,000 argument keys passed";
  } catch (const RequestError& e) {
    EXPECT_EQ(e.param(), "messages[0].tool_calls[0].function.arguments");
    EXPECT_EQ(std::string(e.what()),
              "messages[0].tool_calls[0].function.arguments has more than 65536 object keys (the key limit)");
  }
  const auto args = [&](const std::string& text) {
    return parse(body(text), RequestApi::Chat).messages_json[0]["tool_calls"][0]["function"]["arguments"].dump();
  };
  EXPECT_EQ(args(R"({"z": 1, "a": {"y": [1, {"c": 2, "b": 3}], "x": null}, "m": "s"})"),
            R"({"z":1,"a":{"y":[1,{"c":2,"b":3}],"x":null},"m":"s"})");
  EXPECT_EQ(args(R"({"b": 1, "a": 2, "b": 3})"), R"({"b":3,"a":2})");
  EXPECT_EQ(args(R"([{"b": 1}, 2])"), R"([{"b":1},2])");
  EXPECT_EQ(args(std::string("{\"a\": 1}") + '\0' + "x"), "{}");  // not JSON (a raw NUL byte): {} as for any other text
  EXPECT_EQ(args(R"({"a": 1)"), "{}");
}

// A body's repeated key: the last value wins (nlohmann's rule, and Python's json.loads').
TEST(OpenAiRequest, RepeatedBodyKeyLastWins) {
  const OpenAiRequest r = parse(R"({"prompt": "a", "max_tokens": 3, "prompt": "b"})", RequestApi::Completions);
  ASSERT_EQ(r.prompts.size(), 1u);
  EXPECT_EQ(r.prompts[0].text, "b");
  EXPECT_EQ(r.max_tokens, 3);
}

// response_format, tools / tool_choice, best_of and suffix used to be ignored: an answer the client
// took for what it asked. Now: served as vLLM serves them, or a 400 naming the field.
TEST(OpenAiRequest, FieldsThatAskForWhatTheServerDoesNotDo) {
  const std::string m = R"("messages": [{"role": "user", "content": "hi"}])";
  EXPECT_EQ(failure_of("{" + m + R"(, "response_format": {"type": "text"}})", RequestApi::Chat), "<none>");
  EXPECT_EQ(param_of(R"({"prompt": "a", "response_format": {"type": "structural_tag"}})", RequestApi::Completions),
            "response_format");
  EXPECT_EQ(param_of("{" + m + R"(, "response_format": {"type": "json_schema"}})", RequestApi::Chat),
            "response_format.json_schema");
  EXPECT_EQ(param_of(R"({"prompt": "a", "response_format": {"type": "yaml"}})", RequestApi::Completions),
            "response_format.type");
  EXPECT_EQ(param_of(R"({"prompt": "a", "response_format": "text"})", RequestApi::Completions), "response_format");

  EXPECT_EQ(parse(R"({"prompt": "a", "n": 3, "best_of": 3})", RequestApi::Completions).n, 3);
  EXPECT_EQ(failure_of(R"({"prompt": "a", "best_of": null})", RequestApi::Completions), "<none>");
  EXPECT_EQ(failure_of(R"({"prompt": "a", "best_of": 1})", RequestApi::Batch), "<none>");
  EXPECT_EQ(parse(R"({"prompt": "a", "n": 2, "best_of": 4})", RequestApi::Completions).best_of, 4);
  EXPECT_EQ(param_of(R"({"prompt": "a", "n": 2, "best_of": 1})", RequestApi::Completions), "best_of");
  EXPECT_EQ(param_of(R"({"prompt": "a", "n": 2, "best_of": 4, "stream": true})", RequestApi::Completions), "best_of");
  EXPECT_EQ(param_of(R"({"prompt": "a", "best_of": 2})", RequestApi::Batch), "best_of");
  EXPECT_EQ(param_of("{" + m + R"(, "best_of": 0})", RequestApi::Chat), "best_of");
  EXPECT_EQ(param_of("{" + m + R"(, "best_of": 2})", RequestApi::Chat), "best_of");

  EXPECT_EQ(failure_of(R"({"prompt": "a", "suffix": "b"})", RequestApi::Completions),
            "suffix: suffix is not supported, got \"b\"");
  EXPECT_EQ(param_of(R"({"prompt": "a", "suffix": ""})", RequestApi::Batch), "suffix");
  EXPECT_EQ(failure_of(R"({"prompt": "a", "suffix": null})", RequestApi::Completions), "<none>");
  for (const char* f : {"response_format", "best_of", "suffix", "tools", "tool_choice"})
    EXPECT_TRUE(is_known_field(f, RequestApi::Batch)) << f;
}

// Beam search: width best_of, else n; n beams returned; sampling fields other than their neutral
// values, stop strings and logprobs refused, naming the field.
TEST(OpenAiRequest, BeamSearchFields) {
  const OpenAiRequest a = parse(
      R"({"prompt": "a", "use_beam_search": true, "n": 2, "best_of": 4, "length_penalty": 0.5, "early_stopping": "never",
          "temperature": 0})",
      RequestApi::Completions);
  EXPECT_EQ(a.beam_width(), 4);
  EXPECT_EQ(a.length_penalty, 0.5);
  EXPECT_EQ(a.early_stopping, EarlyStopping::Never);
  EXPECT_EQ(parse(R"({"prompt": "a", "use_beam_search": true, "n": 3})", RequestApi::Completions).beam_width(), 3);
  EXPECT_EQ(parse(R"({"prompt": "a", "use_beam_search": true, "best_of": 3})", RequestApi::Batch).beam_width(), 3);
  // A batch line's n with use_beam_search is the beam width (best_of, if given, wins); its result
  // is the best beam, so n stays 1.
  const OpenAiRequest bn = parse(R"({"prompt": "a", "use_beam_search": true, "n": 3})", RequestApi::Batch);
  EXPECT_EQ(bn.beam_width(), 3);
  EXPECT_EQ(bn.n, 1);
  EXPECT_EQ(parse(R"({"prompt": "a", "use_beam_search": true, "n": 2, "best_of": 4})", RequestApi::Batch).beam_width(),
            4);
  EXPECT_EQ(parse(R"({"prompt": "a", "early_stopping": true})", RequestApi::Batch).early_stopping, EarlyStopping::Done);
  EXPECT_EQ(parse(R"({"prompt": "a", "n": 2})", RequestApi::Completions).beam_width(), 0);
  for (const char* f : {R"("temperature": 0.5)", R"("top_p": 0.9)", R"("top_k": 5)", R"("min_p": 0.1)",
                        R"("presence_penalty": 1)", R"("frequency_penalty": 1)", R"("repetition_penalty": 1.2)",
                        R"("logit_bias": {"5": 1})", R"("stop": ["x"])", R"("logprobs": 1)"}) {
    const std::string body = std::string(R"({"prompt": "a", "use_beam_search": true, )") + f + "}";
    const std::string name = std::string(f).substr(1, std::string(f).find('"', 1) - 1);
    EXPECT_EQ(param_of(body, RequestApi::Completions), name) << f;
  }
  EXPECT_EQ(param_of(R"({"prompt": "a", "use_beam_search": true, "early_stopping": "sometimes"})", RequestApi::Completions),
            "early_stopping");
  EXPECT_EQ(param_of(R"({"prompt": "a", "length_penalty": "x"})", RequestApi::Completions), "length_penalty");
}

// Structured output: each field of OpenAI, vLLM and llama.cpp becomes one constraint; two are refused.
TEST(OpenAiRequest, StructuredOutputFields) {
  using grammar::ConstraintKind;
  const std::string m = R"("messages": [{"role": "user", "content": "hi"}])";
  auto kind_of = [&](const std::string& extra, RequestApi api = RequestApi::Chat) {
    const std::string body = api == RequestApi::Completions ? std::string(R"("prompt": "a")") : m;
    const OpenAiRequest r = parse("{" + body + ", " + extra + "}", api);
    EXPECT_TRUE(r.constraint.has_value()) << extra;
    return r.constraint ? r.constraint->kind : ConstraintKind::GBNF;
  };
  EXPECT_EQ(kind_of(R"("response_format": {"type": "json_object"})"), ConstraintKind::JSON_OBJECT);
  const OpenAiRequest js = parse("{" + m + R"(, "response_format": {"type": "json_schema", "json_schema":
      {"name": "n", "strict": true, "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}}})",
                                 RequestApi::Chat);
  ASSERT_TRUE(js.constraint.has_value());
  EXPECT_EQ(js.constraint->kind, ConstraintKind::JSON_SCHEMA);
  EXPECT_EQ(nlohmann::json::parse(js.constraint->text), nlohmann::json::parse(R"({"type":"object","properties":{"a":{"type":"integer"}}})"));
  EXPECT_EQ(js.constraint_param, "response_format");
  EXPECT_EQ(kind_of(R"("structured_outputs": {"regex": "[a-z]+"})"), ConstraintKind::REGEX);
  EXPECT_EQ(kind_of(R"("structured_outputs": {"choice": ["yes", "no"]})"), ConstraintKind::CHOICE);
  EXPECT_EQ(kind_of(R"("structured_outputs": {"grammar": "root ::= \"a\""})"), ConstraintKind::GBNF);
  EXPECT_EQ(kind_of(R"("structured_outputs": {"json": {"type": "string"}})"), ConstraintKind::JSON_SCHEMA);
  EXPECT_EQ(kind_of(R"("guided_json": "{\"type\": \"string\"}")", RequestApi::Batch), ConstraintKind::JSON_SCHEMA);
  EXPECT_EQ(kind_of(R"("guided_regex": "a+")", RequestApi::Completions), ConstraintKind::REGEX);
  EXPECT_EQ(kind_of(R"("guided_choice": ["a"])"), ConstraintKind::CHOICE);
  EXPECT_EQ(kind_of(R"("guided_grammar": "root ::= \"a\"")"), ConstraintKind::GBNF);
  EXPECT_EQ(kind_of(R"("grammar": "root ::= \"a\"")"), ConstraintKind::GBNF);
  EXPECT_EQ(kind_of(R"("json_schema": {"type": "integer"})"), ConstraintKind::JSON_SCHEMA);
  EXPECT_EQ(param_of("{" + m + R"(, "guided_regex": "a", "grammar": "root ::= \"a\""})", RequestApi::Chat), "grammar");
  EXPECT_EQ(param_of("{" + m + R"(, "guided_choice": []})", RequestApi::Chat), "guided_choice");
  EXPECT_EQ(param_of("{" + m + R"(, "structured_outputs": {}})", RequestApi::Chat), "structured_outputs");
  EXPECT_EQ(failure_of("{" + m + R"(, "structured_outputs": {"regex": "a", "choice": ["b"]}})", RequestApi::Chat),
            "structured_outputs: structured_outputs holds more than one of json, regex, choice, grammar, json_object; "
            "give one");
  EXPECT_FALSE(parse("{" + m + R"(, "guided_json": {}})", RequestApi::Chat).constraint->any_whitespace);
  EXPECT_TRUE(parse("{" + m + R"(, "response_format": {"type": "json_object"},
                                   "structured_outputs": {"any_whitespace": true}})",
                    RequestApi::Chat).constraint->any_whitespace);
  EXPECT_EQ(param_of("{" + m + R"(, "structured_outputs": {"json": {}, "any_whitespace": 1}})", RequestApi::Chat),
            "structured_outputs.any_whitespace");
  for (const char* f : {"structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "grammar",
                        "json_schema"})
    EXPECT_TRUE(is_known_field(f, RequestApi::Batch)) << f;
}

// Without a tool-call parser only tool_choice "none" is served (vLLM's answer): the tools then go
// to the template as `tools`; "auto" (the default with tools), "required" and a named function
// are refused.
TEST(OpenAiRequest, ToolChoice) {
  const std::string m = R"("messages": [{"role": "user", "content": "hi"}])";
  const std::string tools =
      R"("tools": [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}])";
  const OpenAiRequest none = parse("{" + m + ", " + tools + R"(, "tool_choice": "none"})", RequestApi::Chat);
  ASSERT_TRUE(none.tools.is_array());
  EXPECT_EQ(none.tools[0]["function"]["name"], "get_weather");
  EXPECT_EQ(none.tools[0]["function"]["parameters"]["properties"]["city"]["type"], "string");

  const std::string by_default = failure_of("{" + m + ", " + tools + "}", RequestApi::Chat);
  EXPECT_EQ(by_default.rfind("tool_choice: tool_choice \"auto\" (the default when tools are given) is not supported", 0), 0u)
      << by_default;
  EXPECT_NE(by_default.find("\"none\""), std::string::npos) << by_default;
  EXPECT_EQ(param_of("{" + m + ", " + tools + R"(, "tool_choice": "auto"})", RequestApi::Chat), "tool_choice");
  EXPECT_NE(failure_of("{" + m + ", " + tools + R"(, "tool_choice": "required"})", RequestApi::Chat).find("tool_calls"),
            std::string::npos);
  EXPECT_NE(failure_of("{" + m + ", " + tools +
                         R"(, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})",
                     RequestApi::Chat).find("tool_calls"),
            std::string::npos);
  EXPECT_NE(failure_of("{" + m + ", " + tools + R"(, "tool_choice": {"type": "function", "function": {"name": "other"}}})",
                     RequestApi::Chat).find("not in tools"),
            std::string::npos);
  EXPECT_EQ(param_of("{" + m + ", " + tools + R"(, "tool_choice": "sometimes"})", RequestApi::Chat), "tool_choice");
  EXPECT_NE(failure_of("{" + m + R"(, "tool_choice": "auto"})", RequestApi::Chat).find("needs tools"), std::string::npos);
  // No tools, or an empty list (with "required" too, as OpenAI reads it): plain chat.
  EXPECT_TRUE(parse("{" + m + R"(, "tool_choice": "none"})", RequestApi::Chat).tools.is_null());
  EXPECT_EQ(parse("{" + m + R"(, "tools": []})", RequestApi::Chat).tools, Json::array());
  EXPECT_EQ(parse("{" + m + R"(, "tools": [], "tool_choice": "required"})", RequestApi::Chat).tools, Json::array());
  // Malformed tools name the field.
  EXPECT_EQ(param_of("{" + m + R"(, "tools": {}, "tool_choice": "none"})", RequestApi::Chat), "tools");
  EXPECT_EQ(param_of("{" + m + R"(, "tools": [{"type": "function"}], "tool_choice": "none"})", RequestApi::Chat),
            "tools[0].function");
  EXPECT_EQ(param_of("{" + m + R"(, "tools": [{"function": {"name": ""}}], "tool_choice": "none"})", RequestApi::Chat),
            "tools[0].function.name");
  EXPECT_EQ(param_of("{" + m + R"(, "tools": [{"function": {"name": "f", "parameters": 1}}], "tool_choice": "none"})",
                     RequestApi::Chat),
            "tools[0].function.parameters");
}

// The template sees the tools and each message's tool_calls / tool_call_id; a template that
// cannot render a role raises, which is the request's error (param "messages"), not a crash.
TEST(OpenAiRequest, RenderChatWithToolsAndToolMessages) {
  PromptFormat f;
  f.jinja_template = std::make_shared<const jinja::Template>(jinja::Template::parse(
      "{% if tools %}{% for t in tools %}<tool {{ t.function.name }}>{% endfor %}{% endif %}"
      "{% for m in messages %}"
      "{% if m.role not in ['system', 'user', 'assistant', 'tool'] %}{{ raise_exception('Unknown role: ' + m.role) }}{% endif %}"
      "[{{ m.role }}|{{ m.content }}"
      "{% for c in m.tool_calls %}|{{ c.id }}:{{ c.function.name }}{{ c.function.arguments | tojson }}{% endfor %}"
      "{% if m.tool_call_id %}|for {{ m.tool_call_id }}{% endif %}]{% endfor %}"));
  const OpenAiRequest r = parse(
      R"({"messages": [{"role": "user", "content": "Weather?"},
                       {"role": "assistant", "content": null, "tool_calls": [
                         {"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{\"city\": \"Paris\"}"}}]},
                       {"role": "tool", "tool_call_id": "c1", "content": "22C"}],
          "tools": [{"type": "function", "function": {"name": "w"}}], "tool_choice": "none"})",
      RequestApi::Chat);
  EXPECT_EQ(render_chat(f, r.messages_json, false, r.tools),
            R"(<tool w>[user|Weather?][assistant||c1:w{"city": "Paris"}][tool|22C|for c1])");
  EXPECT_EQ(render_chat(f, r.messages_json, false), R"([user|Weather?][assistant||c1:w{"city": "Paris"}][tool|22C|for c1])");
  const OpenAiRequest dev = parse(R"({"messages": [{"role": "developer", "content": "x"}]})", RequestApi::Chat);
  try {
    render_chat(f, dev.messages_json, true);
    ADD_FAILURE() << "no error";
  } catch (const RequestError& e) {
    EXPECT_EQ(e.param(), "messages");
    EXPECT_NE(std::string(e.what()).find("Unknown role: developer"), std::string::npos) << e.what();
  }
}
}  // namespace
}  // namespace kestrel::cli
