// Speculative decoding with a draft model (DraftModelDrafter) on stories260K (CPU), two drafts:
// stories260K itself (a perfect drafter: every greedy draft is the target's argmax) and a copy of
// it with 10% multiplicative noise on its block matrices (an imperfect one). Greedy output is
// token-identical to decoding without drafts (q one-hot: the verifier accepts exactly the argmax)
// for k = 1..8, for 32 mixed requests batched, under preemption and with prefix-cache hits; seeded
// sampled requests (full q rows) are reproducible; the draft's KV is returned when requests end; a
// draft with another vocabulary is refused by name.
#include <gtest/gtest.h>

#include <map>
#include <optional>

#include "engine/engine.h"
#include "io/gguf.h"
#include "spec/draft_model_drafter.h"
#include "test_util.h"

using namespace kestrel;

namespace {

using test::eog_ids;
using test::story_prompts;

using test::stories_path;

using Loaded = test::LoadedModel;
const Loaded& stories() {
  static const Loaded l = test::load_model(test::stories_path());
  return l;
}

enum class DraftKind { Same, Perturbed };

// The perturbed draft: stories260K with 10% multiplicative noise on its block matrices.
const std::string& perturbed_path() {
  static const std::string p = test::write_perturbed_gguf(stories_path(), 0.1, 1);
  return p;
}

DraftModel draft_model(DraftKind kind) {
  DraftModel d;
  d.model = LlamaModel::load_gguf(kind == DraftKind::Perturbed ? perturbed_path() : stories_path());
  d.tokenizer = Tokenizer::from_gguf(d.model->file());
  return d;
}

SpeculativeConfig draft_config(int32_t k) {
  SpeculativeConfig s;
  s.method = SpecMethod::DraftModel;
  s.model = stories_path();
  s.num_speculative_tokens = k;
  return s;
}

Request greedy(const std::string& text, int64_t max_tokens) {
  Request r;
  r.prompt = stories().tokenizer->encode(text, true, false);
  r.max_tokens = max_tokens;
  r.sampling.temperature = 0;
  r.stop_ids = eog_ids(*stories().tokenizer);
  return r;
}

struct Result {
  std::vector<int32_t> ids;
  std::string reason;
};

// Submits every request at once, steps the engine to the end, and checks that the target's and
// the draft's KV blocks all came back.
std::vector<Result> run(Engine& e, const std::vector<Request>& reqs) {
  std::map<RequestId, size_t> index;
  for (size_t i = 0; i < reqs.size(); ++i) index[e.add_request(reqs[i])] = i;
  std::vector<Result> out(reqs.size());
  while (e.has_unfinished())
    for (RequestOutput& o : e.step()) {
      Result& r = out[index.at(o.id)];
      r.ids.insert(r.ids.end(), o.new_token_ids.begin(), o.new_token_ids.end());
      if (o.finished) r.reason = o.finish_reason;
    }
  EXPECT_EQ(e.stats().kv_blocks_used, 0) << "a request kept target KV blocks";
  if (const auto* d = dynamic_cast<const DraftModelDrafter*>(e.drafter())) {
    EXPECT_EQ(d->n_seqs(), 0u) << "the drafter kept a finished sequence";
    EXPECT_EQ(d->n_used_blocks(), 0) << "the drafter kept draft KV blocks";
  }
  return out;
}

std::vector<Result> run(EngineConfig c, const std::vector<Request>& reqs, std::optional<DraftKind> draft = std::nullopt,
                        EngineStats* stats = nullptr) {
  Engine e(*stories().model, stories().tokenizer.get(), c, nullptr, draft ? draft_model(*draft) : DraftModel{});
  auto out = run(e, reqs);
  if (stats != nullptr) *stats = e.stats();
  return out;
}

void expect_same(const std::vector<Result>& got, const std::vector<Result>& want, const std::string& what,
                 const std::vector<Request>* only_greedy = nullptr) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    if (only_greedy != nullptr && (*only_greedy)[i].sampling.temperature != 0.0f) continue;
    EXPECT_EQ(got[i].ids, want[i].ids) << what << ", request " << i;
    EXPECT_EQ(got[i].reason, want[i].reason) << what << ", request " << i;
  }
}

}  // namespace

TEST(SpecDraftModel, GreedySingleRequestsAreTokenIdenticalForKOneToEight) {
  KESTREL_REQUIRE_FILE(stories_path());
  const auto prompts = story_prompts();
  for (size_t p = 0; p < prompts.size(); p += 13) {
    const std::vector<Request> reqs = {greedy(prompts[p], 80)};
    EngineConfig off;
    off.max_num_seqs = 1;
    const auto want = run(off, reqs);
    for (int32_t k = 1; k <= 8; ++k)
      for (const DraftKind d : {DraftKind::Same, DraftKind::Perturbed}) {
        const std::string what = "k " + std::to_string(k) + (d == DraftKind::Same ? ", same model" : ", perturbed draft");
        EngineConfig on = off;
        on.speculative = draft_config(k);
        EngineStats st;
        expect_same(run(on, reqs, d, &st), want, what);
        EXPECT_GT(st.spec_num_draft_tokens, 0) << what;
        if (d == DraftKind::Same) {
          // The draft is the target: its argmax is the target's at every drafted position.
          EXPECT_EQ(st.spec_num_accepted_tokens, st.spec_num_draft_tokens) << what;
          EXPECT_LE(st.n_steps, 1 + (static_cast<int64_t>(want[0].ids.size()) + k) / (k + 1) + 1) << what;
        } else {
          EXPECT_GT(st.spec_acceptance_rate(), 0.2) << what;
          EXPECT_LT(st.spec_num_accepted_tokens, st.spec_num_draft_tokens) << what << ": the perturbed draft should miss somewhere";
        }
      }
  }
}

TEST(SpecDraftModel, ThirtyTwoMixedRequestsBatchedMatchSpeculationOff) {
  KESTREL_REQUIRE_FILE(stories_path());
  const auto prompts = story_prompts();
  std::vector<Request> reqs;
  for (size_t i = 0; i < prompts.size(); ++i) {
    Request r = greedy(prompts[i], 16 + static_cast<int64_t>(i % 5) * 13);
    if (i % 4 == 1) r.sampling.repetition_penalty = 1.3f;  // greedy with a penalty at every draft position
    if (i % 3 == 2) {  // sampled: the draft draws from its processed distribution, q rows verified
      r.sampling.temperature = 0.8f;
      r.sampling.top_p = 0.95f;
      r.sampling.seed = 500 + i;
    }
    reqs.push_back(r);
  }
  EngineConfig off;
  off.max_num_batched_tokens = 96;
  off.max_num_seqs = 12;
  const auto want = run(off, reqs);
  for (int32_t k : {3, 8})
    for (const DraftKind d : {DraftKind::Same, DraftKind::Perturbed}) {
      const std::string what = "k " + std::to_string(k) + (d == DraftKind::Same ? ", same model" : ", perturbed draft");
      EngineConfig on = off;
      on.speculative = draft_config(k);
      EngineStats st;
      const auto got = run(on, reqs, d, &st);
      expect_same(got, want, what, &reqs);
      // Seeded sampled requests give the same output on a second run (the draft's draws are
      // counter-based per seed and position).
      const auto again = run(on, reqs, d);
      expect_same(again, got, what + ", rerun");
      EXPECT_GT(st.spec_num_accepted_tokens, 0) << what;
    }
}

TEST(SpecDraftModel, PreemptionAndPrefixCacheHitsKeepOutputsIdentical) {
  KESTREL_REQUIRE_FILE(stories_path());
  std::vector<Request> reqs;
  for (const auto& p : story_prompts()) reqs.push_back(greedy(p, 64));
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
    c.speculative = draft_config(6);
    EngineStats st;
    expect_same(run(c, reqs, DraftKind::Perturbed, &st), want, caching ? "preemption, caching" : "preemption");
    EXPECT_GT(st.n_preemptions, 0);
    EXPECT_GT(st.spec_num_accepted_tokens, 0);
  }
  // A second round whose prompts extend the first round's outputs hits the target's and the
  // draft's prefix caches, and gives what a fresh engine gives.
  EngineConfig c;
  c.block_size = 4;
  c.max_num_seqs = 8;
  c.speculative = draft_config(5);
  Engine e(*stories().model, stories().tokenizer.get(), c, nullptr, draft_model(DraftKind::Perturbed));
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

TEST(SpecDraftModel, DraftWithAnotherVocabularyIsRefused) {
  KESTREL_REQUIRE_FILE(stories_path());
  const std::string tiny = test::data_dir() + "/llama-2-tiny-random/llama-2-tiny-random.gguf";
  KESTREL_REQUIRE_FILE(tiny);
  EngineConfig c;
  c.speculative = draft_config(4);
  DraftModel d;
  d.model = LlamaModel::load_gguf(tiny);
  d.tokenizer = Tokenizer::from_gguf(d.model->file());
  const std::string err = test::error_of([&] { Engine(*stories().model, stories().tokenizer.get(), c, nullptr, std::move(d)); });
  EXPECT_NE(err.find("vocabulary of 32000 tokens but the target"), std::string::npos) << err;
  EXPECT_NE(err.find("has 512"), std::string::npos) << err;
  // draft_model without a draft.
  const std::string none = test::error_of([&] { Engine(*stories().model, stories().tokenizer.get(), c); });
  EXPECT_NE(none.find("needs the draft model"), std::string::npos) << none;
  // Same size, other token strings or special ids: the tokenizers are compared token by token.
  const Tokenizer& t = *stories().tokenizer;
  TokenizerSpec spec;
  spec.kind = TokenizerKind::SPM;
  for (int32_t id = 0; id < t.n_vocab(); ++id) spec.tokens.push_back(t.token(id));
  spec.bos_id = t.bos_id();
  spec.eos_id = t.eos_id();
  spec.unk_id = t.unk_id();
  spec.tokens[300].text = "\xe2\x96\x81renamed";
  const auto other = Tokenizer::from_spec(spec);
  const std::string words = test::error_of(
      [&] { check_draft_vocabulary(*stories().model, &t, *stories().model, other.get()); });
  EXPECT_NE(words.find("token 300 is '\xe2\x96\x81renamed'"), std::string::npos) << words;
  spec.tokens[300] = t.token(300);
  spec.eos_id = 5;
  const auto other_eos = Tokenizer::from_spec(spec);
  const std::string eos = test::error_of(
      [&] { check_draft_vocabulary(*stories().model, &t, *stories().model, other_eos.get()); });
  EXPECT_NE(eos.find("EOS id is 5, the target's " + std::to_string(t.eos_id())), std::string::npos) << eos;
  EXPECT_TRUE(test::error_of([&] { check_draft_vocabulary(*stories().model, &t, *stories().model, &t); }).empty());
}

TEST(SpecDraftModel, DraftUniformIsAFunctionOfSeedAndPosition) {
  // Fixed values: SplitMix64 as Steele et al. define it (constants 0x9e3779b97f4a7c15,
  // 0xbf58476d1ce4e5b9, 0x94d049bb133111eb); what matters is that equal arguments agree, that
  // neighbours differ, and that the values spread over [0, 1).
  EXPECT_EQ(draft_uniform(7, 100), draft_uniform(7, 100));
  EXPECT_NE(draft_uniform(7, 100), draft_uniform(7, 101));
  EXPECT_NE(draft_uniform(7, 100), draft_uniform(8, 100));
  double sum = 0;
  int below_tenth = 0;
  for (int64_t p = 0; p < 10000; ++p) {
    const double u = draft_uniform(12345, p);
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
    sum += u;
    below_tenth += u < 0.1;
  }
  EXPECT_NEAR(sum / 10000, 0.5, 0.01);
  EXPECT_NEAR(below_tenth, 1000, 100);
}

// The drafter on its own: its greedy drafts are the target's greedy continuation (the draft is the
// target) after a prefill, after a verification that kept some drafts and replaced the next, and
// after drafts that were dropped without a verification; a pool too small for two sequences frees
// the idle one for the one drafting.
TEST(SpecDraftModel, DrafterKeepsItsKvInStepWithTheSequence) {
  KESTREL_REQUIRE_FILE(stories_path());
  const auto continuation = [](std::vector<int32_t> prompt, int64_t n) {
    Request r;
    r.prompt = std::move(prompt);
    r.max_tokens = n;
    r.sampling.temperature = 0;
    EngineConfig c;
    c.max_num_seqs = 1;
    Engine e(*stories().model, nullptr, c);
    return run(e, {r})[0].ids;
  };
  DrafterContext ctx;
  ctx.target = stories().model.get();
  ctx.target_tokenizer = stories().tokenizer.get();
  ctx.max_num_seqs = 1;  // a pool of one sequence of 64 tokens: 8 blocks of 8
  ctx.max_model_len = 64;
  ctx.max_num_batched_tokens = 16;  // the 40-token prompts are fed in three chunks
  ctx.block_size = 8;
  ctx.kv_dtype = KvDtype::F32;
  DraftModelDrafter d(ctx, draft_model(DraftKind::Same));
  std::vector<int32_t> a = stories().tokenizer->encode(
      "Once upon a time, there was a little girl named Lily. She liked to play with her red ball in the park", true, false);
  std::vector<int32_t> b = stories().tokenizer->encode(
      "One day, a big dog ran to the river. The dog wanted to swim with the fish but the water was very cold", true, false);
  a.resize(40);
  b.resize(40);
  std::vector<Draft> out;
  std::vector<DraftRequest> reqs = {{1, a, 40, 4}, {2, b, 40, 4}};
  d.propose(reqs, out);
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[0].ids, continuation(a, 4));
  EXPECT_TRUE(out[0].q.empty()) << "greedy drafts are one-hot";
  EXPECT_TRUE(out[1].ids.empty()) << "no room for a second sequence of 40 tokens beside the first's 43";
  // Two drafts kept, the third replaced by another token.
  std::vector<int32_t> a2 = a;
  a2.insert(a2.end(), out[0].ids.begin(), out[0].ids.begin() + 2);
  a2.push_back(out[0].ids[2] == 7 ? 8 : 7);
  d.on_verified(1, 2, static_cast<int64_t>(a2.size()));
  reqs = {{1, a2, 40, 3}};
  d.propose(reqs, out);
  EXPECT_EQ(out[0].ids, continuation(a2, 3));
  // Those drafts dropped unverified (the scheduler did not run them): the same request again.
  d.propose(reqs, out);
  EXPECT_EQ(out[0].ids, continuation(a2, 3));
  // Only b drafts: a is idle and gives its blocks up.
  reqs = {{2, b, 40, 5}};
  d.propose(reqs, out);
  EXPECT_EQ(out[0].ids, continuation(b, 5));
  EXPECT_EQ(d.n_seqs(), 1u);
  d.release(2);
  EXPECT_EQ(d.n_seqs(), 0u);
  EXPECT_EQ(d.n_used_blocks(), 0);
}
