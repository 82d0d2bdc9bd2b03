// vLLM's allowed_token_ids and bad_words on the engine (token masks, on the host and on a backend
// that samples on the device alike), its output fields include_stop_str_in_output and
// skip_special_tokens, what a stop reports (RequestOutput::stop_string, stop_token), and min_tokens
// bounded by the context. Greedy runs of stories260K give the tokens each rule must change.
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
  std::vector<std::string> deltas;
  RequestOutput last;  // the finished output
};

Outcome run(Engine& e, const Request& r) {
  const RequestId id = e.add_request(r);
  Outcome out;
  while (e.has_unfinished())
    for (RequestOutput& o : e.step()) {
      EXPECT_EQ(o.id, id);
      out.ids.insert(out.ids.end(), o.new_token_ids.begin(), o.new_token_ids.end());
      out.text += o.text_delta;
      out.deltas.push_back(o.text_delta);
      if (o.finished) out.last = std::move(o);
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

std::unique_ptr<test::SamplingRunner> device_sampling_runner(const LlamaModel& model, int32_t n_blocks) {
  RunnerOptions o;
  o.n_kv_blocks = n_blocks;
  return std::make_unique<test::SamplingRunner>(make_cpu_model_runner(model, o), /*on_device=*/true);
}

// The first index >= from whose token does not occur before it.
size_t fresh_token_at(const std::vector<int32_t>& ids, size_t from) {
  for (size_t i = from; i < ids.size(); ++i)
    if (std::find(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(i), ids[i]) == ids.begin() + static_cast<std::ptrdiff_t>(i))
      return i;
  return ids.size();
}

}  // namespace

// allowed_token_ids: every sampled id is in the set, and the greedy choice among them is the one
// a -100 logit bias on every other id gives (no logit of this model overcomes it). The device
// path samples the same ids under its token masks, every row masked.
TEST(EngineTokenFilters, AllowedTokenIdsRestrictSampling) {
  KESTREL_REQUIRE_FILE(stories_path());
  const Loaded l = test::load_model(stories_path());
  EngineConfig c;
  c.n_kv_blocks = 256;
  Engine e(*l.model, l.tokenizer.get(), c);
  const Outcome free_run = run(e, greedy(l, 12));
  // The allowed set leaves the free run's first tokens out, so the outputs must differ.
  std::vector<int32_t> allowed;
  for (int32_t id = 3; static_cast<int32_t>(allowed.size()) < 40; ++id)
    if (std::find(free_run.ids.begin(), free_run.ids.begin() + 3, id) == free_run.ids.begin() + 3) allowed.push_back(id);
  Request r = greedy(l, 12);
  r.allowed_token_ids = allowed;
  const Outcome held = run(e, r);
  ASSERT_EQ(held.ids.size(), 12u);
  for (const int32_t id : held.ids) EXPECT_NE(std::find(allowed.begin(), allowed.end(), id), allowed.end()) << id;
  EXPECT_NE(held.ids, free_run.ids);

  Request biased = greedy(l, 12);
  const auto n_vocab = static_cast<int32_t>(l.model->hparams().n_vocab);
  for (int32_t id = 0; id < n_vocab; ++id)
    if (std::find(allowed.begin(), allowed.end(), id) == allowed.end()) biased.sampling.logit_bias[id] = -100.0f;
  EXPECT_EQ(run(e, biased).ids, held.ids);

  auto runner = device_sampling_runner(*l.model, c.n_kv_blocks);
  test::SamplingRunner* dev = runner.get();
  Engine device(*l.model, l.tokenizer.get(), c, std::move(runner));
  EXPECT_EQ(run(device, r).ids, held.ids);
  EXPECT_EQ(dev->host_calls, 0);
  EXPECT_EQ(dev->masked_rows, 12);
}

// bad_words (vLLM's apply_bad_words): a one-token word never appears where greedy decoding would
// put it; a two-token word's last token is banned only right after its first. The outputs equal
// the free run up to the banned position and differ there; host and device sampling agree.
TEST(EngineTokenFilters, BadWordsBanTheLastTokenAfterItsPrefix) {
  KESTREL_REQUIRE_FILE(stories_path());
  const Loaded l = test::load_model(stories_path());
  EngineConfig c;
  c.n_kv_blocks = 256;
  Engine e(*l.model, l.tokenizer.get(), c);
  const Outcome free_run = run(e, greedy(l, 30));
  ASSERT_EQ(free_run.ids.size(), 30u);
  const size_t k = fresh_token_at(free_run.ids, 2);
  ASSERT_LT(k, 30u);
  const auto prefix = [&](size_t n) {
    return std::vector<int32_t>(free_run.ids.begin(), free_run.ids.begin() + static_cast<std::ptrdiff_t>(n));
  };

  Request one = greedy(l, 30);
  one.bad_words = {{free_run.ids[k]}};
  const Outcome banned = run(e, one);
  EXPECT_EQ(std::count(banned.ids.begin(), banned.ids.end(), free_run.ids[k]), 0);
  EXPECT_EQ(prefix(k), std::vector<int32_t>(banned.ids.begin(), banned.ids.begin() + static_cast<std::ptrdiff_t>(k)));
  EXPECT_NE(banned.ids[k], free_run.ids[k]);

  // [ids[k-1], ids[k]]: greedy goes the same way until ids[k - 1], then must take another token.
  Request two = greedy(l, 30);
  two.bad_words = {{free_run.ids[k - 1], free_run.ids[k]}};
  const Outcome pair = run(e, two);
  EXPECT_EQ(prefix(k), std::vector<int32_t>(pair.ids.begin(), pair.ids.begin() + static_cast<std::ptrdiff_t>(k)));
  EXPECT_NE(pair.ids[k], free_run.ids[k]);
  for (size_t i = 1; i < pair.ids.size(); ++i)
    EXPECT_FALSE(pair.ids[i - 1] == free_run.ids[k - 1] && pair.ids[i] == free_run.ids[k]) << "at " << i;
  // A word whose first token the prompt ends with does not count (vLLM looks at the output only).
  Request from_prompt = greedy(l, 30);
  from_prompt.bad_words = {{from_prompt.prompt.back(), free_run.ids[0]}};
  EXPECT_EQ(run(e, from_prompt).ids.front(), free_run.ids[0]);

  auto runner = device_sampling_runner(*l.model, c.n_kv_blocks);
  Engine device(*l.model, l.tokenizer.get(), c, std::move(runner));
  EXPECT_EQ(run(device, one).ids, banned.ids);
  EXPECT_EQ(run(device, two).ids, pair.ids);
}

// Filters that leave no token end the request with an error marked as the request's (not NaN
// sampling, not a server error); bad ids, empty
// words and the filters with beam search are refused by add_request.
TEST(EngineTokenFilters, EdgesAndErrors) {
  KESTREL_REQUIRE_FILE(stories_path());
  const Loaded l = test::load_model(stories_path());
  Engine e(*l.model, l.tokenizer.get(), EngineConfig{});
  const auto n_vocab = static_cast<int32_t>(l.model->hparams().n_vocab);
  Request none = greedy(l, 5);
  none.allowed_token_ids = {7};
  none.bad_words = {{7}};
  const Outcome failed = run(e, none);
  EXPECT_EQ(failed.last.finish_reason, "error");
  EXPECT_NE(failed.last.error.find("no token may be sampled"), std::string::npos) << failed.last.error;
  EXPECT_TRUE(failed.last.error_from_request);  // the server answers it with a 400
  // allowed ids that are all stop ids: min_tokens yields, and the first token stops.
  Request only_stop = greedy(l, 5);
  only_stop.stop_ids = {7};
  only_stop.allowed_token_ids = {7};
  only_stop.min_tokens = 3;
  const Outcome stopped = run(e, only_stop);
  EXPECT_EQ(stopped.ids, (std::vector<int32_t>{7}));
  EXPECT_EQ(stopped.last.finish_reason, "stop");

  Request bad = greedy(l, 5);
  bad.allowed_token_ids = {n_vocab};
  EXPECT_THROW(e.add_request(bad), Error);
  bad.allowed_token_ids = {-1};
  EXPECT_THROW(e.add_request(bad), Error);
  bad.allowed_token_ids = {};
  bad.bad_words = {{}};
  EXPECT_THROW(e.add_request(bad), Error);
  bad.bad_words = {{3, n_vocab}};
  EXPECT_THROW(e.add_request(bad), Error);
  bad.bad_words = {{3}};
  bad.beam.beam_width = 2;
  bad.beam.n_best = 1;
  EXPECT_THROW(e.add_request(bad), Error);
  // min_tokens above what the context leaves after the prompt could never be met.
  EngineConfig small;
  small.max_model_len = 16;
  Engine e2(*l.model, l.tokenizer.get(), small);
  Request open = greedy(l, -1);
  open.min_tokens = 16 - static_cast<int64_t>(open.prompt.size()) + 1;
  EXPECT_THROW(e2.add_request(open), Error);
  open.min_tokens -= 1;
  open.stop_ids = test::eog_ids(*l.tokenizer);
  EXPECT_EQ(run(e2, open).ids.size(), static_cast<size_t>(open.min_tokens));
  EXPECT_FALSE(e.has_unfinished());
}

// include_stop_str_in_output: the text ends with the stop string, every delta goes out as it
// comes (nothing held back), and the stop string is reported. A stop id's text is kept too.
TEST(EngineTokenFilters, IncludeStopStringInOutput) {
  KESTREL_REQUIRE_FILE(stories_path());
  const Loaded l = test::load_model(stories_path());
  Engine e(*l.model, l.tokenizer.get(), EngineConfig{});
  const Outcome free_run = run(e, greedy(l, 40));
  const std::string& full = free_run.text;
  const std::string stop = full.find(" was ") != std::string::npos ? " was " : full.substr(full.size() / 2, 3);
  const size_t at = full.find(stop);
  ASSERT_NE(at, std::string::npos);

  Request r = greedy(l, 40);
  r.stop = {stop};
  const Outcome cut = run(e, r);
  EXPECT_EQ(cut.text, full.substr(0, at));
  EXPECT_EQ(cut.last.finish_reason, "stop");
  EXPECT_EQ(cut.last.stop_string, stop);
  EXPECT_EQ(cut.last.stop_token, -1);
  r.include_stop_str_in_output = true;
  const Outcome kept = run(e, r);
  EXPECT_EQ(kept.text, full.substr(0, at + stop.size()));
  EXPECT_EQ(kept.last.stop_string, stop);
  EXPECT_EQ(kept.ids, cut.ids);
  // Streamed as decoded: each delta before the last is its token's whole text.
  for (size_t i = 0; i + 1 < kept.deltas.size(); ++i)
    EXPECT_EQ(kept.deltas[i], l.tokenizer->decode(std::vector<int32_t>{kept.ids[i]}, true, true)) << i;

  const size_t k = fresh_token_at(free_run.ids, 3);
  Request by_id = greedy(l, 40);
  by_id.stop_ids = {free_run.ids[k]};
  const Outcome id_cut = run(e, by_id);
  EXPECT_EQ(id_cut.last.stop_token, free_run.ids[k]);
  EXPECT_EQ(id_cut.last.stop_string, "");
  by_id.include_stop_str_in_output = true;
  const std::vector<int32_t> through_k(free_run.ids.begin(), free_run.ids.begin() + static_cast<std::ptrdiff_t>(k + 1));
  EXPECT_EQ(run(e, by_id).text, l.tokenizer->decode(through_k, true, true));
  EXPECT_NE(id_cut.text, l.tokenizer->decode(through_k, true, true));
}

// skip_special_tokens false: a special token's text is in the output (forced here through
// allowed_token_ids, as the model would rarely sample BOS); true (the default) leaves it out.
TEST(EngineTokenFilters, SkipSpecialTokens) {
  KESTREL_REQUIRE_FILE(stories_path());
  const Loaded l = test::load_model(stories_path());
  Engine e(*l.model, l.tokenizer.get(), EngineConfig{});
  const int32_t bos = l.tokenizer->bos_id();
  ASSERT_TRUE(l.tokenizer->is_special(bos));
  const std::string bos_text = l.tokenizer->token_to_piece(bos);
  ASSERT_FALSE(bos_text.empty());
  Request r = greedy(l, 3);
  r.allowed_token_ids = {bos};
  const Outcome skipped = run(e, r);
  EXPECT_EQ(skipped.ids, (std::vector<int32_t>{bos, bos, bos}));
  EXPECT_EQ(skipped.text, "");
  r.skip_special_tokens = false;
  EXPECT_EQ(run(e, r).text, bos_text + bos_text + bos_text);
  // With the end-of-sequence id ending the output: its text only with include_stop_str_in_output.
  const int32_t eos = l.tokenizer->eos_id();
  Request end = greedy(l, 3);
  end.allowed_token_ids = {eos};
  end.stop_ids = {eos};
  end.skip_special_tokens = false;
  EXPECT_EQ(run(e, end).text, "");
  end.include_stop_str_in_output = true;
  EXPECT_EQ(run(e, end).text, l.tokenizer->token_to_piece(eos));
}
