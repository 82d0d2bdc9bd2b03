// Speculative decoding in the engine on the real stories260K model (CPU): with n-gram drafts the
// output is token-identical to decoding without them, greedy and seeded sampling alike (with a
// one-hot q the verifier takes exactly the draws the sampler would), for single requests and
// batches, under preemption and prefix-cache hits, with stop strings, max_tokens, logprobs, n > 1
// and aborts; every request ends with its blocks returned. Verification from device-sampled rows
// (ModelRunner::forward_sample, accept_sampled_drafts) on a CPU backend that samples the way the
// CUDA runner does gives the same tokens.
#include <gtest/gtest.h>

#include <map>
#include <numeric>

#include "engine/engine.h"
#include "io/gguf.h"
#include "sampling_runner.h"
#include "test_util.h"

using namespace kestrel;

namespace {

using test::eog_ids;
using test::story_prompts;

using Loaded = test::LoadedModel;
const Loaded& stories() {
  static const Loaded l = test::load_model(test::stories_path());
  return l;
}
using test::stories_path;

SpeculativeConfig ngram(int32_t k, int32_t min_n = 1, int32_t max_n = 4) {
  SpeculativeConfig s;
  s.method = SpecMethod::Ngram;
  s.num_speculative_tokens = k;
  s.prompt_lookup_min = min_n;
  s.prompt_lookup_max = max_n;
  return s;
}

struct Result {
  std::vector<int32_t> ids;
  std::string text;
  std::string reason;
  std::vector<LogprobSummary> logprobs;
  RequestMetrics metrics;
  size_t max_tokens_per_output = 0;  // the most tokens one step's output carried
};

// Submits every request at once and steps the engine to the end.
std::vector<Result> run(Engine& e, const std::vector<Request>& reqs) {
  std::map<RequestId, size_t> index;
  for (size_t i = 0; i < reqs.size(); ++i) index[e.add_request(reqs[i])] = i;
  std::vector<Result> out(reqs.size());
  while (e.has_unfinished())
    for (RequestOutput& o : e.step()) {
      Result& r = out[index.at(o.id)];
      r.ids.insert(r.ids.end(), o.new_token_ids.begin(), o.new_token_ids.end());
      r.text += o.text_delta;
      r.max_tokens_per_output = std::max(r.max_tokens_per_output, o.new_token_ids.size());
      if (!o.logprobs.empty()) EXPECT_EQ(o.logprobs.size(), o.new_token_ids.size());
      r.logprobs.insert(r.logprobs.end(), o.logprobs.begin(), o.logprobs.end());
      if (o.finished) {
        r.reason = o.finish_reason;
        r.metrics = o.metrics;
      }
    }
  EXPECT_EQ(e.stats().kv_blocks_used, 0) << "a request kept KV blocks";
  return out;
}

std::vector<Result> run(EngineConfig c, const std::vector<Request>& reqs, EngineStats* stats = nullptr) {
  Engine e(*stories().model, stories().tokenizer.get(), c);
  auto out = run(e, reqs);
  if (stats != nullptr) *stats = e.stats();
  return out;
}

Request greedy(const std::string& text, int64_t max_tokens) {
  Request r;
  r.prompt = stories().tokenizer->encode(text, true, false);
  r.max_tokens = max_tokens;
  r.sampling.temperature = 0;
  r.stop_ids = eog_ids(*stories().tokenizer);
  return r;
}

void expect_same(const std::vector<Result>& got, const std::vector<Result>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].ids, want[i].ids) << what << ", request " << i;
    EXPECT_EQ(got[i].text, want[i].text) << what << ", request " << i;
    EXPECT_EQ(got[i].reason, want[i].reason) << what << ", request " << i;
    EXPECT_EQ(got[i].metrics.n_output_tokens, static_cast<int64_t>(want[i].ids.size())) << what << ", request " << i;
  }
}

void expect_consistent(const EngineStats& s, int32_t k) {
  ASSERT_EQ(s.spec_accepted_per_pos.size(), static_cast<size_t>(k));
  EXPECT_EQ(std::accumulate(s.spec_accepted_per_pos.begin(), s.spec_accepted_per_pos.end(), int64_t{0}),
            s.spec_num_accepted_tokens);
  // A draft token is accepted only after every one before it.
  for (size_t i = 1; i < s.spec_accepted_per_pos.size(); ++i)
    EXPECT_LE(s.spec_accepted_per_pos[i], s.spec_accepted_per_pos[i - 1]);
  EXPECT_LE(s.spec_num_accepted_tokens, s.spec_num_draft_tokens);
  EXPECT_LE(s.spec_num_draft_tokens, s.spec_num_drafts * k);
}

}  // namespace

TEST(SpecDecode, GreedySingleRequestsAreTokenIdenticalForKOneToEight) {
  KESTREL_REQUIRE_FILE(stories_path());
  const auto prompts = story_prompts();
  for (size_t p = 0; p < prompts.size(); p += 9) {
    const std::vector<Request> reqs = {greedy(prompts[p], 96)};
    EngineConfig off;
    off.max_num_seqs = 1;
    const auto want = run(off, reqs);
    for (int32_t k = 1; k <= 8; ++k)
      for (const bool adaptive : {true, false}) {
        EngineConfig on = off;
        on.speculative = ngram(k);
        on.speculative.adaptive_draft_length = adaptive;
        EngineStats st;
        const auto got = run(on, reqs, &st);
        const std::string what = "k " + std::to_string(k) + (adaptive ? " adaptive" : " fixed");
        expect_same(got, want, what + ", prompt " + std::to_string(p));
        expect_consistent(st, k);
        EXPECT_GT(st.spec_num_accepted_tokens, 0) << what << ": the story repeats itself, drafts should land";
        // Fewer steps than tokens: verified drafts emitted several tokens per step.
        EXPECT_LT(st.n_steps, 1 + static_cast<int64_t>(want[0].ids.size())) << what;
      }
  }
}

TEST(SpecDecode, ThirtyTwoMixedRequestsBatchedMatchSpeculationOff) {
  KESTREL_REQUIRE_FILE(stories_path());
  const auto prompts = story_prompts();
  std::vector<Request> reqs;
  for (size_t i = 0; i < prompts.size(); ++i) {
    Request r = greedy(prompts[i], 16 + static_cast<int64_t>(i % 5) * 13);
    if (i % 3 == 1) {  // seeded sampling: the one-hot verifier draws what the sampler would
      r.sampling.temperature = 0.8f;
      r.sampling.top_p = 0.95f;
      r.sampling.seed = 1000 + i;
    }
    if (i % 4 == 2) {  // penalties counted at each draft position
      r.sampling.temperature = 0.7f;
      r.sampling.frequency_penalty = 0.5f;
      r.sampling.repetition_penalty = 1.3f;
      r.sampling.seed = 77 + i;
    }
    if (i % 7 == 3) r.logprobs = 3;
    reqs.push_back(r);
  }
  EngineConfig off;
  off.max_num_batched_tokens = 96;
  off.max_num_seqs = 12;
  const auto want = run(off, reqs);
  for (int32_t k : {3, 8}) {
    EngineConfig on = off;
    on.speculative = ngram(k);
    EngineStats st;
    const auto got = run(on, reqs, &st);
    expect_same(got, want, "k " + std::to_string(k));
    for (size_t i = 0; i < reqs.size(); ++i)
      if (reqs[i].logprobs >= 0) {
        ASSERT_EQ(got[i].logprobs.size(), want[i].logprobs.size());
        for (size_t t = 0; t < want[i].logprobs.size(); ++t) {
          EXPECT_EQ(got[i].logprobs[t].chosen.token, want[i].logprobs[t].chosen.token);
          EXPECT_EQ(got[i].logprobs[t].chosen.logprob, want[i].logprobs[t].chosen.logprob);
        }
      }
    expect_consistent(st, k);
    EXPECT_GT(st.spec_num_accepted_tokens, 0);
  }
}

TEST(SpecDecode, PreemptionAndPrefixCacheHitsKeepOutputsIdentical) {
  KESTREL_REQUIRE_FILE(stories_path());
  const auto prompts = story_prompts();
  std::vector<Request> reqs;
  for (const auto& p : prompts) reqs.push_back(greedy(p, 64));
  EngineConfig alone;
  alone.max_num_seqs = 1;
  const auto want = run(alone, reqs);
  for (bool caching : {false, true}) {
    EngineConfig c;
    c.block_size = 8;
    c.max_model_len = 128;
    c.n_kv_blocks = 24;  // 192 slots for 32 sequences of up to ~75 tokens: preemption
    c.max_num_batched_tokens = 64;
    c.max_num_seqs = 16;
    c.enable_prefix_caching = caching;
    c.speculative = ngram(6);
    EngineStats st;
    const auto got = run(c, reqs, &st);
    expect_same(got, want, caching ? "preemption, caching" : "preemption");
    EXPECT_GT(st.n_preemptions, 0);
    EXPECT_GT(st.spec_num_accepted_tokens, 0);
  }
  // Prefix-cache hits on blocks written by verified steps: a second round whose prompts extend
  // the first round's outputs finds them cached, and gives what a fresh engine gives. A rejected
  // draft's K/V published under the sequence's tokens would change these outputs.
  EngineConfig c;
  c.block_size = 4;
  c.max_num_seqs = 8;
  c.speculative = ngram(8);
  Engine e(*stories().model, stories().tokenizer.get(), c);
  std::vector<Request> first(reqs.begin(), reqs.begin() + 8);
  const auto a = run(e, first);
  std::vector<Request> second;
  for (size_t i = 0; i < first.size(); ++i) {
    Request r = first[i];
    r.prompt.insert(r.prompt.end(), a[i].ids.begin(), a[i].ids.end() - (a[i].reason == "stop" ? 1 : 0));
    r.max_tokens = 24;
    second.push_back(r);
  }
  const int64_t hits_before = e.stats().prefix_cache_hit_tokens;
  const auto b = run(e, second);
  EXPECT_GT(e.stats().prefix_cache_hit_tokens - hits_before, 8 * 16);
  EngineConfig fresh;
  fresh.enable_prefix_caching = false;
  expect_same(b, run(fresh, second), "prefix-cache hits");
}

TEST(SpecDecode, MaxTokensIsExactlyRespected) {
  KESTREL_REQUIRE_FILE(stories_path());
  const Request base = greedy("Once upon a time, there was a little girl named Lily", 200);
  EngineConfig off;
  const auto full = run(off, {base});
  ASSERT_GE(full[0].ids.size(), 40u);
  for (int64_t max_tokens = 1; max_tokens <= 40; max_tokens += 3) {
    Request r = base;
    r.max_tokens = max_tokens;
    EngineConfig on;
    on.speculative = ngram(8);
    const auto got = run(on, {r});
    EXPECT_EQ(got[0].ids, std::vector<int32_t>(full[0].ids.begin(), full[0].ids.begin() + max_tokens))
        << "max_tokens " << max_tokens;
    EXPECT_EQ(got[0].reason, "length");
  }
}

TEST(SpecDecode, StopStringsInsideAcceptedDraftsEndTheOutputThere) {
  KESTREL_REQUIRE_FILE(stories_path());
  const Request base = greedy("Once upon a time, there was a little girl named Lily", 120);
  EngineConfig off;
  const auto full = run(off, {base});
  const std::string& text = full[0].text;
  ASSERT_GT(text.size(), 200u);
  bool multi = false;
  int n_checked = 0;
  // Stop strings taken from the output at several places: each must cut the text where
  // speculation off cuts it, whether the step that reached it verified drafts or not.
  for (size_t at = 40; at + 12 < text.size(); at += 23) {
    const std::string stop = text.substr(at, 7);
    Request r = base;
    r.stop = {stop};
    const auto want = run(off, {r});
    EngineConfig on;
    on.speculative = ngram(8);
    const auto got = run(on, {r});
    expect_same(got, want, "stop " + stop);
    EXPECT_EQ(got[0].reason, "stop");
    EXPECT_EQ(got[0].text.find(stop), std::string::npos);
    multi |= got[0].max_tokens_per_output > 1;
    ++n_checked;
  }
  EXPECT_GT(n_checked, 4);
  EXPECT_TRUE(multi) << "no step emitted several tokens";
}

TEST(SpecDecode, GreedyLogprobsEqualSpeculationOff) {
  KESTREL_REQUIRE_FILE(stories_path());
  Request r = greedy("One day, a happy frog", 80);
  r.logprobs = 5;
  const auto want = run(EngineConfig{}, {r});
  EngineConfig on;
  on.speculative = ngram(5);
  const auto got = run(on, {r});
  ASSERT_EQ(got[0].ids, want[0].ids);
  ASSERT_EQ(got[0].logprobs.size(), want[0].logprobs.size());
  EXPECT_GT(got[0].max_tokens_per_output, 1u);
  for (size_t t = 0; t < want[0].logprobs.size(); ++t) {
    const LogprobSummary& g = got[0].logprobs[t];
    const LogprobSummary& w = want[0].logprobs[t];
    EXPECT_EQ(g.chosen.token, w.chosen.token);
    EXPECT_NEAR(g.chosen.logprob, w.chosen.logprob, 1e-6) << "token " << t;
    ASSERT_EQ(g.top.size(), w.top.size());
    for (size_t j = 0; j < w.top.size(); ++j) {
      EXPECT_EQ(g.top[j].token, w.top[j].token);
      EXPECT_NEAR(g.top[j].logprob, w.top[j].logprob, 1e-6);
    }
  }
}

TEST(SpecDecode, ChoicesOfOnePromptAndAbortsWorkWithDrafts) {
  KESTREL_REQUIRE_FILE(stories_path());
  std::vector<Request> reqs;
  for (int i = 0; i < 4; ++i) {  // n = 4 choices: children of one prompt, each seeded
    Request r = greedy("Long ago, a brave knight", 48);
    r.sampling.temperature = 1.0f;
    r.sampling.seed = 5 + static_cast<uint64_t>(i);
    reqs.push_back(r);
  }
  EngineConfig on;
  on.speculative = ngram(4);
  expect_same(run(on, reqs), run(EngineConfig{}, reqs), "n = 4");

  // Aborts between steps, while requests hold verified tokens: every block comes back.
  Engine e(*stories().model, stories().tokenizer.get(), on);
  std::vector<RequestId> ids;
  for (const auto& p : story_prompts()) ids.push_back(e.add_request(greedy(p, 100)));
  for (int s = 0; s < 12; ++s) e.step();
  for (size_t i = 0; i < ids.size(); i += 2) e.abort_request(ids[i]);
  while (e.has_unfinished()) e.step();
  EXPECT_EQ(e.stats().kv_blocks_used, 0);
  EXPECT_GT(e.stats().spec_num_drafts, 0);
}

TEST(SpecDecode, DisableByBatchSizeTurnsDraftsOffForLargerBatches) {
  KESTREL_REQUIRE_FILE(stories_path());
  std::vector<Request> reqs;
  for (const auto& p : story_prompts()) {
    Request r = greedy(p, 24);
    r.stop_ids.clear();  // all run to 24 tokens together
    reqs.push_back(r);
    if (reqs.size() == 6) break;
  }
  EngineConfig c;
  c.speculative = ngram(4);
  c.speculative.disable_by_batch_size = 5;
  EngineStats st;
  const auto got = run(c, reqs, &st);
  EXPECT_EQ(st.spec_num_drafts, 0) << "6 sequences run, more than 5";
  c.speculative.disable_by_batch_size = 6;
  run(c, reqs, &st);
  EXPECT_GT(st.spec_num_drafts, 0);
}

// The default model on input-grounded chat prompts (bench/data/spec_grounded_prompts.jsonl's kind):
// greedy outputs with n-gram drafts are the ones without, and the drafts are mostly accepted.
TEST(SpecDecode, DefaultModelGroundedPromptsAreTokenIdentical) {
  const std::string path = test::model_dir() + "/SmolLM2-135M-Instruct.Q4_1.gguf";
  KESTREL_REQUIRE_FILE(path);
  const auto model = LlamaModel::load_gguf(path);
  const auto tok = Tokenizer::from_gguf(model->file());
  const char* texts[] = {
      "Repeat the following text exactly, word for word:\n\nThe old lighthouse stood at the edge of the cliff for "
      "more than a hundred years. Every night its keeper climbed the narrow stairs and lit the great lamp.",
      "Fix the spelling mistakes in this text and return the full corrected text:\n\nYesterday we went to the musuem "
      "in the city center. The exibition about ancient Egypt was very intresting.",
  };
  std::vector<Request> reqs;
  for (const char* t : texts) {
    Request r;
    r.prompt = tok->encode(std::string("<|im_start|>user\n") + t + "<|im_end|>\n<|im_start|>assistant\n", true, true);
    r.max_tokens = 48;
    r.sampling.temperature = 0;
    r.stop_ids = eog_ids(*tok);
    reqs.push_back(r);
  }
  const auto run_on = [&](EngineConfig c, EngineStats* st) {
    Engine e(*model, tok.get(), c);
    auto out = run(e, reqs);
    *st = e.stats();
    return out;
  };
  EngineStats off_stats, on_stats;
  EngineConfig on;
  on.max_model_len = 512;
  const auto want = run_on(on, &off_stats);
  on.speculative = ngram(6, 2, 4);
  const auto got = run_on(on, &on_stats);
  expect_same(got, want, "SmolLM2");
  expect_consistent(on_stats, 6);
  EXPECT_GT(on_stats.spec_acceptance_rate(), 0.3);
}

// Verification on a backend that samples on the device (test::SamplingRunner over the CPU runner:
// each of the 1 + k rows drawn from its settings and uniform alone, Sampler::sample_with_uniform,
// the CUDA sampler's reference): greedy and seeded requests of every chain the device sampler
// implements give exactly the tokens of decoding without drafts, the verify steps never copy
// logits to the host, and with speculative_verify_on_device off they all do.
TEST(SpecDecode, VerificationFromDeviceSampledRowsMatchesSpeculationOff) {
  KESTREL_REQUIRE_FILE(stories_path());
  const auto prompts = story_prompts();
  std::vector<Request> reqs;
  for (size_t i = 0; i < prompts.size(); ++i) {
    Request r = greedy(prompts[i], 24 + static_cast<int64_t>(i % 4) * 11);
    if (i % 3 == 1) {
      r.sampling.temperature = 0.8f;
      r.sampling.top_p = 0.9f;
      r.sampling.seed = 500 + i;
    }
    if (i % 3 == 2) {
      r.sampling.temperature = 1.1f;
      r.sampling.top_k = 12;
      r.sampling.min_p = 0.02f;
      r.sampling.seed = 900 + i;
    }
    reqs.push_back(r);
  }
  EngineConfig off;
  off.max_num_batched_tokens = 96;
  off.max_num_seqs = 12;
  off.n_kv_blocks = 256;
  const auto want = run(off, reqs);
  for (const bool device_verify : {true, false}) {
    for (int32_t k : {2, 6}) {
      SCOPED_TRACE("k " + std::to_string(k) + (device_verify ? ", device verification" : ", host verification"));
      EngineConfig on = off;
      on.speculative = ngram(k);
      on.speculative_verify_on_device = device_verify;
      RunnerOptions o;
      o.n_kv_blocks = on.n_kv_blocks;
      auto runner = std::make_unique<test::SamplingRunner>(make_cpu_model_runner(*stories().model, o), true);
      test::SamplingRunner* dev = runner.get();
      Engine e(*stories().model, stories().tokenizer.get(), on, std::move(runner));
      const auto got = run(e, reqs);
      expect_same(got, want, "ngram");
      EXPECT_GT(e.stats().spec_num_accepted_tokens, 0);
      expect_consistent(e.stats(), k);
      EXPECT_GT(dev->device_calls, 0);
      if (device_verify)
        EXPECT_EQ(dev->host_calls, 0);
      else
        EXPECT_GT(dev->host_calls, 0);
    }
  }
}
