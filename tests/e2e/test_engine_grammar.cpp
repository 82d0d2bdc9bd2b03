// Structured output through the engine on stories260K (a 512-token SentencePiece vocabulary with
// byte fallback): sampled at temperature 1, every output must parse and satisfy its constraint,
// checked here by hand-written validation independent of the grammar engine, and must end with
// "stop" once the grammar is complete.
#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <regex>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/engine.h"
#include "grammar_mix.h"
#include "sampling/grammar/constraint.h"
#include "sampling_runner.h"
#include "test_util.h"

using namespace kestrel;

namespace {

struct Outcome {
  std::string text;
  std::string finish_reason;
};

// stories260K, its tokenizer and grammar cache, and an engine of 512 positions over them.
struct StoriesEngine {
  static EngineConfig config() {
    EngineConfig cfg;
    cfg.max_model_len = 512;
    return cfg;
  }
  decltype(LlamaModel::load_gguf("")) model = LlamaModel::load_gguf(test::data_dir() + "/stories260K/stories260K.gguf");
  decltype(Tokenizer::from_gguf(model->file())) tok = Tokenizer::from_gguf(model->file());
  decltype(grammar::GrammarCache::for_tokenizer(*tok)) cache = grammar::GrammarCache::for_tokenizer(*tok);
  Engine e{*model, tok.get(), config()};
};

std::vector<Outcome> run_constrained(const grammar::Constraint& c, int n, int64_t max_tokens) {
  StoriesEngine s;
  auto& [model, tok, cache, e] = s;
  std::map<RequestId, size_t> index;
  std::vector<std::vector<int32_t>> ids(static_cast<size_t>(n));
  std::vector<Outcome> out(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    Request r;
    r.prompt = tok->encode("Once upon a time", true, false);
    r.max_tokens = max_tokens;
    r.sampling.temperature = 1.0f;
    r.sampling.seed = 100 + static_cast<uint64_t>(i);
    r.stop_ids = {tok->eos_id()};
    r.grammar = cache->get(c);
    index[e.add_request(r)] = static_cast<size_t>(i);
  }
  while (e.has_unfinished()) {
    for (const RequestOutput& o : e.step()) {
      const size_t i = index.at(o.id);
      ids[i].insert(ids[i].end(), o.new_token_ids.begin(), o.new_token_ids.end());
      if (o.finished) out[i].finish_reason = o.finish_reason;
    }
  }
  for (int i = 0; i < n; ++i) {
    std::vector<int32_t> text_ids;
    for (int32_t id : ids[static_cast<size_t>(i)])
      if (id != tok->eos_id()) text_ids.push_back(id);
    out[static_cast<size_t>(i)].text = tok->decode(text_ids, true, true);
  }
  return out;
}

TEST(EngineGrammar, JsonSchemaOutputsParseAndValidate) {
  KESTREL_REQUIRE_FILE(test::data_dir() + "/stories260K/stories260K.gguf");
  grammar::Constraint c;
  c.kind = grammar::ConstraintKind::JSON_SCHEMA;
  c.text = R"({"type":"object","properties":{"name":{"type":"string","maxLength":8},
    "age":{"type":"integer","minimum":0,"maximum":120},
    "tags":{"type":"array","items":{"enum":["cat","dog"]},"maxItems":3}},
    "required":["name","age"],"additionalProperties":false})";
  for (const Outcome& o : run_constrained(c, 8, 300)) {
    EXPECT_EQ(o.finish_reason, "stop") << o.text;
    nlohmann::json v;
    ASSERT_NO_THROW(v = nlohmann::json::parse(o.text)) << o.text;
    ASSERT_TRUE(v.is_object()) << o.text;
    ASSERT_TRUE(v.contains("name") && v["name"].is_string()) << o.text;
    // maxLength counts code points.
    size_t cps = 0;
    for (unsigned char ch : v["name"].get<std::string>()) cps += (ch & 0xC0) != 0x80;
    EXPECT_LE(cps, 8u) << o.text;
    ASSERT_TRUE(v.contains("age") && v["age"].is_number_integer()) << o.text;
    EXPECT_GE(v["age"].get<int64_t>(), 0) << o.text;
    EXPECT_LE(v["age"].get<int64_t>(), 120) << o.text;
    for (const auto& [k, x] : v.items()) {
      EXPECT_TRUE(k == "name" || k == "age" || k == "tags") << o.text;
      if (k != "tags") continue;
      ASSERT_TRUE(x.is_array()) << o.text;
      EXPECT_LE(x.size(), 3u) << o.text;
      for (const auto& t : x) EXPECT_TRUE(t == "cat" || t == "dog") << o.text;
    }
  }
}

TEST(EngineGrammar, RegexAndChoiceOutputsMatch) {
  KESTREL_REQUIRE_FILE(test::data_dir() + "/stories260K/stories260K.gguf");
  grammar::Constraint re;
  re.kind = grammar::ConstraintKind::REGEX;
  re.text = "(Lily|Tom) is [0-9]{1,2} years old\\.";
  for (const Outcome& o : run_constrained(re, 4, 100)) {
    EXPECT_EQ(o.finish_reason, "stop") << o.text;
    EXPECT_TRUE(std::regex_match(o.text, std::regex("(Lily|Tom) is [0-9]{1,2} years old\\."))) << o.text;
  }
  grammar::Constraint ch;
  ch.kind = grammar::ConstraintKind::CHOICE;
  ch.choices = {"happy", "sad", "sleepy dog"};
  for (const Outcome& o : run_constrained(ch, 4, 50)) {
    EXPECT_EQ(o.finish_reason, "stop") << o.text;
    EXPECT_TRUE(o.text == "happy" || o.text == "sad" || o.text == "sleepy dog") << o.text;
  }
}

// A grammar too ambiguous to match in bounded time (grammar::GrammarMatcher::kMaxStacksSeen) ends
// its own request with an error once its parses pile up; the engine serves the request beside it.
TEST(EngineGrammar, ATooAmbiguousGrammarEndsItsRequestAndTheEngineServesOn) {
  KESTREL_REQUIRE_FILE(test::data_dir() + "/stories260K/stories260K.gguf");
  StoriesEngine s;
  auto& [model, tok, cache, e] = s;
  grammar::Constraint c;
  c.kind = grammar::ConstraintKind::REGEX;
  c.text = "(((((a?){0,8}){0,8}){0,8}){0,8}){0,8}";
  Request bad;
  bad.prompt = tok->encode("Once upon a time", true, false);
  bad.max_tokens = 400;
  bad.min_tokens = 400;  // EOS held back: the text grows until the bound
  bad.stop_ids = {tok->eos_id()};
  bad.grammar = cache->get(c);
  Request plain;
  plain.prompt = bad.prompt;
  plain.max_tokens = 40;
  plain.sampling.temperature = 0.0f;
  const RequestId bad_id = e.add_request(bad), plain_id = e.add_request(plain);
  std::map<RequestId, RequestOutput> last;
  std::map<RequestId, int64_t> n_tokens;
  while (e.has_unfinished())
    for (const RequestOutput& o : e.step()) {
      n_tokens[o.id] += static_cast<int64_t>(o.new_token_ids.size());
      last[o.id] = o;
    }
  EXPECT_EQ(last[bad_id].finish_reason, "error");
  EXPECT_NE(last[bad_id].error.find("too ambiguous"), std::string::npos) << last[bad_id].error;
  EXPECT_GE(n_tokens[bad_id], 8);
  EXPECT_EQ(last[plain_id].finish_reason, "length");
  EXPECT_EQ(n_tokens[plain_id], 40);
}

// Grammar rows sampled through forward_sample, each under the token mask the engine computes for
// it, against the host path (forward(), the mask applied to the logits row, the request's own
// Sampler): the same logits (the CPU backend), so the same tokens and finish reasons for every
// request, constrained and plain, greedy and seeded, in one batch; every constrained output valid.
TEST(EngineGrammar, DeviceSamplingUnderTokenMasksGivesTheHostPathsTokens) {
  KESTREL_REQUIRE_FILE(test::data_dir() + "/stories260K/stories260K.gguf");
  auto model = LlamaModel::load_gguf(test::data_dir() + "/stories260K/stories260K.gguf");
  auto tok = Tokenizer::from_gguf(model->file());
  auto cache = grammar::GrammarCache::for_tokenizer(*tok);
  const std::vector<Request> requests = test::mixed_grammar_requests(*tok, *cache, 300);
  EngineConfig cfg;
  cfg.max_model_len = 512;
  cfg.n_kv_blocks = 256;
  cfg.max_num_batched_tokens = 32;  // prompts in chunks beside decodes
  Engine host(*model, tok.get(), cfg);
  const auto want = test::run_requests(host, requests);
  test::expect_outputs_follow_their_constraints(*tok, want, /*require_stop=*/true);

  RunnerOptions o;
  o.n_kv_blocks = cfg.n_kv_blocks;
  auto runner = std::make_unique<test::SamplingRunner>(make_cpu_model_runner(*model, o), /*on_device=*/true);
  test::SamplingRunner* dev = runner.get();
  Engine device(*model, tok.get(), cfg, std::move(runner));
  EXPECT_EQ(test::run_requests(device, requests), want);
  EXPECT_EQ(dev->host_calls, 0);
  EXPECT_GT(dev->masked_rows, 0);
}

}  // namespace
