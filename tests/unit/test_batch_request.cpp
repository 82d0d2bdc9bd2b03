// `kestrel batch` input lines: every field, the defaults, every error (the message names the field
// and the bad value), the engine request built from a line, and the output line's shape.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "batch_request.h"
#include "core/error.h"
#include "test_util.h"

namespace kestrel::cli {
namespace {

BatchRequest parse_ok(const std::string& line) {
  BatchLine b = parse_batch_line(line, 7);
  EXPECT_EQ(b.error, "") << line;
  EXPECT_TRUE(b.request.has_value()) << line;
  return b.request.value_or(BatchRequest{});
}

std::string parse_error(const std::string& line) {
  const BatchLine b = parse_batch_line(line, 7);
  EXPECT_FALSE(b.request.has_value()) << line;
  return b.error;
}

TEST(BatchRequest, PromptDefaults) {
  const BatchLine b = parse_batch_line(R"({"prompt": "Once upon a time"})", 3);
  ASSERT_TRUE(b.request) << b.error;
  EXPECT_EQ(b.id, 3);  // no id: the 0-based line index
  EXPECT_TRUE(b.unknown_fields.empty());
  const BatchRequest& r = *b.request;
  EXPECT_FALSE(r.is_chat);
  ASSERT_EQ(r.prompts.size(), 1u);
  EXPECT_EQ(r.prompts[0].text, "Once upon a time");
  EXPECT_FALSE(r.prompts[0].ids.has_value());
  EXPECT_EQ(r.max_tokens, 256);
  EXPECT_EQ(r.sampling.temperature, 1.0f);
  EXPECT_EQ(r.sampling.top_p, 1.0f);
  EXPECT_EQ(r.sampling.top_k, 0);
  EXPECT_EQ(r.sampling.min_p, 0.0f);
  EXPECT_EQ(r.sampling.presence_penalty, 0.0f);
  EXPECT_EQ(r.sampling.frequency_penalty, 0.0f);
  EXPECT_EQ(r.sampling.repetition_penalty, 1.0f);
  EXPECT_EQ(r.sampling.repeat_last_n, -1);
  EXPECT_TRUE(r.sampling.logit_bias.empty());
  EXPECT_FALSE(r.seed.has_value());
  EXPECT_TRUE(r.stop.empty());
  EXPECT_FALSE(r.ignore_eos);
}

TEST(BatchRequest, EveryField) {
  const BatchLine b = parse_batch_line(
      R"({"id": "req-1", "prompt": "Hi", "max_tokens": 12, "temperature": 0.5, "top_p": 0.9,
          "top_k": 40, "min_p": 0.05, "seed": 18446744073709551615, "stop": ["\n", "The end"],
          "presence_penalty": -0.5, "frequency_penalty": 1.5, "repetition_penalty": 1.1,
          "ignore_eos": true, "logit_bias": {"13": -100, "7": 2.5}, "n": 1, "model": "x", "user": "u"})",
      0);
  ASSERT_TRUE(b.request) << b.error;
  EXPECT_EQ(b.id, "req-1");
  EXPECT_TRUE(b.unknown_fields.empty());
  const BatchRequest& r = *b.request;
  EXPECT_EQ(r.max_tokens, 12);
  EXPECT_FLOAT_EQ(r.sampling.temperature, 0.5f);
  EXPECT_FLOAT_EQ(r.sampling.top_p, 0.9f);
  EXPECT_EQ(r.sampling.top_k, 40);
  EXPECT_FLOAT_EQ(r.sampling.min_p, 0.05f);
  EXPECT_FLOAT_EQ(r.sampling.presence_penalty, -0.5f);
  EXPECT_FLOAT_EQ(r.sampling.frequency_penalty, 1.5f);
  EXPECT_FLOAT_EQ(r.sampling.repetition_penalty, 1.1f);
  ASSERT_TRUE(r.seed.has_value());
  EXPECT_EQ(*r.seed, 18446744073709551615ull);
  EXPECT_EQ(r.stop, (std::vector<std::string>{"\n", "The end"}));
  EXPECT_TRUE(r.ignore_eos);
  ASSERT_EQ(r.sampling.logit_bias.size(), 2u);
  EXPECT_EQ(r.sampling.logit_bias.at(13), -100.0f);
  EXPECT_EQ(r.sampling.logit_bias.at(7), 2.5f);
}

TEST(BatchRequest, IdsAreEchoedAsGiven) {
  EXPECT_EQ(parse_batch_line(R"({"id": 42, "prompt": "a"})", 0).id, 42);
  EXPECT_EQ(parse_batch_line(R"({"id": -3, "prompt": "a"})", 0).id, -3);
  EXPECT_EQ(parse_batch_line(R"({"id": 2.5, "prompt": "a"})", 0).id, 2.5);
  EXPECT_EQ(parse_batch_line(R"({"id": "x y", "prompt": "a"})", 0).id, "x y");
  EXPECT_EQ(parse_batch_line(R"({"id": null, "prompt": "a"})", 5).id, 5);
  // The id is known even when the rest of the line is bad, so the error result carries it.
  const BatchLine b = parse_batch_line(R"({"id": "r9", "prompt": 3})", 5);
  EXPECT_EQ(b.id, "r9");
  EXPECT_FALSE(b.request);
}

TEST(BatchRequest, MaxTokensAndItsNewerName) {
  EXPECT_EQ(parse_ok(R"({"prompt": "a", "max_completion_tokens": 9})").max_tokens, 9);
  EXPECT_EQ(parse_ok(R"({"prompt": "a", "max_tokens": 9, "max_completion_tokens": 9})").max_tokens, 9);
  EXPECT_EQ(parse_ok(R"({"prompt": "a", "max_tokens": 16.0})").max_tokens, 16);
  EXPECT_EQ(parse_ok(R"({"prompt": "a", "max_tokens": null})").max_tokens, -1);  // until max_model_len
  const std::string e = parse_error(R"({"prompt": "a", "max_tokens": 9, "max_completion_tokens": 10})");
  EXPECT_NE(e.find("max_tokens (9)"), std::string::npos) << e;
  EXPECT_NE(e.find("max_completion_tokens (10)"), std::string::npos) << e;
}

TEST(BatchRequest, TopKMinusOneIsOff) { EXPECT_EQ(parse_ok(R"({"prompt": "a", "top_k": -1})").sampling.top_k, 0); }

TEST(BatchRequest, NullMeansNotGiven) {
  const BatchRequest r = parse_ok(
      R"({"prompt": "a", "temperature": null, "top_p": null, "seed": null, "stop": null, "ignore_eos": null})");
  EXPECT_EQ(r.sampling.temperature, 1.0f);
  EXPECT_FALSE(r.seed);
  EXPECT_TRUE(r.stop.empty());
}

TEST(BatchRequest, StopStringOrArray) {
  EXPECT_EQ(parse_ok(R"({"prompt": "a", "stop": "."})").stop, (std::vector<std::string>{"."}));
  EXPECT_EQ(parse_ok(R"({"prompt": "a", "stop": ["a", "b", "c", "d"]})").stop.size(), 4u);
  EXPECT_TRUE(parse_ok(R"({"prompt": "a", "stop": []})").stop.empty());
}

TEST(BatchRequest, Messages) {
  const BatchRequest r = parse_ok(
      R"({"messages": [{"role": "system", "content": "Be brief."},
                       {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
                       {"role": "assistant", "content": ""}]})");
  ASSERT_TRUE(r.is_chat);
  ASSERT_EQ(r.messages.size(), 3u);
  EXPECT_EQ(r.messages[0].role, "system");
  EXPECT_EQ(r.messages[0].content, "Be brief.");
  EXPECT_EQ(r.messages[1].content, "Hi \nthere");  // text parts joined with "\n", as vLLM joins them
  EXPECT_EQ(r.messages[2].role, "assistant");
}

TEST(BatchRequest, UnknownFieldsAreListed) {
  const BatchLine b = parse_batch_line(R"({"prompt": "a", "logprobs": true, "stream": false, "model": "m"})", 0);
  EXPECT_TRUE(b.request);
  EXPECT_EQ(b.unknown_fields, (std::vector<std::string>{"logprobs", "stream"}));
}

// Each bad line gives an error that names the field and shows the value as written.
TEST(BatchRequest, ErrorsNameTheFieldAndTheValue) {
  struct Case {
    std::string line;
    std::vector<std::string> phrases;
  };
  const std::vector<Case> cases = {
      {R"({"prompt": "a", "max_tokens": 0})", {"max_tokens", ">= 1", "got 0"}},
      {R"({"prompt": "a", "max_tokens": -5})", {"max_tokens", "got -5"}},
      {R"({"prompt": "a", "max_tokens": 1.5})", {"max_tokens", "integer", "got 1.5"}},
      {R"({"prompt": "a", "max_tokens": "16"})", {"max_tokens", "integer", "got \"16\""}},
      {R"({"prompt": "a", "max_completion_tokens": 0})", {"max_completion_tokens", "got 0"}},
      {R"({"prompt": "a", "temperature": -1})", {"temperature", "[0, 2]", "got -1"}},
      {R"({"prompt": "a", "temperature": 2.5})", {"temperature must be in [0, 2] (0 = greedy), got 2.5"}},
      {R"({"prompt": "a", "temperature": "hot"})", {"temperature", "number", "got \"hot\""}},
      {R"({"prompt": "a", "temperature": true})", {"temperature", "number", "got true"}},
      {R"({"prompt": "a", "temperature": 1e39})", {"temperature", "out of range", "got 1e+39"}},
      {R"({"prompt": "a", "top_p": 0})", {"top_p", "(0, 1]", "got 0"}},
      {R"({"prompt": "a", "top_p": 1.5})", {"top_p", "got 1.5"}},
      {R"({"prompt": "a", "top_k": -2})", {"top_k", "got -2"}},
      {R"({"prompt": "a", "top_k": 4.5})", {"top_k", "integer", "got 4.5"}},
      {R"({"prompt": "a", "min_p": 2})", {"min_p", "[0, 1]", "got 2"}},
      {R"({"prompt": "a", "presence_penalty": 3})", {"presence_penalty", "[-2, 2]", "got 3"}},
      {R"({"prompt": "a", "frequency_penalty": -2.5})", {"frequency_penalty", "[-2, 2]", "got -2.5"}},
      {R"({"prompt": "a", "repetition_penalty": 0})", {"repetition_penalty", "[0.01, 100]", "got 0"}},
      {R"({"prompt": "a", "repetition_penalty": 1e-38})",
       {"repetition_penalty must be in [0.01, 100] (1 turns it off), got 1e-38"}},
      {R"({"prompt": "a", "repetition_penalty": 101})", {"repetition_penalty", "got 101"}},
      {R"({"prompt": "a", "seed": -1})", {"seed", ">= 0", "got -1"}},
      {R"({"prompt": "a", "seed": 1.5})", {"seed", "integer", "got 1.5"}},
      {R"({"prompt": "a", "seed": "7"})", {"seed", "integer", "got \"7\""}},
      {R"({"prompt": "a", "stop": 5})", {"stop", "string", "got 5"}},
      {R"({"prompt": "a", "stop": ""})", {"stop", "empty", "got \"\""}},
      {R"({"prompt": "a", "stop": ["a", 1]})", {"stop[1]", "string", "got 1"}},
      {R"({"prompt": "a", "stop": ["a", ""]})", {"stop[1]", "empty"}},
      {R"({"prompt": "a", "stop": ["1", "2", "3", "4", "5"]})", {"stop", "at most 4"}},
      {R"({"prompt": "a", "ignore_eos": "yes"})", {"ignore_eos", "true or false", "got \"yes\""}},
      {R"({"prompt": "a", "n": 2})", {"n", "must be 1", "beam width", "got 2"}},
      {R"({"prompt": "a", "n": 2, "use_beam_search": false})", {"n", "must be 1", "got 2"}},
      {R"({"prompt": "a", "n": 0, "use_beam_search": true})", {"n", "[1, 128]", "got 0"}},
      {R"({"prompt": "a", "n": 3, "best_of": 2, "use_beam_search": true})", {"best_of", ">= n (3)", "got 2"}},
      {R"({"prompt": "a", "logit_bias": [1]})", {"logit_bias", "object", "got [1]"}},
      {R"({"prompt": "a", "logit_bias": {"abc": 1}})", {"logit_bias key", "token id", "got \"abc\""}},
      {R"({"prompt": "a", "logit_bias": {"-4": 1}})", {"logit_bias key", "got \"-4\""}},
      {R"({"prompt": "a", "logit_bias": {"5": 200}})", {"logit_bias[\"5\"]", "[-100, 100]", "got 200"}},
      {R"({"prompt": 3})", {"prompt", "string", "got 3"}},
      {R"({"prompt": "a", "messages": [{"role": "user", "content": "b"}]})", {"prompt", "messages", "not both"}},
      {R"({"id": 1})", {"missing prompt or messages"}},
      {R"({"id": true, "prompt": "a"})", {"id", "string or a number", "got true"}},
      {R"({"id": [1], "prompt": "a"})", {"id", "got [1]"}},
      {R"({"messages": []})", {"messages", "non-empty", "got []"}},
      {R"({"messages": "hi"})", {"messages", "got \"hi\""}},
      {R"({"messages": ["hi"]})", {"messages[0]", "object", "got \"hi\""}},
      {R"({"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]})",
       {"messages[1].role", "\"developer\"", "\"tool\"", "got \"bot\""}},
      {R"({"messages": [{"content": "a"}]})", {"messages[0].role", "missing"}},
      {R"({"messages": [{"role": "user"}]})", {"messages[0].content", "missing"}},
      {R"({"messages": [{"role": "user", "content": 5}]})", {"messages[0].content", "got 5"}},
      {R"({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})",
       {"messages[0].content[0]", "text", "image_url"}},
      {R"({"prompt": "a",)", {"invalid JSON", "column"}},
      {R"(not json)", {"invalid JSON"}},
      {R"(["prompt", "a"])", {"JSON object", "got array"}},
      {R"("just a string")", {"JSON object", "got string"}},
  };
  for (const Case& c : cases) {
    const std::string e = parse_error(c.line);
    for (const std::string& phrase : c.phrases) EXPECT_NE(e.find(phrase), std::string::npos) << c.line << " -> " << e;
  }
}

TEST(BatchRequest, LongValuesAreShortenedInMessages) {
  const std::string e = parse_error(R"({"prompt": "a", "stop": ")" + std::string(500, 'x') + R"(", "n": 3})");
  EXPECT_NE(e.find("n must be 1"), std::string::npos) << e;
  const std::string e2 = parse_error(R"({"prompt": "a", "stop": [")" + std::string(500, 'x') + R"(", 1]})");
  EXPECT_LT(e2.size(), 200u) << e2;
}

TEST(BatchRequest, BlankLines) {
  EXPECT_TRUE(is_blank_line(""));
  EXPECT_TRUE(is_blank_line(" \t\r"));
  EXPECT_FALSE(is_blank_line(" {}"));
}

TEST(BatchRequest, ResultLineKeepsIdFirstAndUsageTotals) {
  BatchResult r;
  r.output_ids = {5, 6, 2};
  r.text = "hi \xff";  // invalid UTF-8 from a broken token must not break the line
  r.finish_reason = "stop";
  r.metrics.n_prompt_tokens = 4;
  r.metrics.n_cached_prompt_tokens = 2;
  r.metrics.ttft_s = 0.25;
  r.metrics.tpot_s = 0.002;
  const Json j = result_json("a", r);
  std::vector<std::string> keys;
  for (const auto& [k, v] : j.items()) keys.push_back(k);
  EXPECT_EQ(keys, (std::vector<std::string>{"id", "output_ids", "text", "finish_reason", "stop_reason", "usage",
                                            "ttft_ms", "tpot_ms"}));
  EXPECT_TRUE(j["stop_reason"].is_null());
  r.stop_reason = 2;
  EXPECT_EQ(result_json("a", r)["stop_reason"], 2);
  EXPECT_EQ(j["usage"]["prompt_tokens"], 4);
  EXPECT_EQ(j["usage"]["completion_tokens"], 3);
  EXPECT_EQ(j["usage"]["total_tokens"], 7);
  EXPECT_EQ(j["usage"]["cached_tokens"], 2);
  EXPECT_DOUBLE_EQ(j["ttft_ms"].get<double>(), 250.0);
  EXPECT_DOUBLE_EQ(j["tpot_ms"].get<double>(), 2.0);
  const std::string line = to_json_line(j);
  EXPECT_EQ(line.back(), '\n');
  EXPECT_EQ(std::count(line.begin(), line.end(), '\n'), 1);
  EXPECT_NE(line.find("hi \xEF\xBF\xBD"), std::string::npos) << line;  // U+FFFD

  EXPECT_EQ(to_json_line(error_json(3, "bad", 4)), R"({"id":3,"error":{"message":"bad","line":4}})" "\n");
}

// ---------------------------------------------------------------------------------------------
// Engine requests (need a real tokenizer)

using Loaded = test::LoadedModel;
Loaded load(const std::string& path) { return test::load_model(path); }

TEST(BatchRequest, EngineRequestFromPrompt) {
  const std::string path = test::data_dir() + "/stories260K/stories260K.gguf";
  KESTREL_REQUIRE_FILE(path);
  const Loaded l = load(path);
  const PromptFormat f = PromptFormat::for_model(*l.model, *l.tokenizer);
  EXPECT_FALSE(f.stop_ids.empty());

  BatchRequest r = parse_ok(R"({"prompt": "Once upon a time", "max_tokens": 5, "stop": "."})");
  Request q = to_engine_request(r, f, /*random_seed=*/99);
  EXPECT_EQ(q.prompt, l.tokenizer->encode("Once upon a time", true, true));
  EXPECT_EQ(q.prompt.front(), l.tokenizer->bos_id());
  EXPECT_EQ(q.max_tokens, 5);
  EXPECT_EQ(q.sampling.seed, 99u);
  EXPECT_EQ(q.stop_ids, f.stop_ids);
  EXPECT_EQ(q.stop, (std::vector<std::string>{"."}));

  r = parse_ok(R"({"prompt": "", "seed": 3, "ignore_eos": true})");
  q = to_engine_request(r, f, 99);
  EXPECT_EQ(q.prompt, (std::vector<int32_t>{l.tokenizer->bos_id()}));  // BOS alone
  EXPECT_EQ(q.sampling.seed, 3u);
  EXPECT_TRUE(q.stop_ids.empty());

  // A completions request with several prompts: prompt_index picks one.
  const OpenAiRequest m =
      parse_openai_request(parse_request_body(R"({"prompt": [[1, 5], [1, 7, 9]]})"), RequestApi::Completions);
  EXPECT_EQ(to_engine_request(m, f, 0, 0).prompt, (std::vector<int32_t>{1, 5}));
  EXPECT_EQ(to_engine_request(m, f, 0, 1).prompt, (std::vector<int32_t>{1, 7, 9}));
  EXPECT_THROW(to_engine_request(m, f, 0, 2), RequestError);
  // Echoed with its special tokens (the BOS here).
  EXPECT_EQ(prompt_text(m, *l.tokenizer, 1), "<s>" + l.tokenizer->decode(std::vector<int32_t>{7, 9}, false));
  const OpenAiRequest texts =
      parse_openai_request(parse_request_body(R"({"prompt": ["Once", "upon a time"]})"), RequestApi::Completions);
  EXPECT_EQ(to_engine_request(texts, f, 0, 1).prompt, l.tokenizer->encode("upon a time", true, true));
  EXPECT_EQ(prompt_text(texts, *l.tokenizer, 1), "upon a time");
  try {
    to_engine_request(parse_openai_request(parse_request_body(R"({"prompt": [[1], [1, 600]]})"), RequestApi::Completions),
                      f, 0, 1);
    ADD_FAILURE() << "no error";
  } catch (const RequestError& e) {
    EXPECT_NE(std::string(e.what()).find("prompt[1][1] = 600 is outside the vocabulary"), std::string::npos) << e.what();
  }

  r = parse_ok(R"({"prompt": "a", "logit_bias": {"512": 1}})");  // the vocabulary has 512 tokens
  try {
    to_engine_request(r, f, 0);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("logit_bias token id 512"), std::string::npos) << e.what();
  }
}

// min_tokens passes through; stop_token_ids join the stop ids (with ignore_eos too, as vLLM only
// ignores EOS) and are checked against the vocabulary; max_tokens 0 runs one token the server drops;
// echo's logprobs and prompt_logprobs share one engine count, the larger.
TEST(BatchRequest, EngineRequestStopTokenIdsMinTokensAndPromptLogprobs) {
  const std::string path = test::data_dir() + "/stories260K/stories260K.gguf";
  KESTREL_REQUIRE_FILE(path);
  const Loaded l = load(path);
  const PromptFormat f = PromptFormat::for_model(*l.model, *l.tokenizer);
  ASSERT_FALSE(f.stop_ids.empty());

  Request q = to_engine_request(parse_ok(R"({"prompt": "a", "min_tokens": 4, "stop_token_ids": [13, 7]})"), f, 0);
  EXPECT_EQ(q.min_tokens, 4);
  std::vector<int32_t> want = f.stop_ids;
  want.push_back(13);
  want.push_back(7);
  EXPECT_EQ(q.stop_ids, want);
  q = to_engine_request(parse_ok(R"({"prompt": "a", "ignore_eos": true, "stop_token_ids": [13]})"), f, 0);
  EXPECT_EQ(q.stop_ids, (std::vector<int32_t>{13}));
  try {
    to_engine_request(parse_ok(R"({"prompt": "a", "stop_token_ids": [5, 512]})"), f, 0);  // 512 tokens
    ADD_FAILURE() << "no error";
  } catch (const RequestError& e) {
    EXPECT_EQ(e.param(), "stop_token_ids");
    EXPECT_NE(std::string(e.what()).find("stop_token_ids[1] = 512 is outside the vocabulary"), std::string::npos)
        << e.what();
  }

  auto completions = [&](const char* body) {
    return to_engine_request(parse_openai_request(parse_request_body(body), RequestApi::Completions), f, 0);
  };
  q = completions(R"({"prompt": "a", "max_tokens": 0, "echo": true, "logprobs": 2})");
  EXPECT_EQ(q.max_tokens, 1);
  EXPECT_EQ(q.prompt_logprobs, 2);
  EXPECT_EQ(completions(R"({"prompt": "a", "prompt_logprobs": 5, "echo": true, "logprobs": 2})").prompt_logprobs, 5);
  EXPECT_EQ(completions(R"({"prompt": "a", "prompt_logprobs": 1, "echo": true, "logprobs": 3})").prompt_logprobs, 3);
  EXPECT_EQ(completions(R"({"prompt": "a", "prompt_logprobs": 0})").prompt_logprobs, 0);
  EXPECT_EQ(completions(R"({"prompt": "a", "logprobs": 4})").prompt_logprobs, -1);
}

TEST(BatchRequest, EngineRequestFromMessagesStopsAtEndOfTurn) {
  const std::string path = test::model_dir() + "/SmolLM2-135M-Instruct.Q4_1.gguf";
  KESTREL_REQUIRE_FILE(path);
  const Loaded l = load(path);
  const PromptFormat f = PromptFormat::for_model(*l.model, *l.tokenizer);
  ASSERT_EQ(f.chat_template.kind(), ChatTemplate::Kind::ChatML);
  const auto im_end = l.tokenizer->token_id("<|im_end|>");
  ASSERT_TRUE(im_end);
  ASSERT_EQ(f.end_of_turn_id, im_end);

  const BatchRequest r = parse_ok(R"({"messages": [{"role": "user", "content": "Hi"}]})");
  const Request q = to_engine_request(r, f, 1);
  const std::string text = f.chat_template.apply(r.messages, true);
  EXPECT_EQ(q.prompt, l.tokenizer->encode(text, true, true));
  EXPECT_EQ(std::count(q.prompt.begin(), q.prompt.end(), *l.tokenizer->token_id("<|im_start|>")), 3);  // system, user, assistant
  EXPECT_EQ(std::count(q.stop_ids.begin(), q.stop_ids.end(), *im_end), 1);

  // SmolLM2 adds no BOS: an empty prompt has no tokens at all.
  try {
    to_engine_request(parse_ok(R"({"prompt": ""})"), f, 1);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no tokens"), std::string::npos) << e.what();
  }
}

// vLLM's token filters and output fields reach the engine request: allowed_token_ids checked
// against the vocabulary, bad_words tokenized with and without a leading space (vLLM's
// update_from_tokenizer), truncate_prompt_tokens keeping the prompt's last tokens (-1: the context;
// above the context: refused).
TEST(BatchRequest, EngineRequestTokenFiltersAndTruncation) {
  const std::string path = test::data_dir() + "/stories260K/stories260K.gguf";
  KESTREL_REQUIRE_FILE(path);
  const Loaded l = load(path);
  PromptFormat f = PromptFormat::for_model(*l.model, *l.tokenizer);
  f.max_model_len = 64;
  const Tokenizer& tok = *l.tokenizer;

  Request q = to_engine_request(parse_ok(R"({"prompt": "a", "allowed_token_ids": [5, 9], "include_stop_str_in_output": true,
                                            "skip_special_tokens": false})"),
                                f, 0);
  EXPECT_EQ(q.allowed_token_ids, (std::vector<int32_t>{5, 9}));
  EXPECT_TRUE(q.include_stop_str_in_output);
  EXPECT_FALSE(q.skip_special_tokens);
  EXPECT_TRUE(to_engine_request(parse_ok(R"({"prompt": "a"})"), f, 0).skip_special_tokens);
  try {
    to_engine_request(parse_ok(R"({"prompt": "a", "allowed_token_ids": [5, 512]})"), f, 0);  // 512 tokens
    ADD_FAILURE() << "no error";
  } catch (const RequestError& e) {
    EXPECT_EQ(e.param(), "allowed_token_ids");
    EXPECT_NE(std::string(e.what()).find("allowed_token_ids[1] = 512 is outside the vocabulary"), std::string::npos)
        << e.what();
  }

  // vLLM's rule: "word" as it is, and " word" when it starts with another token and has as many.
  q = to_engine_request(parse_ok(R"({"prompt": "a", "bad_words": ["  upon", "Once upon"]})"), f, 0);
  std::vector<std::vector<int32_t>> want;
  for (const std::string w : {"upon", "Once upon"}) {
    const std::vector<int32_t> plain = tok.encode(w, false, true), spaced = tok.encode(" " + w, false, true);
    want.push_back(plain);
    if (spaced[0] != plain[0] && spaced.size() == plain.size()) want.push_back(spaced);
  }
  EXPECT_EQ(q.bad_words, want);
  EXPECT_GE(q.bad_words.size(), 2u);

  const std::vector<int32_t> full = tok.encode("Once upon a time there was", true, true);
  ASSERT_GT(full.size(), 4u);
  q = to_engine_request(parse_ok(R"({"prompt": "Once upon a time there was", "truncate_prompt_tokens": 3})"), f, 0);
  EXPECT_EQ(q.prompt, std::vector<int32_t>(full.end() - 3, full.end()));
  bool cut = false;
  EXPECT_EQ(to_engine_request(parse_ok(R"({"prompt": [1, 5, 9], "truncate_prompt_tokens": 3})"), f, 0, 0, &cut).prompt,
            (std::vector<int32_t>{1, 5, 9}));
  EXPECT_FALSE(cut);
  EXPECT_EQ(to_engine_request(parse_ok(R"({"prompt": [1, 5, 9], "truncate_prompt_tokens": 2})"), f, 0, 0, &cut).prompt,
            (std::vector<int32_t>{5, 9}));
  EXPECT_TRUE(cut);
  std::string long_ids = R"({"prompt": [1)";
  for (int i = 0; i < 100; ++i) long_ids += ", " + std::to_string(10 + i);
  q = to_engine_request(parse_ok(long_ids + R"(], "truncate_prompt_tokens": -1})"), f, 0);
  ASSERT_EQ(q.prompt.size(), 64u);  // max_model_len
  EXPECT_EQ(q.prompt.back(), 109);
  try {
    to_engine_request(parse_ok(R"({"prompt": "a", "truncate_prompt_tokens": 65})"), f, 0);
    ADD_FAILURE() << "no error";
  } catch (const RequestError& e) {
    EXPECT_EQ(e.param(), "truncate_prompt_tokens");
    EXPECT_NE(std::string(e.what()).find("greater than max_model_len (64)"), std::string::npos) << e.what();
  }
}

// vLLM's stop_reason: the stop string, or a stop_token_ids id that ended the choice; null for EOS
// (unless ignore_eos made it a request's stop id), a grammar's end and any finish but "stop".
TEST(BatchRequest, StopReason) {
  const std::string path = test::data_dir() + "/stories260K/stories260K.gguf";
  KESTREL_REQUIRE_FILE(path);
  const Loaded l = load(path);
  const PromptFormat f = PromptFormat::for_model(*l.model, *l.tokenizer);
  const int32_t eos = l.tokenizer->eos_id();
  ASSERT_GE(eos, 0);
  const std::string ids = R"(, "stop_token_ids": [13, )" + std::to_string(eos) + "]}";
  const std::vector<int32_t> reported = reported_stop_ids(parse_ok(R"({"prompt": "a")" + ids), f);
  EXPECT_EQ(reported, (std::vector<int32_t>{13}));
  EXPECT_EQ(reported_stop_ids(parse_ok(R"({"prompt": "a", "ignore_eos": true)" + ids), f),
            (std::vector<int32_t>{13, eos}));
  RequestOutput o;
  o.finish_reason = "stop";
  EXPECT_TRUE(stop_reason_json(o, reported).is_null());  // a grammar's end: no stop string, no stop id
  o.stop_token = 13;
  EXPECT_EQ(stop_reason_json(o, reported), 13);
  o.stop_token = eos;
  EXPECT_TRUE(stop_reason_json(o, reported).is_null());
  o.stop_token = -1;
  o.stop_string = "The end";
  EXPECT_EQ(stop_reason_json(o, reported), "The end");
  o.finish_reason = "length";
  EXPECT_TRUE(stop_reason_json(o, reported).is_null());
}

}  // namespace
}  // namespace kestrel::cli
