// End-to-end tests of `kestrel batch`: many requests run together give the same tokens as each run
// alone with `kestrel generate` (with chunked prefill, interleaving and preemption), bad lines get
// error results in order while the rest runs, stop strings cut the text, exit codes.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "test_util.h"

using kestrel::test::data_dir;
using kestrel::test::kestrel_binary;
using kestrel::test::model_dir;
using kestrel::test::run_command;
using nlohmann::json;

namespace {

std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

std::string stories_model() { return data_dir() + "/stories260K/stories260K.gguf"; }
std::string smollm2_model() { return model_dir() + "/SmolLM2-135M-Instruct.Q4_1.gguf"; }

// A fresh directory for one test's files, removed at the end.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "kestrel_batch_XXXXXX").string();
    if (::mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

void write_text(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary);
  f << text;
}

std::string jsonl(const std::vector<json>& requests) {
  std::string out;
  for (const json& r : requests) out += r.dump() + "\n";
  return out;
}

std::vector<json> read_results(const std::string& path) {
  std::ifstream f(path);
  std::vector<json> out;
  std::string line;
  while (std::getline(f, line)) out.push_back(json::parse(line));
  return out;
}

// The result whose id is `id` (results come in completion order and are matched by id); null
// when there is none.
json result_with_id(const std::vector<json>& results, const json& id) {
  for (const json& r : results)
    if (r.contains("id") && r["id"] == id) return r;
  ADD_FAILURE() << "no result with id " << id.dump();
  return nullptr;
}

struct BatchRun {
  int rc = -1;
  std::vector<json> results;  // in input order (matched by id: each request's "id", else its line index)
  std::vector<json> written;  // as written: in completion order
  json stats;
  std::string err;  // stderr
};

// Runs `kestrel batch -i requests -o results --stats-json ... <flags>` in dir.
BatchRun run_batch(const TempDir& dir, const std::vector<json>& requests, const std::string& flags) {
  write_text(dir / "requests.jsonl", jsonl(requests));
  std::remove((dir / "results.jsonl").c_str());
  std::remove((dir / "stats.json").c_str());
  BatchRun r;
  r.rc = run_command(kestrel_binary() + " batch -i " + dir / "requests.jsonl" + " -o " + dir / "results.jsonl" +
                         " --stats-json " + dir / "stats.json" + " " + flags + " 2>" + dir / "stderr.txt",
                     nullptr);
  r.written = read_results(dir / "results.jsonl");
  for (size_t i = 0; i < requests.size() && r.written.size() == requests.size(); ++i)
    r.results.push_back(result_with_id(r.written, requests[i].contains("id") ? requests[i]["id"] : json(i)));
  r.err = kestrel::test::read_file(dir / "stderr.txt");
  if (kestrel::test::file_exists(dir / "stats.json")) r.stats = json::parse(kestrel::test::read_file(dir / "stats.json"));
  return r;
}

// `kestrel generate --json` on one prompt alone (greedy).
json generate_alone(const std::string& model, const std::string& prompt, int max_tokens) {
  std::string out;
  const std::string cmd = kestrel_binary() + " generate -m " + model + " -p " + shell_quote(prompt) + " -n " +
                          std::to_string(max_tokens) + " --temperature 0 --json 2>/dev/null";
  EXPECT_EQ(run_command(cmd, &out), 0) << cmd;
  return json::parse(out);
}

// 32 different openings; every fourth one is long enough (> 64 tokens) to need several prefill chunks.
std::vector<std::string> story_prompts() {
  const char* names[] = {"Sam", "Mia", "Ben", "Anna", "Jack", "Zoe", "Tom", "Lucy"};
  const char* starts[] = {"Once upon a time, %s found a red ball", "%s wanted to bake a cake",
                          "One sunny day, %s and a puppy went to the lake", "%s was sad because the toy broke"};
  std::vector<std::string> out;
  for (int i = 0; i < 32; ++i) {
    char buf[128];
    std::snprintf(buf, sizeof buf, starts[i % 4], names[i / 4]);
    std::string p = buf;
    if (i % 4 == 3)
      p = "The sun was shining and the birds were singing in the big green tree next to the house. " + p +
          ", so " + names[(i + 1) % 8] + " gave a hug and they played together all day long in the garden";
    out.push_back(p);
  }
  return out;
}

void expect_same_as_generate(const std::string& model, const std::vector<std::string>& prompts,
                             const std::vector<json>& results, int max_tokens, bool compare_text) {
  ASSERT_EQ(results.size(), prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) {
    SCOPED_TRACE("prompt " + std::to_string(i) + ": " + prompts[i]);
    const json& r = results[i];
    ASSERT_FALSE(r.contains("error")) << r.dump();
    EXPECT_EQ(r["id"], i);
    const json g = generate_alone(model, prompts[i], max_tokens);
    EXPECT_EQ(r["output_ids"], g["output_ids"]);
    EXPECT_EQ(r["finish_reason"], g["finish_reason"]);
    EXPECT_EQ(r["usage"]["prompt_tokens"], g["prompt_ids"].size());
    EXPECT_EQ(r["usage"]["completion_tokens"], r["output_ids"].size());
    EXPECT_EQ(r["usage"]["total_tokens"], r["usage"]["prompt_tokens"].get<int>() + r["output_ids"].size());
    if (compare_text) EXPECT_EQ(r["text"], g["text"]);
  }
}

}  // namespace

// (a) Chunked prefill (64 tokens a step, prompts up to ~90 tokens) and 8 sequences interleaved.
// Text is not compared here: the engine drops the SentencePiece leading space of the first output
// piece where `generate` keeps it (it decodes as a continuation of the prompt).
TEST(CliBatch, ThirtyTwoStoriesTogetherMatchGenerateAlone) {
  KESTREL_REQUIRE_FILE(stories_model());
  const auto prompts = story_prompts();
  std::vector<json> requests;
  for (const auto& p : prompts) requests.push_back({{"prompt", p}, {"max_tokens", 48}, {"temperature", 0}});
  TempDir dir;
  const BatchRun run =
      run_batch(dir, requests, "-m " + stories_model() + " --max-num-batched-tokens 64 --max-num-seqs 8");
  ASSERT_EQ(run.rc, 0) << run.err;
  expect_same_as_generate(stories_model(), prompts, run.results, 48, /*compare_text=*/true);
  EXPECT_EQ(run.stats["requests"], 32);
  EXPECT_EQ(run.stats["errors"], 0);
  EXPECT_GT(run.stats["prompt_tokens"].get<int>(), 32 * 8);
  EXPECT_NE(run.err.find("32 requests (0 with errors)"), std::string::npos) << run.err;
}

TEST(CliBatch, SmolLM2PromptsTogetherMatchGenerateAlone) {
  KESTREL_REQUIRE_FILE(smollm2_model());
  const std::vector<std::string> prompts = {
      "The capital of France is", "My favourite fruit is", "def fibonacci(n):", "The three primary colours are",
      "Water boils at", "1, 2, 3, 4,", "The quick brown fox", "In 1969, astronauts"};
  std::vector<json> requests;
  for (const auto& p : prompts) requests.push_back({{"prompt", p}, {"max_tokens", 16}, {"temperature", 0}});
  TempDir dir;
  const BatchRun run = run_batch(dir, requests, "-m " + smollm2_model() + " --max-num-batched-tokens 16 --max-num-seqs 4");
  ASSERT_EQ(run.rc, 0) << run.err;
  expect_same_as_generate(smollm2_model(), prompts, run.results, 16, /*compare_text=*/true);
}

// (b) A pool of 12 blocks of 16 tokens holds at most one full sequence of 128 tokens: sequences
// are preempted (recomputed later, or swapped to host memory and back) and still give the tokens
// of an unconstrained run.
TEST(CliBatch, PreemptionKeepsOutputsIdentical) {
  KESTREL_REQUIRE_FILE(stories_model());
  std::vector<std::string> prompts;  // short ones, so prompt + 100 tokens fit in 128
  for (const std::string& p : story_prompts())
    if (p.size() < 60 && prompts.size() < 8) prompts.push_back(p);
  std::vector<json> requests;
  for (const std::string& p : prompts)
    requests.push_back({{"prompt", p}, {"max_tokens", 100}, {"temperature", 0}, {"ignore_eos", true}});
  TempDir dir;
  const std::string common = "-m " + stories_model() + " --max-model-len 128 --block-size 16 --max-num-seqs 8";
  const BatchRun tight = run_batch(dir, requests, common + " --num-kv-blocks 12");
  ASSERT_EQ(tight.rc, 0) << tight.err;
  const BatchRun roomy = run_batch(dir, requests, common);
  ASSERT_EQ(roomy.rc, 0) << roomy.err;
  EXPECT_GT(tight.stats["preemptions"].get<int>(), 0);
  EXPECT_EQ(tight.stats["kv_blocks"], 12);
  EXPECT_LE(tight.stats["peak_kv_blocks_used"].get<int>(), 12);
  EXPECT_EQ(roomy.stats["preemptions"], 0);
  ASSERT_EQ(tight.results.size(), 8u);
  ASSERT_EQ(roomy.results.size(), 8u);
  for (size_t i = 0; i < 8; ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(tight.results[i]["output_ids"].size(), 100u);
    EXPECT_EQ(tight.results[i]["output_ids"], roomy.results[i]["output_ids"]);
    EXPECT_EQ(tight.results[i]["text"], roomy.results[i]["text"]);
    // generate stops at the end of the story; up to there the tokens are the same.
    const json g = generate_alone(stories_model(), prompts[i], 100);
    const auto gen = g["output_ids"].get<std::vector<int>>();
    const auto bat = tight.results[i]["output_ids"].get<std::vector<int>>();
    ASSERT_LE(gen.size(), bat.size());
    EXPECT_TRUE(std::equal(gen.begin(), gen.end(), bat.begin()));
  }
  EXPECT_NE(tight.err.find("preemptions"), std::string::npos) << tight.err;
  // The same pool with --swap-space: sequences are swapped out and back, the same tokens again.
  const BatchRun swapped =
      run_batch(dir, requests, common + " --num-kv-blocks 12 --swap-space 0.01 --preemption-mode swap");
  ASSERT_EQ(swapped.rc, 0) << swapped.err;
  EXPECT_GT(swapped.stats["swap_preemptions"].get<int>(), 0);
  EXPECT_GT(swapped.stats["swapped_out_blocks"].get<int>(), 0);
  EXPECT_EQ(swapped.stats["swapped_in_blocks"], swapped.stats["swapped_out_blocks"]);
  EXPECT_LT(swapped.stats["prefill_tokens_computed"].get<int>(), tight.stats["prefill_tokens_computed"].get<int>());
  ASSERT_EQ(swapped.results.size(), 8u);
  for (size_t i = 0; i < 8; ++i) EXPECT_EQ(swapped.results[i]["output_ids"], roomy.results[i]["output_ids"]) << i;
  EXPECT_NE(swapped.err.find("by swap"), std::string::npos) << swapped.err;
  // With a host tier: blocks the pool evicts come back for recomputed sequences, the same tokens.
  const BatchRun tiered = run_batch(dir, requests, common + " --num-kv-blocks 12 --cpu-offload-kv-gb 0.01");
  ASSERT_EQ(tiered.rc, 0) << tiered.err;
  EXPECT_GT(tiered.stats["offloaded_blocks"].get<int>(), 0);
  EXPECT_GT(tiered.stats["offload_hit_blocks"].get<int>(), 0);
  EXPECT_LT(tiered.stats["prefill_tokens_computed"].get<int>(), tight.stats["prefill_tokens_computed"].get<int>());
  ASSERT_EQ(tiered.results.size(), 8u);
  for (size_t i = 0; i < 8; ++i) EXPECT_EQ(tiered.results[i]["output_ids"], roomy.results[i]["output_ids"]) << i;
  EXPECT_NE(tiered.err.find("host KV tier"), std::string::npos) << tiered.err;
}

// (c) Every kind of bad line gets an error result (naming its line); the good lines still run;
// blank lines are skipped; the exit code is 0.
TEST(CliBatch, MalformedLinesGiveErrorsAndTheRestRuns) {
  KESTREL_REQUIRE_FILE(stories_model());
  TempDir dir;
  write_text(dir / "requests.jsonl",
             "{\"id\": \"first\", \"prompt\": \"Once upon a time\", \"max_tokens\": 8, \"temperature\": 0}\n"
             "{\"prompt\": \"Once upon\n"                                        // line 2: truncated JSON
             "\n"                                                                // line 3: blank
             "{\"prompt\": \"Lily\", \"max_tokens\": 4, \"temperature\": 0}\n"   // line 4: no id -> 3
             "{\"id\": 5, \"prompt\": 5}\n"                                      // line 5: wrong type
             "{\"id\": \"both\", \"prompt\": \"a\", \"messages\": []}\n"         // line 6
             "{\"id\": \"neither\"}\n"                                           // line 7
             "{\"id\": \"hot\", \"prompt\": \"a\", \"temperature\": -2}\n"       // line 8: out of range
             "[1, 2]\r\n"                                                        // line 9: not an object
             "{\"id\": 9.5, \"prompt\": \"The dog\", \"max_tokens\": 3}\n");     // line 10, no newline after
  std::string out;
  const int rc = run_command(kestrel_binary() + " batch -m " + stories_model() + " -i " + dir / "requests.jsonl" +
                                 " -o - 2>/dev/null",
                             &out);
  ASSERT_EQ(rc, 0);
  std::vector<json> r;
  std::istringstream lines(out);
  for (std::string line; std::getline(lines, line);) r.push_back(json::parse(line));
  ASSERT_EQ(r.size(), 9u) << out;
  // Error lines are written as they are found, before the engine runs: all six come first.
  for (size_t i = 0; i < 6; ++i) EXPECT_TRUE(r[i].contains("error")) << r[i].dump();
  EXPECT_EQ(result_with_id(r, "first")["output_ids"].size(), 8u);
  const auto error_at = [&](const json& id, int line, const std::string& phrase) {
    const json e = result_with_id(r, id);
    SCOPED_TRACE(e.dump());
    ASSERT_TRUE(e.contains("error"));
    EXPECT_FALSE(e.contains("output_ids"));
    EXPECT_EQ(e["error"]["line"], line);
    EXPECT_NE(e["error"]["message"].get<std::string>().find(phrase), std::string::npos);
  };
  error_at(1, 2, "invalid JSON");
  EXPECT_EQ(result_with_id(r, 3)["output_ids"].size(), 4u);  // the 0-based line index
  error_at(5, 5, "prompt must be a string, an array of token ids, or an array of strings or of token-id arrays, "
                 "got 5");
  error_at("both", 6, "not both");
  error_at("neither", 7, "missing prompt or messages");
  error_at("hot", 8, "temperature must be in [0, 2] (0 = greedy), got -2");
  error_at(8, 9, "JSON object");
  EXPECT_EQ(result_with_id(r, 9.5)["output_ids"].size(), 3u);
}

// An id nested 80,000 levels deep crashed the command (exit 139: the error message dumped the id
// recursively). The line parser stops at the nesting limit and the line gets an error result.
TEST(CliBatch, ADeeplyNestedIdIsAnErrorLine) {
  KESTREL_REQUIRE_FILE(stories_model());
  TempDir dir;
  write_text(dir / "requests.jsonl", "{\"prompt\": \"Once upon a time\", \"max_tokens\": 3}\n"
                                     "{\"prompt\": \"a\", \"id\": " + std::string(80000, '[') + "1" +
                                         std::string(80000, ']') + "}\n"
                                     "{\"prompt\": \"The dog\", \"max_tokens\": 3}\n");
  std::string out;
  const int rc = run_command(kestrel_binary() + " batch -m " + stories_model() + " -i " + dir / "requests.jsonl" +
                                 " -o - 2>/dev/null",
                             &out);
  ASSERT_EQ(rc, 0);
  std::vector<json> r;
  std::istringstream lines(out);
  for (std::string line; std::getline(lines, line);) r.push_back(json::parse(line));
  ASSERT_EQ(r.size(), 3u) << out.substr(0, 1000);
  const json e = result_with_id(r, 1);
  EXPECT_EQ(e["error"]["line"], 2);
  EXPECT_NE(e["error"]["message"].get<std::string>().find("deeper than 64 levels (the nesting limit)"),
            std::string::npos)
      << e.dump();
  EXPECT_EQ(result_with_id(r, 0)["output_ids"].size(), 3u);
  EXPECT_EQ(result_with_id(r, 2)["output_ids"].size(), 3u);
}

// repetition_penalty 1e-38 was accepted (only > 0 was checked), overflowed the logits to inf and
// ended the whole run with exit 1 and no result lines at all. Now it is the line's own error and
// every other line gets its result.
TEST(CliBatch, AnOutOfRangePenaltyIsThatLinesErrorOnly) {
  KESTREL_REQUIRE_FILE(stories_model());
  TempDir dir;
  std::vector<json> requests;
  for (const char* p : {"Once upon a time", "Lily went", "The dog"})
    requests.push_back({{"prompt", p}, {"max_tokens", 12}, {"temperature", 0}});
  requests.insert(requests.begin() + 1, json{{"id", "tiny"}, {"prompt", "Once upon a time"}, {"max_tokens", 12},
                                             {"repetition_penalty", 1e-38}});
  const BatchRun run = run_batch(dir, requests, "-m " + stories_model());
  ASSERT_EQ(run.rc, 0) << run.err;
  ASSERT_EQ(run.results.size(), 4u);
  EXPECT_EQ(run.results[1]["error"]["message"], "repetition_penalty must be in [0.01, 100] (1 turns it off), got 1e-38");
  for (size_t i : {0u, 2u, 3u}) {
    SCOPED_TRACE(run.results[i].dump());
    EXPECT_EQ(run.results[i]["output_ids"].size(), 12u);
    EXPECT_EQ(run.results[i]["finish_reason"], "length");
  }
  EXPECT_EQ(run.stats["errors"], 1);
}

// Results are written as they complete: a short request after a long one comes out first.
TEST(CliBatch, ResultsComeOutAsTheyComplete) {
  KESTREL_REQUIRE_FILE(stories_model());
  TempDir dir;
  const BatchRun run = run_batch(dir,
                                 {{{"id", "long"}, {"prompt", "Once upon a time"}, {"max_tokens", 200},
                                   {"temperature", 0}, {"ignore_eos", true}},
                                  {{"id", "short"}, {"prompt", "Once upon a time"}, {"max_tokens", 2}}},
                                 "-m " + stories_model());
  ASSERT_EQ(run.rc, 0) << run.err;
  ASSERT_EQ(run.written.size(), 2u);
  EXPECT_EQ(run.written[0]["id"], "short");
  EXPECT_EQ(run.written[1]["id"], "long");
  EXPECT_EQ(run.written[1]["output_ids"].size(), 200u);
}

// A prompt given as token ids (OpenAI completions' other form) runs those ids as they are: the
// same prompt_tokens and greedy output as the text whose encoding they are; an id outside the
// vocabulary or a non-integer is an error line naming the field.
TEST(CliBatch, PromptAsTokenIdsRunsThoseIds) {
  KESTREL_REQUIRE_FILE(stories_model());
  TempDir dir;
  const BatchRun text = run_batch(dir, {{{"id", "text"}, {"prompt", "Once upon a time"}, {"max_tokens", 6},
                                         {"temperature", 0}}},
                                  "-m " + stories_model());
  ASSERT_EQ(text.rc, 0) << text.err;
  ASSERT_EQ(text.results.size(), 1u);
  std::string ids_out;
  ASSERT_EQ(run_command(kestrel_binary() + " tokenize -m " + stories_model() + " 'Once upon a time' 2>/dev/null", &ids_out),
            0);
  json ids = json::array({1});  // batch prompts get the BOS (id 1 in the Llama 2 vocabulary); tokenize adds none
  std::istringstream in(ids_out);
  for (int64_t id; in >> id;) ids.push_back(id);
  ASSERT_EQ(static_cast<int64_t>(ids.size()), text.results[0]["usage"]["prompt_tokens"].get<int64_t>()) << ids_out;
  const BatchRun run = run_batch(dir,
                                 {{{"id", "ids"}, {"prompt", ids}, {"max_tokens", 6}, {"temperature", 0}},
                                  {{"id", "big"}, {"prompt", {1, 512}}, {"max_tokens", 2}},
                                  {{"id", "neg"}, {"prompt", {1, -3}}, {"max_tokens", 2}},
                                  {{"id", "empty"}, {"prompt", json::array()}, {"max_tokens", 2}}},
                                 "-m " + stories_model());
  ASSERT_EQ(run.rc, 0) << run.err;
  ASSERT_EQ(run.results.size(), 4u);
  EXPECT_EQ(run.results[0]["output_ids"], text.results[0]["output_ids"]);
  EXPECT_EQ(run.results[0]["usage"]["prompt_tokens"], text.results[0]["usage"]["prompt_tokens"]);
  for (size_t i : {1u, 2u, 3u}) {
    ASSERT_TRUE(run.results[i].contains("error")) << run.results[i].dump();
    EXPECT_NE(run.results[i]["error"]["message"].get<std::string>().find("prompt"), std::string::npos)
        << run.results[i].dump();
  }
  EXPECT_NE(run.results[1]["error"]["message"].get<std::string>().find("outside the vocabulary"), std::string::npos);
}

// (d) The engine's check: prompt + 1 token must fit in max_model_len.
TEST(CliBatch, PromptLongerThanTheContextIsAnErrorLine) {
  KESTREL_REQUIRE_FILE(stories_model());
  TempDir dir;
  const std::string long_prompt = story_prompts()[3];  // ~90 tokens
  const BatchRun run = run_batch(dir,
                                 {{{"id", "long"}, {"prompt", long_prompt}, {"max_tokens", 4}},
                                  {{"id", "short"}, {"prompt", "Once upon a time"}, {"max_tokens", 4}}},
                                 "-m " + stories_model() + " --max-model-len 32");
  ASSERT_EQ(run.rc, 0) << run.err;
  ASSERT_EQ(run.results.size(), 2u);
  EXPECT_EQ(run.results[0]["id"], "long");
  ASSERT_TRUE(run.results[0].contains("error")) << run.results[0].dump();
  EXPECT_NE(run.results[0]["error"]["message"].get<std::string>().find("max_model_len 32"), std::string::npos)
      << run.results[0].dump();
  EXPECT_EQ(run.results[0]["error"]["line"], 1);
  EXPECT_EQ(run.results[1]["output_ids"].size(), 4u);
  EXPECT_EQ(run.stats["errors"], 1);
}

// (e) Stop strings: the text ends right before the first match and the request ends with "stop".
TEST(CliBatch, StopStringsCutTheText) {
  KESTREL_REQUIRE_FILE(stories_model());
  TempDir dir;
  const json base = {{"prompt", "Once upon a time, there was a little dog named Max."}, {"max_tokens", 80},
                     {"temperature", 0}, {"ignore_eos", true}};
  const BatchRun free_run = run_batch(dir, {base}, "-m " + stories_model());
  ASSERT_EQ(free_run.rc, 0) << free_run.err;
  const std::string full = free_run.results.at(0)["text"];
  ASSERT_GT(full.size(), 40u);
  // Two stop strings taken from the text itself; the earlier match wins.
  const std::string late = full.substr(full.size() / 2, 5);
  const std::string early = full.substr(full.size() / 4, 4);
  json with_stop = base;
  with_stop["stop"] = {late, early};
  json one_stop = base;
  one_stop["stop"] = late;
  const BatchRun stopped = run_batch(dir, {with_stop, one_stop}, "-m " + stories_model());
  ASSERT_EQ(stopped.rc, 0) << stopped.err;
  const size_t cut = std::min(full.find(late), full.find(early));
  EXPECT_EQ(stopped.results.at(0)["text"], full.substr(0, cut)) << "stops [" << late << "], [" << early << "]";
  EXPECT_EQ(stopped.results[0]["finish_reason"], "stop");
  EXPECT_LT(stopped.results[0]["output_ids"].size(), free_run.results[0]["output_ids"].size());
  EXPECT_EQ(stopped.results.at(1)["text"], full.substr(0, full.find(late)));
  EXPECT_EQ(free_run.results[0]["finish_reason"], "length");
}

// A chat request goes through the model's template and ends at the end of the assistant's turn.
TEST(CliBatch, MessagesUseTheChatTemplate) {
  KESTREL_REQUIRE_FILE(smollm2_model());
  TempDir dir;
  const BatchRun run = run_batch(
      dir,
      {{{"messages", {{{"role", "user"}, {"content", "What is the capital of France?"}}}}, {"max_tokens", 48}, {"temperature", 0}}},
      "-m " + smollm2_model());
  ASSERT_EQ(run.rc, 0) << run.err;
  ASSERT_EQ(run.results.size(), 1u);
  const json& r = run.results[0];
  EXPECT_NE(r["text"].get<std::string>().find("Paris"), std::string::npos) << r.dump();
  EXPECT_EQ(r["finish_reason"], "stop") << r.dump();
  EXPECT_EQ(r["text"].get<std::string>().find("<|im_end|>"), std::string::npos) << r.dump();
}

// `kestrel chat` renders the conversation through the same Jinja template as batch mode (SmolLM2's
// adds its default system message), so a greedy answer is the batch answer to the same message.
TEST(CliBatch, ChatAnswersAsBatchMessagesDo) {
  KESTREL_REQUIRE_FILE(smollm2_model());
  TempDir dir;
  const std::string question = "Name a fruit that is yellow.";
  const BatchRun run = run_batch(
      dir, {{{"messages", {{{"role", "user"}, {"content", question}}}}, {"max_tokens", 32}, {"temperature", 0}}},
      "-m " + smollm2_model());
  ASSERT_EQ(run.rc, 0) << run.err;
  ASSERT_EQ(run.results.size(), 1u);
  std::string chat;
  ASSERT_EQ(run_command(kestrel_binary() + " chat -m " + smollm2_model() + " --temperature 0 -n 32 -p " +
                            shell_quote(question) + " 2>/dev/null",
                        &chat),
            0);
  EXPECT_EQ(chat, run.results[0]["text"].get<std::string>() + "\n");
}

// The same seed gives the same tokens, alone or among other requests; other seeds differ.
TEST(CliBatch, SeededSamplingIsReproducible) {
  KESTREL_REQUIRE_FILE(stories_model());
  TempDir dir;
  const json a = {{"prompt", "Once upon a time"}, {"max_tokens", 40}, {"temperature", 1.0}, {"seed", 7}};
  json b = a;
  b["seed"] = 8;
  const BatchRun alone = run_batch(dir, {a}, "-m " + stories_model());
  const BatchRun mixed = run_batch(dir, {b, a, b, a}, "-m " + stories_model());
  ASSERT_EQ(alone.rc, 0);
  ASSERT_EQ(mixed.rc, 0);
  EXPECT_EQ(mixed.results.at(1)["output_ids"], alone.results.at(0)["output_ids"]);
  EXPECT_EQ(mixed.results.at(3)["output_ids"], alone.results.at(0)["output_ids"]);
  EXPECT_EQ(mixed.results.at(0)["output_ids"], mixed.results.at(2)["output_ids"]);
  EXPECT_NE(mixed.results.at(0)["output_ids"], mixed.results.at(1)["output_ids"]);
}

TEST(CliBatch, ExitCodes) {
  KESTREL_REQUIRE_FILE(stories_model());
  TempDir dir;
  write_text(dir / "ok.jsonl", "{\"prompt\": \"Once\", \"max_tokens\": 2}\n");
  struct Case {
    std::string args;
    int rc;
    std::string phrase;
  };
  const std::string m = "-m " + stories_model() + " ";
  const std::vector<Case> cases = {
      {m + "-i " + dir / "missing.jsonl" + " -o " + dir / "out.jsonl", 1, "missing.jsonl"},
      {m + "-i " + dir / "ok.jsonl" + " -o " + dir / "no/such/dir/out.jsonl", 1, "cannot open for writing"},
      {m + "-i " + dir / "ok.jsonl", 2, "--output"},
      {m + "-i " + dir / "ok.jsonl" + " -o " + dir / "out.jsonl --max-num-seqs 0", 2, "--max-num-seqs"},
      {m + "-i " + dir / "ok.jsonl" + " -o " + dir / "out.jsonl --frobnicate", 2, "frobnicate"},
      {m + "-i " + dir / "ok.jsonl" + " -o " + dir / "out.jsonl --max-model-len 100000", 2, "--max-model-len: 100000 exceeds"},
      {m + "-i " + dir / "ok.jsonl" + " -o " + dir / "out.jsonl --num-kv-blocks 2", 2, "cannot hold one sequence"},
  };
  for (const Case& c : cases) {
    std::string err;
    const int rc = run_command(kestrel_binary() + " batch " + c.args + " 2>&1 >/dev/null", &err);
    if (err.rfind("kestrel: loaded ", 0) == 0) err.erase(0, err.find('\n') + 1);  // flags checked after loading
    EXPECT_EQ(rc, c.rc) << c.args << " -> " << err;
    EXPECT_NE(err.find(c.phrase), std::string::npos) << c.args << " -> " << err;
    EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 1) << c.args << " -> " << err;
  }
  // Per-line errors only: still exit 0.
  write_text(dir / "bad.jsonl", "nonsense\n");
  EXPECT_EQ(run_command(kestrel_binary() + " batch " + m + "-i " + dir / "bad.jsonl" + " -o " + dir / "out.jsonl 2>/dev/null",
                        nullptr),
            0);
  EXPECT_NE(kestrel::test::read_file(dir / "out.jsonl").find("\"error\""), std::string::npos);
}
