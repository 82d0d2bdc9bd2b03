// Failures that belong to one request: a request whose logits row is not finite (inf or NaN, from
// the model or from its own penalties) ends with finish_reason "error" and a message, while the
// engine and the requests beside it go on exactly as they would without it.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <vector>

#include "backend/model_runner.h"
#include "engine/engine.h"
#include "test_util.h"

using namespace kestrel;

namespace {

using Loaded = test::LoadedModel;
Loaded load_stories() { return test::load_model(test::stories_path()); }

// What FaultyRunner does to a sequence's logits rows.
enum class Fault {
  Inf,   // one logit +inf
  NaN,   // one logit NaN
  Huge,  // every logit 3e37: finite, but a repetition penalty of 0.01 takes it past FLT_MAX
};

// The CPU runner, with the logits rows of some sequences altered: those whose chunk starts at
// position 0 with a marker token second (the test's bad prompts are [BOS, marker, ...]; the first
// chunk of a prompt carries its whole start).
class FaultyRunner final : public ModelRunner {
 public:
  FaultyRunner(const LlamaModel& model, int32_t n_blocks, std::map<int32_t, Fault> faults)
      : n_vocab_(static_cast<size_t>(model.hparams().n_vocab)), faults_(std::move(faults)) {
    RunnerOptions o;
    o.n_kv_blocks = n_blocks;
    inner_ = make_cpu_model_runner(model, o);
  }
  std::span<const float> forward(const ForwardBatch& b) override {
    const std::span<const float> in = inner_->forward(b);
    logits_.assign(in.begin(), in.end());
    for (size_t row = 0; row < b.logits_indices.size(); ++row) {
      size_t s = 0;
      while (b.query_start[s + 1] <= b.logits_indices[row]) ++s;
      const auto first = static_cast<size_t>(b.query_start[s]);
      if (b.positions[first] != 0 || b.query_start[s + 1] - b.query_start[s] < 2) continue;
      const auto fault = faults_.find(b.token_ids[first + 1]);
      if (fault == faults_.end()) continue;
      float* r = logits_.data() + row * n_vocab_;
      if (fault->second == Fault::Inf) r[3] = std::numeric_limits<float>::infinity();
      if (fault->second == Fault::NaN) r[3] = std::numeric_limits<float>::quiet_NaN();
      if (fault->second == Fault::Huge) std::fill(r, r + n_vocab_, 3e37f);
      ++n_faulted;
    }
    return logits_;
  }
  void copy_blocks(std::span<const BlockCopy> copies) override { inner_->copy_blocks(copies); }
  int32_t n_kv_blocks() const override { return inner_->n_kv_blocks(); }
  int32_t block_size() const override { return inner_->block_size(); }
  KvDtype kv_dtype() const override { return inner_->kv_dtype(); }
  int64_t kv_bytes_per_token() const override { return inner_->kv_bytes_per_token(); }
  std::string description() const override { return "faulty wrapper over " + inner_->description(); }

  int n_faulted = 0;

 private:
  size_t n_vocab_;
  std::map<int32_t, Fault> faults_;
  std::unique_ptr<ModelRunner> inner_;
  std::vector<float> logits_;
};

struct Result {
  std::vector<int32_t> ids;
  std::string text, reason, error;
};

// Submits every request at once and steps to the end; step() must not throw.
std::vector<Result> run(Engine& e, const std::vector<Request>& requests) {
  std::map<RequestId, size_t> index;
  for (size_t i = 0; i < requests.size(); ++i) index[e.add_request(requests[i])] = i;
  std::vector<Result> out(requests.size());
  while (e.has_unfinished()) {
    std::vector<RequestOutput> step;
    try {
      step = e.step();
    } catch (const std::exception& ex) {
      ADD_FAILURE() << "step() threw: " << ex.what();
      break;
    }
    for (const RequestOutput& o : step) {
      Result& r = out[index.at(o.id)];
      r.ids.insert(r.ids.end(), o.new_token_ids.begin(), o.new_token_ids.end());
      r.text += o.text_delta;
      if (o.finished) {
        r.reason = o.finish_reason;
        r.error = o.error;
      }
    }
  }
  return out;
}

}  // namespace

TEST(EngineErrors, NonFiniteRowsEndOnlyTheirRequest) {
  KESTREL_REQUIRE_FILE(test::data_dir() + "/stories260K/stories260K.gguf");
  const Loaded l = load_stories();
  const Tokenizer& tok = *l.tokenizer;
  std::vector<int32_t> stop_ids;
  for (int32_t id = 0; id < tok.n_vocab(); ++id)
    if (tok.is_eog(id)) stop_ids.push_back(id);

  // Good requests: greedy, a seeded sample with penalties, and one with logprobs.
  std::vector<Request> good;
  for (const char* text : {"Once upon a time", "One day, a big dog", "Lily and Tom went to the park", "The cat"}) {
    Request r;
    r.prompt = tok.encode(text, true, false);
    r.max_tokens = 16;
    r.sampling.temperature = 0;
    r.stop_ids = stop_ids;
    good.push_back(r);
  }
  good[1].sampling.temperature = 0.9f;
  good[1].sampling.seed = 7;
  good[1].sampling.repetition_penalty = 1.3f;
  good[1].sampling.frequency_penalty = 0.5f;
  good[2].logprobs = 2;
  good[3].sampling.logit_bias[13] = 5.0f;

  // Bad requests: [BOS, marker, ...] prompts whose rows FaultyRunner alters.
  const int32_t bos = tok.bos_id();
  std::vector<Request> bad(3);
  bad[0].prompt = {bos, 401, 402, 403};  // +inf from the model, greedy (no processor at all)
  bad[0].sampling.temperature = 0;
  bad[1].prompt = {bos, 411, 412};  // NaN from the model, sampled with logprobs
  bad[1].sampling.temperature = 0.8f;
  bad[1].logprobs = 1;
  bad[2].prompt = {bos, 421, 422, 423, 421};  // finite logits that the repetition penalty overflows
  bad[2].sampling.repetition_penalty = 0.01f;
  const std::map<int32_t, Fault> faults = {{401, Fault::Inf}, {411, Fault::NaN}, {421, Fault::Huge}};

  EngineConfig c;
  c.n_kv_blocks = 128;
  auto clean_runner = std::make_unique<FaultyRunner>(*l.model, c.n_kv_blocks, faults);
  const FaultyRunner* untouched = clean_runner.get();
  Engine clean(*l.model, &tok, c, std::move(clean_runner));
  const std::vector<Result> want = run(clean, good);
  EXPECT_EQ(untouched->n_faulted, 0);
  for (const Result& r : want) ASSERT_TRUE(r.reason == "stop" || r.reason == "length") << r.reason << " " << r.error;

  // The bad requests interleaved with the good ones, in one engine.
  std::vector<Request> mixed = {good[0], bad[0], good[1], bad[1], good[2], bad[2], good[3]};
  auto runner = std::make_unique<FaultyRunner>(*l.model, c.n_kv_blocks, faults);
  FaultyRunner* faulty = runner.get();
  Engine e(*l.model, &tok, c, std::move(runner));
  const std::vector<Result> got = run(e, mixed);
  ASSERT_FALSE(HasFailure());
  EXPECT_EQ(faulty->n_faulted, 3);
  for (size_t i : {1u, 3u, 5u}) {
    SCOPED_TRACE("bad request " + std::to_string(i));
    EXPECT_EQ(got[i].reason, "error");
    EXPECT_TRUE(got[i].ids.empty());
    EXPECT_NE(got[i].error.find("non-finite"), std::string::npos) << got[i].error;
  }
  EXPECT_NE(got[1].error.find("the model produced"), std::string::npos) << got[1].error;
  EXPECT_NE(got[5].error.find("logit_bias and penalties"), std::string::npos) << got[5].error;
  const size_t good_at[] = {0, 2, 4, 6};
  for (size_t k = 0; k < 4; ++k) {
    SCOPED_TRACE("good request " + std::to_string(k));
    EXPECT_EQ(got[good_at[k]].ids, want[k].ids);
    EXPECT_EQ(got[good_at[k]].text, want[k].text);
    EXPECT_EQ(got[good_at[k]].reason, want[k].reason);
  }
  EXPECT_EQ(e.stats().kv_blocks_used, 0);

  // The engine goes on: a later request runs as it did before.
  const std::vector<Result> again = run(e, {good[0]});
  EXPECT_EQ(again.at(0).ids, want[0].ids);
  EXPECT_EQ(e.stats().kv_blocks_used, 0);
}
