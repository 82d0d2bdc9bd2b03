// Beam search in the engine against Hugging Face transformers: generate(num_beams=B,
// do_sample=False, length_penalty, early_stopping, max_new_tokens=24, num_return_sequences=B) on
// stories260K (F32), 10 prompts x 5 settings (B = 2 and 4; length penalties 1, 0.5, 2, -1; early
// stopping false, true, "never"; stop ids "." and newline, so that most beams end by a stop id),
// recorded by tests/reference/beam_reference.py in tests/data/beam_stories260k.json. Every returned beam must be token-identical, its score and
// cumulative log-probability within 1e-4 (transformers sums float32 log-probabilities). The
// requests run together in one engine, beams forking the prompt's blocks; once more with a KV
// pool and sequence cap small enough to preempt beams and refuse forks, which must change nothing.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <fstream>
#include <map>
#include <set>

#include "engine/engine.h"
#include "io/gguf.h"
#include "test_util.h"

using namespace kestrel;
using nlohmann::json;

namespace {

constexpr double kScoreTol = 1e-4;

struct Case {
  std::vector<int32_t> prompt;
  std::vector<int32_t> stop_ids;
  BeamSearchParams beam;
  int64_t max_new_tokens = 0;
  std::vector<BeamHypothesis> expected;
  std::string name;
};

using test::stories_path;

std::vector<Case> load_cases() {
  const json doc = json::parse(test::read_file(std::string(KESTREL_TEST_SOURCE_DIR) + "/data/beam_stories260k.json"));
  std::vector<Case> out;
  for (const json& c : doc.at("cases")) {
    Case k;
    k.prompt = c.at("prompt_ids").get<std::vector<int32_t>>();
    k.stop_ids = c.at("stop_ids").get<std::vector<int32_t>>();
    k.beam.beam_width = c.at("num_beams").get<int32_t>();
    k.beam.n_best = k.beam.beam_width;
    k.beam.length_penalty = c.at("length_penalty").get<double>();
    const json& es = c.at("early_stopping");
    k.beam.early_stopping = es.is_boolean() ? (es.get<bool>() ? EarlyStopping::Done : EarlyStopping::Heuristic)
                                            : parse_early_stopping(es.get<std::string>());
    k.max_new_tokens = c.at("max_new_tokens").get<int64_t>();
    for (const json& b : c.at("beams")) {
      BeamHypothesis h;
      h.tokens = b.at("tokens").get<std::vector<int32_t>>();
      h.score = b.at("score").get<double>();
      h.sum_logprobs = b.at("sum_logprobs").get<double>();
      k.expected.push_back(std::move(h));
    }
    k.name = c.at("prompt").get<std::string>() + " B=" + std::to_string(k.beam.beam_width) +
             " lp=" + std::to_string(k.beam.length_penalty) + " es=" + to_string(k.beam.early_stopping);
    out.push_back(std::move(k));
  }
  return out;
}

// Runs every case in one engine; returns each case's beams and the engine's stats.
std::vector<std::vector<BeamHypothesis>> run(const LlamaModel& model, const std::vector<Case>& cases, EngineConfig c,
                                             EngineStats* stats) {
  c.kv_dtype = KvDtype::F32;  // the model's own precision, as transformers runs it
  c.max_model_len = 64;
  Engine engine(model, nullptr, c);
  std::map<RequestId, size_t> index;
  for (size_t i = 0; i < cases.size(); ++i) {
    Request r;
    r.prompt = cases[i].prompt;
    r.max_tokens = cases[i].max_new_tokens;
    r.stop_ids = cases[i].stop_ids;
    r.beam = cases[i].beam;
    index[engine.add_request(r)] = i;
  }
  std::vector<std::vector<BeamHypothesis>> out(cases.size());
  std::set<size_t> done;
  while (engine.has_unfinished())
    for (RequestOutput& o : engine.step()) {
      EXPECT_TRUE(o.finished) << "a beam-search request reports only its end";
      EXPECT_NE(o.finish_reason, "error") << o.error;
      const size_t i = index.at(o.id);
      EXPECT_TRUE(done.insert(i).second);
      if (!o.beams.empty()) EXPECT_EQ(o.new_token_ids, o.beams.front().tokens);
      out[i] = std::move(o.beams);
    }
  EXPECT_EQ(engine.stats().kv_blocks_used, 0) << "every beam's blocks returned";
  *stats = engine.stats();
  return out;
}

void expect_matches(const std::vector<Case>& cases, const std::vector<std::vector<BeamHypothesis>>& got) {
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    ASSERT_EQ(got[i].size(), c.expected.size()) << c.name;
    for (size_t b = 0; b < c.expected.size(); ++b) {
      EXPECT_EQ(got[i][b].tokens, c.expected[b].tokens) << c.name << " beam " << b;
      EXPECT_NEAR(got[i][b].score, c.expected[b].score, kScoreTol) << c.name << " beam " << b;
      EXPECT_NEAR(got[i][b].sum_logprobs, c.expected[b].sum_logprobs, kScoreTol) << c.name << " beam " << b;
    }
  }
}

// 8 blocks of 8 tokens, at most 6 sequences and 64 tokens a step: far too small for the cases.
EngineConfig tight_pool() {
  EngineConfig c;
  c.max_num_seqs = 6;
  c.block_size = 8;
  c.n_kv_blocks = 8;
  c.max_num_batched_tokens = 64;
  return c;
}

}  // namespace

TEST(BeamSearchEngine, MatchesTransformersOnStories260K) {
  KESTREL_REQUIRE_FILE(stories_path());
  const auto model = LlamaModel::load_gguf(stories_path());
  const std::vector<Case> cases = load_cases();
  ASSERT_EQ(cases.size(), 50u);
  EngineConfig c;
  c.max_num_seqs = 256;
  EngineStats stats;
  const auto got = run(*model, cases, c, &stats);
  expect_matches(cases, got);
  // Each distinct prompt is computed once: its other requests and every beam fork its blocks.
  int64_t n_distinct = 0;
  std::set<std::vector<int32_t>> seen;
  for (const Case& k : cases)
    if (seen.insert(k.prompt).second) n_distinct += static_cast<int64_t>(k.prompt.size());
  EXPECT_EQ(stats.n_prompt_tokens_computed, n_distinct);
  EXPECT_EQ(stats.n_preemptions, 0);
}

// 8 blocks of 8 tokens and at most 6 sequences for 50 requests of up to 4 beams: beams are
// preempted and recompute their tokens, forks find no sequence slot (the child computes its
// tokens itself), beams with their rows step aside for waiting siblings. The beams are the same.
TEST(BeamSearchEngine, PreemptionAndRefusedForksChangeNothing) {
  KESTREL_REQUIRE_FILE(stories_path());
  const auto model = LlamaModel::load_gguf(stories_path());
  const std::vector<Case> cases = load_cases();
  const EngineConfig c = tight_pool();
  EngineStats stats;
  const auto got = run(*model, cases, c, &stats);
  expect_matches(cases, got);
  EXPECT_GT(stats.n_preemptions, 0);
  EXPECT_GT(stats.n_prompt_tokens_computed, 1000) << "recomputation";
}

// The same pool with a host swap space: a preempted beam that holds no block a sibling shares is
// swapped out and back, the others are recomputed. The beams are the same.
TEST(BeamSearchEngine, PreemptionBySwapChangesNothing) {
  KESTREL_REQUIRE_FILE(stories_path());
  const auto model = LlamaModel::load_gguf(stories_path());
  const std::vector<Case> cases = load_cases();
  EngineConfig c = tight_pool();
  c.swap_space_bytes = int64_t{1} << 20;  // stories260K's blocks of 8 tokens are a few KiB
  c.preemption_mode = PreemptionMode::Swap;
  EngineStats stats;
  const auto got = run(*model, cases, c, &stats);
  expect_matches(cases, got);
  EXPECT_GT(stats.n_swap_preemptions, 0);
  EXPECT_EQ(stats.n_swapped_in_blocks, stats.n_swapped_out_blocks);
  EXPECT_EQ(stats.swap_blocks_free, stats.n_swap_blocks);
}

// The same pool with the prefix cache's host tier: prompt blocks the tight pool evicts come back
// from host memory for later requests and recomputed beams. The beams are transformers'.
TEST(BeamSearchEngine, HostTierHitsChangeNothing) {
  KESTREL_REQUIRE_FILE(stories_path());
  const auto model = LlamaModel::load_gguf(stories_path());
  const std::vector<Case> cases = load_cases();
  EngineConfig c = tight_pool();
  c.cpu_offload_kv_bytes = int64_t{1} << 20;
  EngineStats stats;
  const auto got = run(*model, cases, c, &stats);
  expect_matches(cases, got);
  EXPECT_GT(stats.n_offloaded_blocks, 0);
  EXPECT_GT(stats.n_offload_hit_blocks, 0);
}

// `kestrel batch` lines with use_beam_search: the best beam of transformers' search (the cases that
// stop at the model's EOS, as batch does), with its cumulative logprob; each case twice, its beam
// width given as best_of and as n (the width when best_of is absent).
TEST(BeamSearchEngine, BatchLinesReturnTheBestBeam) {
  KESTREL_REQUIRE_FILE(stories_path());
  const json doc = json::parse(test::read_file(std::string(KESTREL_TEST_SOURCE_DIR) + "/data/beam_stories260k.json"));
  const std::string in = test::temp_path("beam_batch", ".jsonl"), out = test::temp_path("beam_batch_out", ".jsonl");
  {
    std::ofstream f(in);
    for (size_t i = 0; i < 2 * doc.at("server_cases").size(); ++i) {
      const json& c = doc["server_cases"][i / 2];
      f << json{{"id", i}, {"prompt", c["prompt_ids"]}, {"use_beam_search", true},
                {i % 2 ? "n" : "best_of", c["num_beams"]}, {"max_tokens", c["max_new_tokens"]}, {"length_penalty", c["length_penalty"]},
                {"early_stopping", c["early_stopping"]}, {"temperature", 0}}
                  .dump()
           << "\n";
    }
  }
  std::string log;
  ASSERT_EQ(test::run_command(test::kestrel_binary() + " batch -m " + stories_path() + " -i " + in + " -o " + out + " 2>&1",
                              &log),
            0)
      << log;
  std::ifstream f(out);
  size_t n = 0;
  for (std::string line; std::getline(f, line); ++n) {
    const json r = json::parse(line);
    const json& best = doc["server_cases"][r.at("id").get<size_t>() / 2]["beams"][0];
    EXPECT_EQ(r.at("output_ids"), best.at("tokens")) << line;
    EXPECT_NEAR(r.at("cumulative_logprob").get<double>(), best.at("sum_logprobs").get<double>(), kScoreTol);
  }
  EXPECT_EQ(n, 2 * doc["server_cases"].size());
  std::remove(in.c_str());
  std::remove(out.c_str());
}

TEST(BeamSearchEngine, RefusesWhatBeamsDoNotTake) {
  KESTREL_REQUIRE_FILE(stories_path());
  const auto model = LlamaModel::load_gguf(stories_path());
  const auto tok = Tokenizer::from_gguf(model->file());
  Engine engine(*model, tok.get(), EngineConfig{});
  Request r;
  r.prompt = {1, 403};
  r.beam.beam_width = 2;
  r.beam.n_best = 3;
  EXPECT_NE(test::error_of([&] { engine.add_request(r); }).find("beams returned"), std::string::npos);
  r.beam.n_best = 2;
  r.logprobs = 0;
  EXPECT_NE(test::error_of([&] { engine.add_request(r); }).find("logprobs"), std::string::npos);
  r.logprobs = -1;
  r.stop = {"x"};
  EXPECT_NE(test::error_of([&] { engine.add_request(r); }).find("stop strings"), std::string::npos);
  EXPECT_FALSE(engine.has_unfinished());
}
