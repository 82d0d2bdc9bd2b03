// BeamSearch's bookkeeping (src/engine/beam_search.h) on hand-made distributions whose expected
// beams and scores are worked out below from transformers' rules (GenerationMixin._beam_search,
// 5.25: 2B candidates, hypotheses only from the best B, score = sum / generated ** length_penalty,
// the early-stop check on the best live beam). The engine's beams against transformers itself on
// a real model: tests/e2e/test_beam_search.cpp.
#include <gtest/gtest.h>

#include <cmath>

#include "core/error.h"
#include "engine/beam_search.h"

using namespace kestrel;

namespace {

constexpr int32_t kEos = 0;

// The row of a distribution given as probabilities (logits = log p, so log-softmax = log p).
BeamRow row_of(const std::vector<double>& p, size_t k) {
  std::vector<float> logits;
  for (const double x : p) logits.push_back(x > 0 ? static_cast<float>(std::log(x)) : -INFINITY);
  BeamRow r;
  EXPECT_TRUE(top_logprobs(logits, k, r));
  return r;
}

BeamSearchParams params(int32_t width, double lp, EarlyStopping es) {
  BeamSearchParams p;
  p.beam_width = width;
  p.n_best = width;
  p.length_penalty = lp;
  p.early_stopping = es;
  return p;
}

}  // namespace

TEST(BeamSearch, TopLogprobsNormalisesAndOrders) {
  BeamRow r;
  ASSERT_TRUE(top_logprobs(std::vector<float>{1.0f, 3.0f, 2.0f, 3.0f}, 3, r));
  const double lse = std::log(std::exp(1.0) + 2 * std::exp(3.0) + std::exp(2.0));
  ASSERT_EQ(r.tokens, (std::vector<int32_t>{1, 3, 2}));  // a tie: lower id first
  EXPECT_NEAR(r.logprobs[0], 3.0 - lse, 1e-6);
  EXPECT_NEAR(r.logprobs[2], 2.0 - lse, 1e-6);
  EXPECT_FALSE(top_logprobs(std::vector<float>{1.0f, NAN}, 1, r));
  EXPECT_FALSE(top_logprobs(std::vector<float>{-INFINITY, -INFINITY}, 1, r));
}

// B = 1: the EOS (p 0.6) is the best candidate and becomes a hypothesis of score log 0.6 / 1. The
// live beam (token 1, sum log 0.4) cannot beat it at its current length (false), but can at
// max_new_tokens 10 with a positive length penalty ("never"): log 0.4 / 10 > log 0.6.
TEST(BeamSearch, EarlyStoppingFalseAndNever) {
  const std::vector<double> p = {0.6, 0.4, 0.0};
  BeamSearch heuristic(params(1, 1.0, EarlyStopping::Heuristic), {kEos}, 10);
  const BeamRow r = row_of(p, heuristic.candidates_per_beam());
  EXPECT_TRUE(heuristic.step(std::vector<BeamRow>{r}).empty());
  ASSERT_TRUE(heuristic.done());
  const auto res = heuristic.results();
  ASSERT_EQ(res.size(), 1u);
  EXPECT_EQ(res[0].tokens, (std::vector<int32_t>{kEos}));
  EXPECT_NEAR(res[0].score, std::log(0.6), 1e-6);
  EXPECT_TRUE(res[0].stopped);

  BeamSearch never(params(1, 1.0, EarlyStopping::Never), {kEos}, 10);
  const auto next = never.step(std::vector<BeamRow>{r});
  ASSERT_FALSE(never.done());
  ASSERT_EQ(next.size(), 1u);
  EXPECT_EQ(next[0].token, 1);
  // Then certainty of token 2 until the limit: 10 tokens of sum log 0.4, score log 0.4 / 10.
  for (int i = 1; i < 10; ++i) {
    ASSERT_FALSE(never.done()) << i;
    never.step(std::vector<BeamRow>{row_of({0.0, 0.0, 1.0}, never.candidates_per_beam())});
  }
  ASSERT_TRUE(never.done());
  const auto best = never.results();
  EXPECT_EQ(best[0].tokens.size(), 10u);
  EXPECT_FALSE(best[0].stopped);
  EXPECT_NEAR(best[0].sum_logprobs, std::log(0.4), 1e-6);
  EXPECT_NEAR(best[0].score, std::log(0.4) / 10, 1e-6);
}

// B = 2 from one beam: the two best tokens both continue it (a fork). Step 2: beam 0 (token 1, sum
// log .5) gives EOS .9 -> sum log .45, ranked first: a hypothesis with length 2 and penalty 2:
// log .45 / 4. The next beams are the best two that do not stop.
TEST(BeamSearch, ForksAndHypothesesFromTheBestB) {
  BeamSearch s(params(2, 2.0, EarlyStopping::Heuristic), {kEos}, 8);
  const size_t k = s.candidates_per_beam();
  EXPECT_EQ(k, 4u);
  auto next = s.step(std::vector<BeamRow>{row_of({0.0, 0.5, 0.3, 0.2}, k)});
  ASSERT_EQ(next.size(), 2u);
  EXPECT_EQ(next[0].parent, 0);
  EXPECT_EQ(next[0].token, 1);
  EXPECT_EQ(next[1].parent, 0);
  EXPECT_EQ(next[1].token, 2);
  // Beam 0 (sum log .5): EOS .9, token 3 .1. Beam 1 (sum log .3): token 1 .7, token 2 .3.
  next = s.step(std::vector<BeamRow>{row_of({0.9, 0.0, 0.0, 0.1}, k), row_of({0.0, 0.7, 0.3, 0.0}, k)});
  ASSERT_EQ(next.size(), 2u);
  EXPECT_EQ(next[0].parent, 1);  // .3 x .7 = .21
  EXPECT_EQ(next[0].token, 1);
  EXPECT_EQ(next[1].parent, 1);  // .3 x .3 = .09 (beam 0's token 3: .05)
  EXPECT_EQ(next[1].token, 2);
  EXPECT_EQ(s.tokens(0), (std::vector<int32_t>{2, 1}));
  EXPECT_NEAR(s.sum_logprobs(1), std::log(0.09), 1e-6);
  ASSERT_FALSE(s.done());  // one hypothesis kept of two
  // Step 3: both beams certain of EOS; the best B candidates are both EOS: .21 and .09, length 3.
  next = s.step(std::vector<BeamRow>{row_of({1.0, 0.0, 0.0, 0.0}, k), row_of({1.0, 0.0, 0.0, 0.0}, k)});
  ASSERT_TRUE(s.done());
  const auto res = s.results();
  ASSERT_EQ(res.size(), 2u);
  // log .21 / 9 = -0.1734 beats log .45 / 4 = -0.1996, which beats log .09 / 9 = -0.2675.
  EXPECT_EQ(res[0].tokens, (std::vector<int32_t>{2, 1, kEos}));
  EXPECT_NEAR(res[0].score, std::log(0.21) / 9, 1e-6);
  EXPECT_EQ(res[1].tokens, (std::vector<int32_t>{1, kEos}));
  EXPECT_NEAR(res[1].score, std::log(0.45) / 4, 1e-6);
}

// early_stopping true: done as soon as B hypotheses are kept, whatever the live beams could reach.
TEST(BeamSearch, EarlyStoppingTrueEndsWithBHypotheses) {
  BeamSearch s(params(2, 1.0, EarlyStopping::Done), {kEos}, 8);
  const size_t k = s.candidates_per_beam();
  s.step(std::vector<BeamRow>{row_of({0.0, 0.5, 0.5, 0.0}, k)});
  // Both beams: EOS .6 (the best B candidates are both EOS), token 3 .4 would keep them live.
  s.step(std::vector<BeamRow>{row_of({0.6, 0.0, 0.0, 0.4}, k), row_of({0.6, 0.0, 0.0, 0.4}, k)});
  ASSERT_TRUE(s.done());
  ASSERT_EQ(s.results().size(), 2u);
  EXPECT_NEAR(s.results()[0].score, std::log(0.3) / 2, 1e-6);
  EXPECT_NEAR(s.results()[1].score, std::log(0.3) / 2, 1e-6);
}

TEST(BeamSearch, ParamsAreChecked) {
  EXPECT_THROW(params(0, 1.0, EarlyStopping::Done).validate(), Error);
  BeamSearchParams p = params(2, 1.0, EarlyStopping::Done);
  p.n_best = 3;
  EXPECT_THROW(p.validate(), Error);
  p.n_best = 2;
  p.length_penalty = NAN;
  EXPECT_THROW(p.validate(), Error);
  EXPECT_EQ(parse_early_stopping("never"), EarlyStopping::Never);
  EXPECT_THROW(parse_early_stopping("sometimes"), Error);
}
