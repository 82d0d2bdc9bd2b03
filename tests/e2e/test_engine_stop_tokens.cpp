// vLLM's min_tokens and stop_token_ids on the engine: a stop id ends generation with its text left
// out; until min_tokens tokens are generated no stop id is sampled (its logits are masked, on the
// host and on a backend that samples on the device alike) and no stop string ends generation.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "engine/engine.h"
#include "sampling_runner.h"
#include "test_util.h"

using namespace kestrel;

namespace {

using Loaded = test::LoadedModel;
using test::stories_path;

struct Outcome {
  std::vector<int32_t> ids;
  std::string text;
  std::string reason;
};

Outcome run(Engine& e, const Request& r) {
  const RequestId id = e.add_request(r);
  Outcome out;
  while (e.has_unfinished())
    for (const RequestOutput& o : e.step()) {
      EXPECT_EQ(o.id, id);
      out.ids.insert(out.ids.end(), o.new_token_ids.begin(), o.new_token_ids.end());
      out.text += o.text_delta;
      if (o.finished) out.reason = o.finish_reason;
    }
  return out;
}

Request greedy(const Loaded& l, int64_t max_tokens) {
  Request r;
  r.prompt = l.tokenizer->encode("Once upon a time", true, false);
  r.max_tokens = max_tokens;
  r.sampling.temperature = 0;
  return r;
}

// The first index i >= 1 whose token does not occur before it (so a stop on it ends there).
size_t fresh_token_at(const std::vector<int32_t>& ids, size_t from) {
  for (size_t i = from; i < ids.size(); ++i)
    if (std::find(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(i), ids[i]) == ids.begin() + static_cast<std::ptrdiff_t>(i))
      return i;
  return ids.size();
}

std::unique_ptr<test::SamplingRunner> device_sampling_runner(const LlamaModel& model, int32_t n_blocks) {
  RunnerOptions o;
  o.n_kv_blocks = n_blocks;
  return std::make_unique<test::SamplingRunner>(make_cpu_model_runner(model, o), /*on_device=*/true);
}

}  // namespace

// A stop id ends generation at its first occurrence, reported in the ids but not in the text.
TEST(EngineStopTokens, AStopIdEndsGenerationWithoutItsText) {
  KESTREL_REQUIRE_FILE(stories_path());
  const Loaded l = test::load_model(stories_path());
  Engine e(*l.model, l.tokenizer.get(), EngineConfig{});
  const Outcome free_run = run(e, greedy(l, 30));
  ASSERT_EQ(free_run.ids.size(), 30u);
  const size_t k = fresh_token_at(free_run.ids, 3);
  ASSERT_LT(k, free_run.ids.size());
  const int32_t stop = free_run.ids[k];
  ASSERT_FALSE(l.tokenizer->is_special(stop));  // a token with text of its own
  ASSERT_FALSE(l.tokenizer->token_to_piece(stop).empty());

  Request r = greedy(l, 30);
  r.stop_ids = {stop};
  const Outcome stopped = run(e, r);
  EXPECT_EQ(stopped.reason, "stop");
  EXPECT_EQ(stopped.ids, std::vector<int32_t>(free_run.ids.begin(), free_run.ids.begin() + static_cast<std::ptrdiff_t>(k + 1)));
  const std::vector<int32_t> before(free_run.ids.begin(), free_run.ids.begin() + static_cast<std::ptrdiff_t>(k));
  EXPECT_EQ(stopped.text, l.tokenizer->decode(before, true, true));
  EXPECT_EQ(stopped.text, run(e, greedy(l, static_cast<int64_t>(k))).text);
}

// min_tokens masks the stop ids until that many tokens are generated: the first min_tokens tokens
// are greedy under the stop id's logit at -inf (the same as a -100 logit bias, which no logit of
// this model overcomes), and the stop id may end generation only after them. A backend that
// samples on the device gets the same tokens through its token masks.
TEST(EngineStopTokens, MinTokensHoldsStopIdsBack) {
  KESTREL_REQUIRE_FILE(stories_path());
  const Loaded l = test::load_model(stories_path());
  EngineConfig c;
  c.n_kv_blocks = 256;
  Engine e(*l.model, l.tokenizer.get(), c);
  const Outcome free_run = run(e, greedy(l, 30));
  const size_t k = fresh_token_at(free_run.ids, 1);
  ASSERT_LT(k, 6u);
  const int32_t stop = free_run.ids[k];
  constexpr int64_t kMin = 10;

  Request r = greedy(l, 40);
  r.stop_ids = {stop};
  r.min_tokens = kMin;
  const Outcome held = run(e, r);
  ASSERT_GE(held.ids.size(), static_cast<size_t>(kMin));
  for (int64_t i = 0; i < kMin; ++i) EXPECT_NE(held.ids[static_cast<size_t>(i)], stop) << "token " << i;
  if (held.reason == "stop") {
    EXPECT_EQ(held.ids.back(), stop);
    EXPECT_GT(held.ids.size(), static_cast<size_t>(kMin));
  } else {
    EXPECT_EQ(held.reason, "length");
    EXPECT_EQ(held.ids.size(), 40u);
  }
  // Without min_tokens the same request stops at k.
  Request plain = r;
  plain.min_tokens = 0;
  EXPECT_EQ(run(e, plain).ids.size(), k + 1);

  Request biased = greedy(l, kMin);
  biased.sampling.logit_bias[stop] = -100.0f;
  const Outcome reference = run(e, biased);
  EXPECT_EQ(std::vector<int32_t>(held.ids.begin(), held.ids.begin() + kMin), reference.ids);

  auto runner = device_sampling_runner(*l.model, c.n_kv_blocks);
  test::SamplingRunner* dev = runner.get();
  Engine device(*l.model, l.tokenizer.get(), c, std::move(runner));
  EXPECT_EQ(run(device, r).ids, held.ids);
  EXPECT_EQ(dev->host_calls, 0);
  EXPECT_EQ(dev->masked_rows, kMin);  // the rows after min_tokens sample unmasked
}

// Stop ids that cover the whole vocabulary leave min_tokens nothing to sample: the ban yields and
// the first token stops the request (no error). An out-of-range stop id, a negative min_tokens,
// one above max_tokens and one with beam search are errors.
TEST(EngineStopTokens, MinTokensEdges) {
  KESTREL_REQUIRE_FILE(stories_path());
  const Loaded l = test::load_model(stories_path());
  Engine e(*l.model, l.tokenizer.get(), EngineConfig{});
  const auto n_vocab = static_cast<int32_t>(l.model->hparams().n_vocab);
  Request all = greedy(l, 10);
  for (int32_t id = 0; id < n_vocab; ++id) all.stop_ids.push_back(id);
  all.min_tokens = 5;
  const Outcome stopped = run(e, all);
  EXPECT_EQ(stopped.reason, "stop");
  EXPECT_EQ(stopped.ids.size(), 1u);

  Request bad = greedy(l, 10);
  bad.stop_ids = {n_vocab};
  EXPECT_THROW(e.add_request(bad), Error);
  bad.stop_ids = {-1};
  EXPECT_THROW(e.add_request(bad), Error);
  bad.stop_ids = {};
  bad.min_tokens = -1;
  EXPECT_THROW(e.add_request(bad), Error);
  bad.min_tokens = 11;
  EXPECT_THROW(e.add_request(bad), Error);
  bad.min_tokens = 10;
  bad.beam.beam_width = 2;
  bad.beam.n_best = 1;
  EXPECT_THROW(e.add_request(bad), Error);
  EXPECT_FALSE(e.has_unfinished());
  // max_tokens < 0 (until the context ends) takes any min_tokens.
  Request open = greedy(l, -1);
  open.min_tokens = 3;
  open.stop_ids = test::eog_ids(*l.tokenizer);
  EngineConfig small;
  small.max_model_len = 16;
  Engine e2(*l.model, l.tokenizer.get(), small);
  EXPECT_GE(run(e2, open).ids.size(), 3u);
}

// A stop string counts only once min_tokens tokens are generated: the text runs on past an earlier
// match and is cut at the first match that a token from then on completes.
TEST(EngineStopTokens, MinTokensDefersStopStrings) {
  KESTREL_REQUIRE_FILE(stories_path());
  const Loaded l = test::load_model(stories_path());
  Engine e(*l.model, l.tokenizer.get(), EngineConfig{});
  const Outcome free_run = run(e, greedy(l, 60));
  ASSERT_EQ(free_run.ids.size(), 60u);
  const std::string full = l.tokenizer->decode(free_run.ids, true, true);
  ASSERT_EQ(free_run.text, full);
  constexpr int64_t kMin = 12;
  // The text of the first kMin - 1 tokens: a match must end past it to count.
  const size_t early_end =
      l.tokenizer->decode(std::vector<int32_t>(free_run.ids.begin(), free_run.ids.begin() + kMin - 1), true, true).size();
  std::string stop;
  for (const char* candidate : {" the ", ".", " was ", ",", " a ", "e"}) {
    const std::string s = candidate;
    const size_t first = full.find(s);
    if (first != std::string::npos && first + s.size() <= early_end &&
        full.find(s, early_end - s.size() + 1) != std::string::npos) {
      stop = s;
      break;
    }
  }
  ASSERT_FALSE(stop.empty()) << "no candidate occurs both early and late in: " << full;

  Request r = greedy(l, 60);
  r.stop = {stop};
  const Outcome early = run(e, r);
  EXPECT_EQ(early.reason, "stop");
  EXPECT_EQ(early.text, full.substr(0, full.find(stop)));

  r.min_tokens = kMin;
  const Outcome held = run(e, r);
  EXPECT_EQ(held.reason, "stop");
  EXPECT_EQ(held.text, full.substr(0, full.find(stop, early_end - stop.size() + 1)));
  EXPECT_GE(held.ids.size(), static_cast<size_t>(kMin));
  EXPECT_EQ(held.ids, std::vector<int32_t>(free_run.ids.begin(), free_run.ids.begin() + static_cast<std::ptrdiff_t>(held.ids.size())));
}
