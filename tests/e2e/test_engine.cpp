// The serving engine on real models: outputs do not depend on batch composition, chunking,
// preemption or prefix-cache hits (exactly: the CPU forward pass is batch-invariant), and every
// request ends with its blocks returned.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <random>
#include <thread>

#include "core/error.h"
#include "engine/engine.h"
#include "io/gguf.h"
#include "sampling/logprobs.h"
#include "sampling/sampler.h"
#include "sampling_runner.h"
#include "test_util.h"

using namespace kestrel;

namespace {

using test::eog_ids;
using test::story_prompts;

using Loaded = test::LoadedModel;
Loaded load(const std::string& path) { return test::load_model(path); }
using test::stories_path;
std::string smollm2_path() { return test::model_dir() + "/SmolLM2-135M-Instruct.Q4_1.gguf"; }

// Greedy ids of each prompt run alone: a fresh engine per prompt, the whole prompt in one pass.
std::vector<std::vector<int32_t>> run_alone(const Loaded& l, const std::vector<std::vector<int32_t>>& prompts,
                                            int64_t max_tokens) {
  std::vector<std::vector<int32_t>> out;
  for (const auto& p : prompts) {
    EngineConfig c;
    c.max_num_seqs = 1;
    Engine e(*l.model, l.tokenizer.get(), c);
    Request r;
    r.prompt = p;
    r.max_tokens = max_tokens;
    r.sampling.temperature = 0;
    r.stop_ids = eog_ids(*l.tokenizer);
    e.add_request(r);
    std::vector<int32_t> ids;
    while (e.has_unfinished())
      for (const RequestOutput& o : e.step()) ids.insert(ids.end(), o.new_token_ids.begin(), o.new_token_ids.end());
    out.push_back(ids);
  }
  return out;
}

struct Finished {
  std::vector<int32_t> ids;
  std::string text;
  std::string reason;
  RequestMetrics metrics;
};

// Submits all prompts at once and steps the engine to the end.
std::vector<Finished> run_engine(Engine& e, const Loaded& l, const std::vector<std::vector<int32_t>>& prompts,
                                 int64_t max_tokens, bool* mixed_step = nullptr) {
  std::map<RequestId, size_t> index;
  for (size_t i = 0; i < prompts.size(); ++i) {
    Request r;
    r.prompt = prompts[i];
    r.max_tokens = max_tokens;
    r.sampling.temperature = 0;
    r.stop_ids = eog_ids(*l.tokenizer);
    index[e.add_request(r)] = i;
  }
  std::vector<Finished> out(prompts.size());
  while (e.has_unfinished()) {
    const int64_t prompt_before = e.stats().n_prompt_tokens_computed;
    const int64_t gen_before = e.stats().n_generated_tokens;
    for (const RequestOutput& o : e.step()) {
      Finished& f = out[index.at(o.id)];
      f.ids.insert(f.ids.end(), o.new_token_ids.begin(), o.new_token_ids.end());
      f.text += o.text_delta;
      if (o.finished) {
        f.reason = o.finish_reason;
        f.metrics = o.metrics;
      }
    }
    if (mixed_step != nullptr && e.stats().n_prompt_tokens_computed > prompt_before &&
        e.stats().n_generated_tokens - gen_before > 1)
      *mixed_step = true;
  }
  return out;
}

std::vector<std::vector<int32_t>> tokenize_all(const Tokenizer& tok, const std::vector<std::string>& texts) {
  std::vector<std::vector<int32_t>> out;
  for (const auto& t : texts) out.push_back(tok.encode(t, true, false));
  return out;
}

}  // namespace

TEST(Engine, ThirtyTwoPromptsBatchedWithChunkingMatchEachRunAlone) {
  KESTREL_REQUIRE_FILE(stories_path());
  const Loaded l = load(stories_path());
  const auto prompts = tokenize_all(*l.tokenizer, story_prompts());
  ASSERT_EQ(prompts.size(), 32u);
  const auto alone = run_alone(l, prompts, 48);
  EngineConfig c;
  c.max_num_batched_tokens = 24;  // smaller than most prompts + decodes: chunks and interleaving
  c.max_num_seqs = 12;
  Engine e(*l.model, l.tokenizer.get(), c);
  bool mixed = false;
  const auto got = run_engine(e, l, prompts, 48, &mixed);
  EXPECT_TRUE(mixed) << "no step mixed prefill and decode";
  for (size_t i = 0; i < prompts.size(); ++i) {
    EXPECT_EQ(got[i].ids, alone[i]) << "prompt " << i;
    EXPECT_EQ(got[i].text, l.tokenizer->decode(alone[i], true, true)) << "prompt " << i;
    EXPECT_EQ(got[i].metrics.n_output_tokens, static_cast<int64_t>(alone[i].size()));
    EXPECT_EQ(got[i].metrics.n_prompt_tokens, static_cast<int64_t>(prompts[i].size()));
  }
  EXPECT_EQ(e.stats().n_preemptions, 0);
  EXPECT_FALSE(e.has_unfinished());
}

TEST(Engine, PreemptionByRecomputeKeepsOutputsIdentical) {
  KESTREL_REQUIRE_FILE(stories_path());
  const Loaded l = load(stories_path());
  const auto prompts = tokenize_all(*l.tokenizer, story_prompts());
  const auto alone = run_alone(l, prompts, 64);
  for (bool caching : {false, true}) {
    EngineConfig c;
    c.block_size = 8;
    c.max_model_len = 128;
    c.n_kv_blocks = 24;  // 192 slots for 32 sequences of up to ~75 tokens each
    c.max_num_batched_tokens = 64;
    c.max_num_seqs = 16;
    c.enable_prefix_caching = caching;
    Engine e(*l.model, l.tokenizer.get(), c);
    const auto got = run_engine(e, l, prompts, 64);
    EXPECT_GT(e.stats().n_preemptions, 0) << "caching " << caching;
    EXPECT_LE(e.stats().peak_kv_blocks_used, 24);
    int32_t preempted_requests = 0;
    for (size_t i = 0; i < prompts.size(); ++i) {
      EXPECT_EQ(got[i].ids, alone[i]) << "prompt " << i << " caching " << caching;
      preempted_requests += got[i].metrics.n_preemptions > 0;
    }
    EXPECT_GT(preempted_requests, 0);
  }
}

TEST(Engine, SharedPrefixOf512TokensIsReusedAndGivesTheColdOutput) {
  KESTREL_REQUIRE_FILE(smollm2_path());
  const Loaded l = load(smollm2_path());
  // A 512-token shared prefix (a system prompt), then two different questions.
  std::string text;
  for (int i = 0; text.empty() || static_cast<int64_t>(l.tokenizer->encode(text, false, false).size()) < 600; ++i)
    text += "Rule " + std::to_string(i) + ": answer briefly, politely and only with facts you know well. ";
  std::vector<int32_t> prefix = l.tokenizer->encode(text, false, false);
  prefix.resize(512);
  auto with = [&](const std::string& q) {
    auto p = prefix;
    const auto t = l.tokenizer->encode(q, false, false);
    p.insert(p.end(), t.begin(), t.end());
    return p;
  };
  const auto first = with(" Question: what is the capital of France? Answer:");
  const auto second = with(" Question: what colour is the sky? Answer:");

  EngineConfig cold_cfg;
  cold_cfg.enable_prefix_caching = false;
  Engine cold(*l.model, l.tokenizer.get(), cold_cfg);
  const auto cold_out = run_engine(cold, l, {second}, 16);

  Engine warm(*l.model, l.tokenizer.get(), EngineConfig{});
  run_engine(warm, l, {first}, 4);
  const int64_t computed_before = warm.stats().n_prompt_tokens_computed;
  const auto warm_out = run_engine(warm, l, {second}, 16);
  EXPECT_EQ(warm_out[0].metrics.n_cached_prompt_tokens, 512);
  EXPECT_EQ(warm.stats().n_prompt_tokens_computed - computed_before, static_cast<int64_t>(second.size()) - 512);
  EXPECT_EQ(warm.stats().prefix_cache_hit_tokens, 512);
  EXPECT_EQ(warm_out[0].ids, cold_out[0].ids);
  EXPECT_EQ(cold_out[0].metrics.n_cached_prompt_tokens, 0);
}

TEST(Engine, AbortFreesTheRequestAndReportsIt) {
  KESTREL_REQUIRE_FILE(stories_path());
  const Loaded l = load(stories_path());
  Engine e(*l.model, l.tokenizer.get(), EngineConfig{});
  Request r;
  r.prompt = l.tokenizer->encode("Once upon a time", true, false);
  r.max_tokens = 100;
  r.sampling.temperature = 0;
  const RequestId a = e.add_request(r);
  const RequestId b = e.add_request(r);
  e.step();
  e.step();
  e.abort_request(a);
  e.abort_request(12345);  // unknown: ignored
  bool saw_abort = false;
  while (e.has_unfinished()) {
    for (const auto& o : e.step()) {
      if (o.id == a) {
        EXPECT_TRUE(o.finished);
        EXPECT_EQ(o.finish_reason, "abort");
        EXPECT_EQ(o.metrics.n_output_tokens, 2);
        saw_abort = true;
      } else {
        EXPECT_EQ(o.id, b);
      }
    }
  }
  EXPECT_TRUE(saw_abort);
  EXPECT_EQ(e.n_running() + e.n_waiting(), 0u);
}

TEST(Engine, StopStringCutsTheTextAndEndsTheRequest) {
  KESTREL_REQUIRE_FILE(stories_path());
  const Loaded l = load(stories_path());
  const auto prompt = l.tokenizer->encode("Once upon a time, there was a little girl named Lily", true, false);
  const auto alone = run_alone(l, {prompt}, 60)[0];
  const std::string full = l.tokenizer->decode(alone, true, true);
  ASSERT_GT(full.size(), 40u);
  const std::string stop = full.substr(20, 6);
  const size_t cut = full.find(stop);
  Engine e(*l.model, l.tokenizer.get(), EngineConfig{});
  Request r;
  r.prompt = prompt;
  r.max_tokens = 60;
  r.sampling.temperature = 0;
  r.stop = {"this string never appears", stop};
  e.add_request(r);
  std::string text;
  std::string reason;
  std::vector<int32_t> ids;
  while (e.has_unfinished())
    for (const auto& o : e.step()) {
      text += o.text_delta;
      ids.insert(ids.end(), o.new_token_ids.begin(), o.new_token_ids.end());
      if (o.finished) reason = o.finish_reason;
    }
  EXPECT_EQ(reason, "stop");
  EXPECT_EQ(text, full.substr(0, cut));
  EXPECT_LT(ids.size(), alone.size());
  EXPECT_EQ(ids, std::vector<int32_t>(alone.begin(), alone.begin() + static_cast<long>(ids.size())));
}

TEST(Engine, BadRequestsAreClearErrorsAndQueueNothing) {
  KESTREL_REQUIRE_FILE(stories_path());
  const Loaded l = load(stories_path());
  EngineConfig c;
  c.max_model_len = 64;
  Engine e(*l.model, l.tokenizer.get(), c);
  Request r;
  EXPECT_THROW(e.add_request(r), Error);  // empty prompt
  r.prompt = std::vector<int32_t>(64, 5);
  EXPECT_THROW(e.add_request(r), Error);  // no room to generate
  r.prompt = {1, 100000};
  EXPECT_THROW(e.add_request(r), Error);  // outside the vocabulary
  r.prompt = {1, 5};
  r.max_tokens = 0;
  EXPECT_THROW(e.add_request(r), Error);
  r.max_tokens = 4;
  r.sampling.top_p = 2;
  EXPECT_THROW(e.add_request(r), Error);
  r.sampling.top_p = 1;
  r.stop = {""};
  EXPECT_THROW(e.add_request(r), Error);
  EXPECT_FALSE(e.has_unfinished());
  // A KV pool that cannot hold one max_model_len sequence is a config error.
  EngineConfig small = c;
  small.n_kv_blocks = 2;
  EXPECT_THROW(Engine(*l.model, l.tokenizer.get(), small), Error);
  EngineConfig too_long;
  too_long.max_model_len = 1 << 30;
  EXPECT_THROW(Engine(*l.model, l.tokenizer.get(), too_long), Error);
}

TEST(Engine, LengthLimitIsMaxModelLen) {
  KESTREL_REQUIRE_FILE(stories_path());
  const Loaded l = load(stories_path());
  EngineConfig c;
  c.max_model_len = 32;
  Engine e(*l.model, l.tokenizer.get(), c);
  Request r;
  r.prompt = l.tokenizer->encode("Once upon a time", true, false);
  r.max_tokens = -1;
  r.sampling.temperature = 0;
  e.add_request(r);
  RequestOutput last;
  while (e.has_unfinished())
    for (auto& o : e.step())
      if (o.finished) last = o;
  EXPECT_EQ(last.finish_reason, "length");
  EXPECT_EQ(last.metrics.n_prompt_tokens + last.metrics.n_output_tokens, 32);
}

// 1,000 random submit / abort / step operations on a small pool with shared prefixes: requests
// finish, are aborted while waiting or running, are preempted and hit the prefix cache; at the
// end every block is free or cached, none held.
TEST(Engine, ThousandRandomSubmitAbortFinishOperationsLeakNoBlock) {
  KESTREL_REQUIRE_FILE(stories_path());
  const Loaded l = load(stories_path());
  EngineConfig c;
  c.block_size = 4;
  c.max_model_len = 96;
  c.n_kv_blocks = 48;
  c.max_num_seqs = 6;
  c.max_num_batched_tokens = 32;
  Engine e(*l.model, l.tokenizer.get(), c);
  std::mt19937 rng(99);
  const auto prompts = tokenize_all(*l.tokenizer, story_prompts());
  std::vector<RequestId> live;
  int n_finished = 0, n_aborted = 0;
  for (int op = 0; op < 1000; ++op) {
    const int kind = static_cast<int>(rng() % 10);
    if (kind < 3) {
      Request r;
      r.prompt = prompts[rng() % prompts.size()];
      for (int i = static_cast<int>(rng() % 12); i > 0; --i) r.prompt.push_back(static_cast<int32_t>(3 + rng() % 500));
      r.max_tokens = 1 + static_cast<int64_t>(rng() % 40);
      r.sampling.temperature = (rng() % 2) ? 0.0f : 0.8f;
      r.sampling.seed = rng();
      live.push_back(e.add_request(r));
    } else if (kind < 4 && !live.empty()) {
      const size_t i = rng() % live.size();
      e.abort_request(live[i]);
      live.erase(live.begin() + static_cast<long>(i));
    } else {
      for (const RequestOutput& o : e.step())
        if (o.finished) {
          (o.finish_reason == "abort" ? n_aborted : n_finished)++;
          live.erase(std::remove(live.begin(), live.end(), o.id), live.end());
        }
    }
    ASSERT_EQ(e.stats().kv_blocks_used + e.stats().kv_blocks_free, c.n_kv_blocks);
  }
  for (RequestId id : live) e.abort_request(id);
  while (e.has_unfinished())
    for (const RequestOutput& o : e.step()) (o.finish_reason == "abort" ? n_aborted : n_finished)++;
  EXPECT_GT(n_finished, 50);
  EXPECT_GT(n_aborted, 50);
  EXPECT_GT(e.stats().n_preemptions, 0);
  EXPECT_GT(e.stats().prefix_cache_hit_tokens, 0);
  EXPECT_EQ(e.stats().kv_blocks_used, 0);
  EXPECT_EQ(e.stats().kv_blocks_free, c.n_kv_blocks);
  EXPECT_GT(e.stats().kv_blocks_cached, 0);
  EXPECT_EQ(e.n_running() + e.n_waiting(), 0u);
}

// Corrupt weights (NaN in the final norm) end each request with an error; the engine itself keeps
// working and frees every block.
TEST(Engine, NanLogitsEndTheRequestNotTheEngine) {
  KESTREL_REQUIRE_FILE(stories_path());
  std::string bytes = test::read_file(stories_path());
  {
    const GgufFile f = GgufFile::parse(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
    const GgufTensorInfo* norm = nullptr;
    for (const auto& t : f.tensors())
      if (t.name == "output_norm.weight") norm = &t;
    ASSERT_NE(norm, nullptr);
    const float nan = std::numeric_limits<float>::quiet_NaN();
    for (uint64_t i = 0; i < norm->n_bytes; i += 4)
      std::memcpy(bytes.data() + f.data_offset() + norm->offset + i, &nan, 4);
  }
  const std::string path = ::testing::TempDir() + "/nan_stories.gguf";
  {
    std::ofstream out(path, std::ios::binary);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  const Loaded l = load(path);
  Engine e(*l.model, l.tokenizer.get(), EngineConfig{});
  Request r;
  r.prompt = l.tokenizer->encode("Once upon a time", true, false);
  r.max_tokens = 8;
  e.add_request(r);
  e.add_request(r);
  int n_errors = 0;
  while (e.has_unfinished())
    for (const RequestOutput& o : e.step()) {
      EXPECT_TRUE(o.finished);
      EXPECT_EQ(o.finish_reason, "error");
      EXPECT_NE(o.error.find("NaN"), std::string::npos) << o.error;
      ++n_errors;
    }
  EXPECT_EQ(n_errors, 2);
  EXPECT_EQ(e.stats().kv_blocks_used, 0);

  // prompt_logprobs meets the NaN logits in a prompt chunk that samples nothing yet: the request
  // ends in that step, with an error that names the prompt.
  EngineConfig c;
  c.max_num_batched_tokens = 8;
  Engine chunked(*l.model, l.tokenizer.get(), c);
  r.prompt = l.tokenizer->encode("Once upon a time, there was a little girl named Lily who", true, false);
  ASSERT_GT(r.prompt.size(), 8u);
  r.prompt_logprobs = 1;
  const RequestId scored = chunked.add_request(r);
  std::vector<RequestOutput> first = chunked.step();
  ASSERT_EQ(first.size(), 1u);
  EXPECT_EQ(first[0].id, scored);
  EXPECT_EQ(first[0].finish_reason, "error");
  EXPECT_NE(first[0].error.find("prompt"), std::string::npos) << first[0].error;
  EXPECT_FALSE(chunked.has_unfinished());
  EXPECT_EQ(chunked.stats().kv_blocks_used, 0);
}

// logprobs: each sampled token comes with its own logprob and the top alternatives, and asking for
// them changes no token.
TEST(Engine, LogprobsComeWithEachTokenAndChangeNoToken) {
  KESTREL_REQUIRE_FILE(stories_path());
  const Loaded l = load(stories_path());
  Engine e(*l.model, l.tokenizer.get(), EngineConfig{});
  Request r;
  r.prompt = l.tokenizer->encode("Once upon a time", true, false);
  r.max_tokens = 24;
  r.sampling.temperature = 0.9f;
  r.sampling.seed = 42;
  const RequestId plain = e.add_request(r);
  r.logprobs = 3;
  const RequestId with = e.add_request(r);
  r.sampling.temperature = 0;
  const RequestId greedy = e.add_request(r);
  std::map<RequestId, std::vector<int32_t>> ids;
  while (e.has_unfinished())
    for (const RequestOutput& o : e.step()) {
      ids[o.id].insert(ids[o.id].end(), o.new_token_ids.begin(), o.new_token_ids.end());
      if (o.id == plain) {
        EXPECT_TRUE(o.logprobs.empty());
        continue;
      }
      ASSERT_EQ(o.logprobs.size(), o.new_token_ids.size());
      for (size_t i = 0; i < o.logprobs.size(); ++i) {
        const LogprobSummary& s = o.logprobs[i];
        EXPECT_EQ(s.chosen.token, o.new_token_ids[i]);
        ASSERT_EQ(s.top.size(), 3u);
        EXPECT_LE(s.chosen.logprob, 0.0f);
        EXPECT_LE(s.chosen.logprob, s.top[0].logprob);
        EXPECT_GE(s.top[0].logprob, s.top[1].logprob);
        if (o.id == greedy) {
          EXPECT_EQ(s.chosen.token, s.top[0].token);
          EXPECT_EQ(s.chosen.logprob, s.top[0].logprob);
        }
      }
    }
  EXPECT_EQ(ids[plain], ids[with]);
  EXPECT_EQ(ids[plain].size(), 24u);
  r.logprobs = kMaxRequestLogprobs + 1;
  EXPECT_THROW(e.add_request(r), Error);
}

// prompt_logprobs: every prompt token after the first gets its logprob under the model given the
// tokens before it, equal to log_softmax of the logits at the previous position of a lone
// unchunked run (tolerance 1e-4: the engine runs the prompt in 16-token chunks, the reference in one pass, so
// attention sums in another order); the request skips the prefix cache (a second identical
// request still gets every position) and its generated tokens are those of a plain request.
TEST(Engine, PromptLogprobsMatchTheModelsLogitsAtEveryPosition) {
  KESTREL_REQUIRE_FILE(stories_path());
  const Loaded l = load(stories_path());
  const std::vector<int32_t> prompt =
      l.tokenizer->encode("Once upon a time, there was a little girl named Lily. She liked to play in the park with "
                          "her big red ball, and every day she ran",
                          true, false);
  ASSERT_GT(prompt.size(), 33u);  // three chunks of 16
  const int64_t n_vocab = l.model->hparams().n_vocab;
  const std::vector<float> ref_logits = test::prompt_logits(*l.model, prompt);

  EngineConfig c;
  c.max_num_batched_tokens = 16;
  Engine e(*l.model, l.tokenizer.get(), c);
  Request r;
  r.prompt = prompt;
  r.max_tokens = 8;
  r.sampling.temperature = 0;
  const RequestId plain = e.add_request(r);
  r.prompt_logprobs = 3;
  const RequestId first = e.add_request(r);
  std::map<RequestId, std::vector<int32_t>> ids;
  std::map<RequestId, std::vector<LogprobSummary>> got;
  std::map<RequestId, RequestMetrics> metrics;
  auto drain = [&] {
    while (e.has_unfinished())
      for (const RequestOutput& o : e.step()) {
        if (!o.prompt_logprobs.empty()) {
          EXPECT_TRUE(got[o.id].empty()) << "prompt logprobs come once, with the first token";
          EXPECT_EQ(o.new_token_ids.size(), 1u);
        }
        got[o.id].insert(got[o.id].end(), o.prompt_logprobs.begin(), o.prompt_logprobs.end());
        ids[o.id].insert(ids[o.id].end(), o.new_token_ids.begin(), o.new_token_ids.end());
        if (o.finished) metrics[o.id] = o.metrics;
      }
  };
  drain();
  const RequestId second = e.add_request(r);  // the prompt's blocks are in the prefix cache now
  drain();
  EXPECT_TRUE(got[plain].empty());
  EXPECT_EQ(metrics[second].n_cached_prompt_tokens, 0);
  for (const RequestId id : {first, second}) {
    SCOPED_TRACE(id == first ? "first" : "second");
    EXPECT_EQ(ids[id], ids[plain]);
    ASSERT_EQ(got[id].size(), prompt.size() - 1);
    for (size_t p = 1; p < prompt.size(); ++p) {
      const LogprobSummary& s = got[id][p - 1];
      const LogprobSummary want = compute_logprobs(
          std::span<const float>(ref_logits).subspan((p - 1) * static_cast<size_t>(n_vocab), static_cast<size_t>(n_vocab)),
          prompt[p], 3);
      EXPECT_EQ(s.chosen.token, prompt[p]);
      EXPECT_NEAR(s.chosen.logprob, want.chosen.logprob, 1e-4) << "position " << p;
      ASSERT_EQ(s.top.size(), 3u);
      for (size_t k = 0; k < 3; ++k) {
        EXPECT_EQ(s.top[k].token, want.top[k].token) << "position " << p;
        EXPECT_NEAR(s.top[k].logprob, want.top[k].logprob, 1e-4);
      }
    }
  }
  EXPECT_EQ(e.stats().kv_blocks_used, 0);
  r.prompt_logprobs = kMaxRequestLogprobs + 1;
  EXPECT_THROW(e.add_request(r), Error);
}

// A prompt_logprobs request keeps each step's logits rows bounded: a 300-token prompt under a
// 1,024-token step budget is prefilled as 256 + 44 tokens, and still scored at every position.
TEST(Engine, PromptLogprobsPrefillInBoundedChunks) {
  KESTREL_REQUIRE_FILE(stories_path());
  const Loaded l = load(stories_path());
  std::vector<int32_t> prompt{1};
  std::mt19937 rng(5);
  while (prompt.size() < 300) prompt.push_back(static_cast<int32_t>(3 + rng() % 500));
  EngineConfig c;
  c.max_num_batched_tokens = 1024;
  Engine e(*l.model, l.tokenizer.get(), c);
  Request r;
  r.prompt = prompt;
  r.max_tokens = 2;
  r.sampling.temperature = 0;
  r.prompt_logprobs = 0;
  e.add_request(r);
  std::vector<int64_t> computed;
  size_t n_scored = 0;
  while (e.has_unfinished()) {
    const int64_t before = e.stats().n_prompt_tokens_computed;
    for (const RequestOutput& o : e.step()) n_scored += o.prompt_logprobs.size();
    computed.push_back(e.stats().n_prompt_tokens_computed - before);
  }
  ASSERT_GE(computed.size(), 2u);
  EXPECT_EQ(computed[0], kMaxPromptLogprobRowsPerStep);
  EXPECT_EQ(computed[1], 300 - kMaxPromptLogprobRowsPerStep);
  EXPECT_EQ(n_scored, prompt.size() - 1);
}

namespace {

// A CPU backend that "samples on the device" the way the CUDA runner must: forward() on the CPU,
// then each row's token picked from the row's settings and uniform alone (test::SamplingRunner).
// If the engine hands over the uniform each request's own sampler would have drawn, its outputs
// match the CPU path exactly.
std::unique_ptr<test::SamplingRunner> device_sampling_runner(const LlamaModel& model, int32_t n_blocks) {
  RunnerOptions o;
  o.n_kv_blocks = n_blocks;
  return std::make_unique<test::SamplingRunner>(make_cpu_model_runner(model, o), /*on_device=*/true);
}

std::vector<std::vector<int32_t>> run_sampled(Engine& e, const std::vector<std::vector<int32_t>>& prompts,
                                              const std::vector<SamplingParams>& params) {
  std::map<RequestId, size_t> index;
  for (size_t i = 0; i < prompts.size(); ++i) {
    Request r;
    r.prompt = prompts[i];
    r.max_tokens = 24;
    r.sampling = params[i % params.size()];
    r.sampling.seed = 1000 + i;
    index[e.add_request(r)] = i;
  }
  std::vector<std::vector<int32_t>> out(prompts.size());
  while (e.has_unfinished())
    for (const RequestOutput& o : e.step())
      out[index.at(o.id)].insert(out[index.at(o.id)].end(), o.new_token_ids.begin(), o.new_token_ids.end());
  return out;
}

}  // namespace

// Device sampling keeps each request's random stream: the engine passes each row the
// uniform its own Sampler would have drawn, so with the same logits a backend that samples on the
// device gives exactly the CPU path's tokens, for greedy, temperature, top-k, top-p and min-p
// requests in one batch. A request with a penalty or logit bias sends its whole step down the
// host path (the device sampler implements neither).
TEST(Engine, DeviceSamplingGivesTheHostSamplersTokens) {
  KESTREL_REQUIRE_FILE(stories_path());
  const Loaded l = load(stories_path());
  const auto prompts = tokenize_all(*l.tokenizer, story_prompts());
  std::vector<SamplingParams> params(5);
  params[0].temperature = 0;
  params[1].temperature = 0.8f;
  params[2].temperature = 1.0f, params[2].top_k = 20;
  params[3].temperature = 1.3f, params[3].top_p = 0.9f;
  params[4].temperature = 0.7f, params[4].min_p = 0.05f, params[4].top_k = 40, params[4].top_p = 0.95f;
  EngineConfig c;
  c.max_num_batched_tokens = 64;
  c.max_num_seqs = 12;
  c.n_kv_blocks = 256;
  Engine host(*l.model, l.tokenizer.get(), c);
  const auto want = run_sampled(host, prompts, params);
  auto runner = device_sampling_runner(*l.model, c.n_kv_blocks);
  test::SamplingRunner* dev = runner.get();
  Engine device(*l.model, l.tokenizer.get(), c, std::move(runner));
  EXPECT_EQ(run_sampled(device, prompts, params), want);
  EXPECT_GT(dev->device_calls, 0);
  EXPECT_EQ(dev->host_calls, 0);
  // Different seeds per request actually sampled differently from greedy somewhere.
  std::vector<SamplingParams> greedy(1);
  greedy[0].temperature = 0;
  Engine g(*l.model, l.tokenizer.get(), c);
  EXPECT_NE(run_sampled(g, prompts, greedy), want);

  // One request with a repetition penalty: every step it is in goes through forward() and the
  // host samplers, and the tokens still match.
  params[2].repetition_penalty = 1.3f;
  Engine host2(*l.model, l.tokenizer.get(), c);
  const auto want2 = run_sampled(host2, prompts, params);
  auto runner2 = device_sampling_runner(*l.model, c.n_kv_blocks);
  test::SamplingRunner* dev2 = runner2.get();
  Engine device2(*l.model, l.tokenizer.get(), c, std::move(runner2));
  EXPECT_EQ(run_sampled(device2, prompts, params), want2);
  EXPECT_GT(dev2->host_calls, 0);
}

// A request that asks for logprobs needs the logits on the host: its steps take forward() even on
// a backend that samples on the device, and it gets a logprob for every token.
TEST(Engine, LogprobsTakeTheHostPathOnADeviceSamplingBackend) {
  KESTREL_REQUIRE_FILE(stories_path());
  const Loaded l = load(stories_path());
  EngineConfig c;
  c.n_kv_blocks = 256;
  auto runner = device_sampling_runner(*l.model, c.n_kv_blocks);
  test::SamplingRunner* dev = runner.get();
  Engine e(*l.model, l.tokenizer.get(), c, std::move(runner));
  Request r;
  r.prompt = l.tokenizer->encode("Once upon a time", true, false);
  r.max_tokens = 8;
  r.sampling.temperature = 0.8f;
  r.logprobs = 2;
  e.add_request(r);
  size_t n_tokens = 0, n_logprobs = 0;
  while (e.has_unfinished())
    for (const RequestOutput& o : e.step()) {
      n_tokens += o.new_token_ids.size();
      n_logprobs += o.logprobs.size();
    }
  EXPECT_EQ(n_tokens, 8u);
  EXPECT_EQ(n_logprobs, 8u);
  EXPECT_GT(dev->host_calls, 0);
  EXPECT_EQ(dev->device_calls, 0);
}

// EngineStats::host_seconds counts the gaps between one pass's results and the next launch, one a
// step after the first of a run of work, and not the time the engine waits for requests: on the
// forward() path and on a backend that samples on the device (forward_sample).
TEST(Engine, HostGapsAreCountedBetweenPassesNotWhileIdle) {
  KESTREL_REQUIRE_FILE(stories_path());
  const Loaded l = load(stories_path());
  EngineConfig c;
  c.n_kv_blocks = 256;
  for (const bool on_device : {false, true}) {
    auto engine = on_device ? std::make_unique<Engine>(*l.model, l.tokenizer.get(), c,
                                                       device_sampling_runner(*l.model, c.n_kv_blocks))
                            : std::make_unique<Engine>(*l.model, l.tokenizer.get(), c);
    Engine& e = *engine;
    double slept = 0;
    for (int round = 0; round < 2; ++round) {
      const EngineStats before = e.stats();
      Request r;
      r.prompt = l.tokenizer->encode("Once upon a time", true, false);
      r.max_tokens = 6;
      r.sampling.temperature = 0;
      e.add_request(r);
      while (e.has_unfinished()) e.step();
      EXPECT_TRUE(e.step().empty());  // nothing to run: the idle time from here is not the host's
      const EngineStats& after = e.stats();
      EXPECT_EQ(after.n_steps - before.n_steps, 6) << on_device;
      EXPECT_EQ(after.n_host_gaps - before.n_host_gaps, 5) << on_device;  // between the 6 passes
      EXPECT_GT(after.host_seconds, before.host_seconds) << on_device;
      const auto t0 = std::chrono::steady_clock::now();
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      slept += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    EXPECT_LT(e.stats().host_seconds, slept / 2) << "the idle sleeps were counted as host time, on_device " << on_device;
  }
}
