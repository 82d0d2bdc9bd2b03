// Sampling: every expected value is worked out by hand in the comment next to it.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend/sampling_reference.h"  // the CUDA sampling test's reference, checked below
#include "core/error.h"
#include "sampling/candidate_list.h"
#include "sampling/logits_processors.h"
#include "sampling/logprobs.h"
#include "sampling/rng.h"
#include "sampling/sampler.h"
#include "sampling/sampling_params.h"

using namespace kestrel;

namespace {

// Logits whose softmax is exactly `probs` (up to float rounding): log p.
std::vector<float> logits_of(const std::vector<double>& probs) {
  std::vector<float> logits;
  for (double p : probs) logits.push_back(static_cast<float>(std::log(p)));
  return logits;
}

CandidateList list_of(const std::vector<float>& logits) {
  CandidateList list;
  list.assign(logits);
  return list;
}

std::vector<int32_t> ids_of(const CandidateList& list) {
  std::vector<int32_t> ids;
  for (const TokenCandidate& c : list.items()) ids.push_back(c.id);
  return ids;
}

float logit_of(const CandidateList& list, int32_t id) {
  for (const TokenCandidate& c : list.items()) {
    if (c.id == id) return c.logit;
  }
  ADD_FAILURE() << "id " << id << " not in the list";
  return NAN;
}

// Counts `n` draws of `sampler` on fixed logits and checks each token's frequency against
// `expected` within 3 standard errors of a binomial proportion: |f - p| <= 3 sqrt(p (1 - p) / n).
// A token with p = 0 must never be drawn. The seed is fixed, so the outcome is deterministic; the
// bound says a correct sampler passes for all but about 0.3% of seeds per token.
void expect_frequencies(Sampler& sampler, const std::vector<float>& logits,
                        const std::vector<double>& expected, int n = 20000) {
  std::vector<int> counts(logits.size(), 0);
  for (int i = 0; i < n; ++i) ++counts[sampler.sample(logits, {})];
  for (size_t id = 0; id < expected.size(); ++id) {
    const double p = expected[id];
    const double f = static_cast<double>(counts[id]) / n;
    if (p == 0.0) {
      EXPECT_EQ(counts[id], 0) << "token " << id;
    } else {
      EXPECT_NEAR(f, p, 3.0 * std::sqrt(p * (1.0 - p) / n)) << "token " << id;
    }
  }
}

}  // namespace

// ---- SamplingParams::validate ------------------------------------------------------------------

TEST(SamplingParams, DefaultsAreValid) { EXPECT_NO_THROW(SamplingParams{}.validate()); }

TEST(SamplingParams, ValidateNamesTheBadParameter) {
  auto expect_error = [](auto edit, const std::string& field) {
    SamplingParams params;
    edit(params);
    try {
      params.validate();
      ADD_FAILURE() << "no error for " << field;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
    }
  };
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  expect_error([](SamplingParams& p) { p.temperature = -0.1f; }, "temperature");
  expect_error([&](SamplingParams& p) { p.temperature = nan; }, "temperature");
  expect_error([&](SamplingParams& p) { p.temperature = inf; }, "temperature");
  expect_error([](SamplingParams& p) { p.top_k = -1; }, "top_k");
  expect_error([](SamplingParams& p) { p.top_p = 0.0f; }, "top_p");
  expect_error([](SamplingParams& p) { p.top_p = 1.5f; }, "top_p");
  expect_error([&](SamplingParams& p) { p.top_p = nan; }, "top_p");
  expect_error([](SamplingParams& p) { p.min_p = -0.1f; }, "min_p");
  expect_error([](SamplingParams& p) { p.min_p = 1.01f; }, "min_p");
  expect_error([&](SamplingParams& p) { p.min_p = nan; }, "min_p");
  expect_error([](SamplingParams& p) { p.repetition_penalty = 0.0f; }, "repetition_penalty");
  expect_error([](SamplingParams& p) { p.repetition_penalty = -1.0f; }, "repetition_penalty");
  expect_error([&](SamplingParams& p) { p.repetition_penalty = inf; }, "repetition_penalty");
  expect_error([](SamplingParams& p) { p.repeat_last_n = -2; }, "repeat_last_n");
  expect_error([&](SamplingParams& p) { p.presence_penalty = nan; }, "presence_penalty");
  expect_error([&](SamplingParams& p) { p.frequency_penalty = -inf; }, "frequency_penalty");
  expect_error([](SamplingParams& p) { p.logit_bias[-3] = 1.0f; }, "logit_bias");
  expect_error([&](SamplingParams& p) { p.logit_bias[7] = nan; }, "logit_bias[7]");
}

TEST(SamplingParams, EdgesOfTheRangesAreValid) {
  SamplingParams params;
  params.temperature = 0.0f;
  params.top_p = 1.0f;
  params.min_p = 1.0f;
  params.repeat_last_n = -1;
  params.presence_penalty = -2.0f;  // OpenAI allows negative penalties (encourage repeats)
  params.frequency_penalty = 2.0f;
  params.repetition_penalty = 0.01f;
  params.logit_bias[3] = -100.0f;
  params.logit_bias[4] = 100.0f;
  EXPECT_NO_THROW(params.validate());
  params.temperature = 2.0f;
  params.repetition_penalty = 100.0f;
  EXPECT_NO_THROW(params.validate());
}

// Every numeric field is bounded, so that no accepted value can turn a model's logits into inf or
// NaN: repetition_penalty 1e-38 (accepted once, as only > 0 was checked) divided logits into inf.
TEST(SamplingParams, EveryNumericFieldIsBounded) {
  const auto field_of = [](auto edit) -> std::string {
    SamplingParams p;
    edit(p);
    try {
      p.validate();
    } catch (const SamplingParamError& e) {
      return e.field() + (e.token() >= 0 ? "[" + std::to_string(e.token()) + "]" : "") + ": " + e.rule();
    }
    return "<valid>";
  };
  EXPECT_EQ(field_of([](SamplingParams& p) { p.repetition_penalty = 1e-38f; }),
            "repetition_penalty: must be in [0.01, 100] (1 turns it off)");
  EXPECT_EQ(field_of([](SamplingParams& p) { p.repetition_penalty = 0.0099f; }),
            "repetition_penalty: must be in [0.01, 100] (1 turns it off)");
  EXPECT_EQ(field_of([](SamplingParams& p) { p.repetition_penalty = 101.0f; }),
            "repetition_penalty: must be in [0.01, 100] (1 turns it off)");
  EXPECT_EQ(field_of([](SamplingParams& p) { p.temperature = 2.01f; }), "temperature: must be in [0, 2] (0 = greedy)");
  EXPECT_EQ(field_of([](SamplingParams& p) { p.presence_penalty = 2.5f; }), "presence_penalty: must be in [-2, 2]");
  EXPECT_EQ(field_of([](SamplingParams& p) { p.frequency_penalty = -3e38f; }), "frequency_penalty: must be in [-2, 2]");
  EXPECT_EQ(field_of([](SamplingParams& p) { p.logit_bias[9] = 100.5f; }), "logit_bias[9]: must be in [-100, 100]");
  EXPECT_EQ(field_of([](SamplingParams& p) { p.logit_bias[9] = -1e30f; }), "logit_bias[9]: must be in [-100, 100]");
}

TEST(SamplingSampler, ConstructorChecksBiasIdsAgainstTheVocabulary) {
  SamplingParams params;
  params.logit_bias[4] = 1.0f;
  EXPECT_THROW(Sampler(params, 4), Error);  // ids run 0..3
  EXPECT_NO_THROW(Sampler(params, 5));
  params.top_p = 2.0f;
  EXPECT_THROW(Sampler(params, 5), Error);
}

// ---- Rng --------------------------------------------------------------------------------------

TEST(SamplingRng, SplitMix64FirstOutput) {
  // State 0 + 0x9e3779b97f4a7c15, then the three mixing steps, is the widely published first
  // SplitMix64 output for seed 0.
  uint64_t state = 0;
  EXPECT_EQ(splitmix64_next(&state), 0xe220a8397b1dcdafULL);
}

TEST(SamplingRng, XoshiroStepsByHand) {
  // s = {1, 2, 3, 4}.
  // 1st: result = rotl(s1 * 5, 7) * 9 = rotl(10, 7) * 9 = 1280 * 9 = 11520.
  //      Then t = 2 << 17 = 262144; s2 = 3^1 = 2; s3 = 4^2 = 6; s1 = 2^2 = 0; s0 = 1^6 = 7;
  //      s2 = 2^262144 = 262146; s3 = rotl(6, 45).
  // 2nd: result = rotl(0 * 5, 7) * 9 = 0.
  //      Then t = 0; s2 = 262146^7 = 262149; s3 = rotl(6,45); s1 = 0^262149 = 262149; ...
  // 3rd: result = rotl(262149 * 5, 7) * 9 = 1310745 * 128 * 9 = 1509978240.
  Rng rng = Rng::from_state({1, 2, 3, 4});
  EXPECT_EQ(rng.next_u64(), 11520u);
  EXPECT_EQ(rng.next_u64(), 0u);
  EXPECT_EQ(rng.next_u64(), 1509978240u);
}

TEST(SamplingRng, DoublesAreIn01AndMultiplesOf2ToTheMinus53) {
  Rng rng(123);
  double sum = 0.0;
  for (int i = 0; i < 10000; ++i) {
    const double u = rng.next_double();
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
    EXPECT_EQ(std::ldexp(u, 53), std::floor(std::ldexp(u, 53)));
    sum += u;
  }
  // Mean of U[0,1) is 0.5 with standard error sqrt(1/12 / 10000) = 0.00289; 3 SE = 0.0087.
  EXPECT_NEAR(sum / 10000, 0.5, 0.0087);
}

TEST(SamplingRng, SameSeedSameStreamDifferentSeedDifferentStream) {
  Rng a(42), b(42), c(43);
  int n_diff = 0;
  for (int i = 0; i < 100; ++i) {
    const uint64_t x = a.next_u64();
    EXPECT_EQ(x, b.next_u64());
    n_diff += x != c.next_u64();
  }
  EXPECT_EQ(n_diff, 100);
}

// ---- Candidate list and processors ------------------------------------------------------------

TEST(SamplingTopK, KeepsTheTwoBestWithRenormalisedProbs) {
  // logits [1, 2, 3, 4], top_k = 2 keeps ids {3, 2} (logits 4 and 3), in rank order.
  // softmax over them: p3 = e^4 / (e^3 + e^4) = 1 / (1 + e^-1) = 0.7310585786,
  //                    p2 = e^3 / (e^3 + e^4) = 1 / (1 + e)    = 0.2689414214.
  CandidateList list = list_of({1, 2, 3, 4});
  TopK(2).apply(list, {});
  EXPECT_EQ(ids_of(list), (std::vector<int32_t>{3, 2}));
  list.softmax();
  EXPECT_NEAR(list[0].prob, 0.7310585786, 1e-6);
  EXPECT_NEAR(list[1].prob, 0.2689414214, 1e-6);
}

TEST(SamplingTopK, TiesGoToTheLowerId) {
  // logits [1, 3, 3, 2, 3]: three tokens share the top logit; k = 2 keeps ids 1 and 2.
  CandidateList list = list_of({1, 3, 3, 2, 3});
  TopK(2).apply(list, {});
  EXPECT_EQ(ids_of(list), (std::vector<int32_t>{1, 2}));
}

TEST(SamplingTopK, LargeVocabularyMatchesAFullSort) {
  // A 49152-wide vocabulary (SmolLM2's). Small k takes the heap path of keep_top, large k the
  // nth_element path; both must agree with a full stable sort by (logit desc, id asc). Logits
  // are multiples of 1/8 in [0, 25), so about 246 tokens share each value and ties decide.
  std::mt19937 gen(5);  // only to make test data; results do not depend on its distribution
  std::vector<float> logits(49152);
  for (float& l : logits) l = static_cast<float>(gen() % 200) / 8.0f;
  std::vector<int32_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
  for (int32_t k : {1, 40, 3000, 10000}) {
    CandidateList list = list_of(logits);
    TopK(k).apply(list, {});
    EXPECT_EQ(ids_of(list), std::vector<int32_t>(order.begin(), order.begin() + k)) << "k " << k;
    EXPECT_TRUE(list.sorted());
  }
}

TEST(SamplingMinP, KeepsATopKListSorted) {
  // [1, 2, 3, 4], top_k = 3 -> ids [3, 2, 1] sorted. min_p = 0.3: threshold 4 + ln 0.3 = 2.796,
  // so logits 4 and 3 stay: ids [3, 2], still sorted (no re-sort needed downstream).
  CandidateList list = list_of({1, 2, 3, 4});
  TopK(3).apply(list, {});
  MinP(0.3f).apply(list, {});
  EXPECT_EQ(ids_of(list), (std::vector<int32_t>{3, 2}));
  EXPECT_TRUE(list.sorted());
}

TEST(SamplingTopP, KeepsTheSmallestPrefixWithEnoughMass) {
  // probs [0.5, 0.3, 0.15, 0.05]. Cumulative in rank order: 0.5, 0.8, 0.95, 1.0.
  // top_p = 0.7: 0.5 < 0.7, 0.8 >= 0.7 -> keep {0, 1}.
  // top_p = 0.85: 0.8 < 0.85, 0.95 >= 0.85 -> keep {0, 1, 2}.
  // top_p = 0.4: 0.5 >= 0.4 -> keep {0}.
  const std::vector<float> logits = logits_of({0.5, 0.3, 0.15, 0.05});
  for (auto [p, expected] : {std::pair{0.7f, std::vector<int32_t>{0, 1}},
                             std::pair{0.85f, std::vector<int32_t>{0, 1, 2}},
                             std::pair{0.4f, std::vector<int32_t>{0}}}) {
    CandidateList list = list_of(logits);
    TopP(p).apply(list, {});
    EXPECT_EQ(ids_of(list), expected) << "top_p " << p;
  }
}

TEST(SamplingTopP, GrowsItsSortedPrefixOnAWideFlatDistribution) {
  // 1000 equal logits: each p = 1/1000. top_p = 0.9005 needs 901 tokens (900/1000 = 0.9 < 0.9005,
  // 901/1000 = 0.901 >= 0.9005), more than the first sorted chunks (64, 256) hold. Ties go to
  // lower ids, so the kept ids are 0..900.
  CandidateList list = list_of(std::vector<float>(1000, 0.0f));
  TopP(0.9005f).apply(list, {});
  std::vector<int32_t> expected(901);
  std::iota(expected.begin(), expected.end(), 0);
  EXPECT_EQ(ids_of(list), expected);
}

TEST(SamplingMinP, KeepsTokensWithAtLeastMinPTimesTheMaxProb) {
  // probs [0.5, 0.3, 0.15, 0.05]: min_p = 0.2 keeps p >= 0.2 * 0.5 = 0.1 -> {0, 1, 2};
  // min_p = 0.7 keeps p >= 0.35 -> {0}.
  const std::vector<float> logits = logits_of({0.5, 0.3, 0.15, 0.05});
  CandidateList list = list_of(logits);
  MinP(0.2f).apply(list, {});
  EXPECT_EQ(ids_of(list), (std::vector<int32_t>{0, 1, 2}));
  list = list_of(logits);
  MinP(0.7f).apply(list, {});
  EXPECT_EQ(ids_of(list), (std::vector<int32_t>{0}));
}

TEST(SamplingTemperature, HalfTemperatureDoublesLogits) {
  // T = 0.5 multiplies logits by 2 (after subtracting the max 3, which softmax ignores):
  // [1, 2, 3] -> [(1-3)*2, (2-3)*2, 0] = [-4, -2, 0], so the gaps double from 1 to 2.
  CandidateList list = list_of({1, 2, 3});
  Temperature(0.5f).apply(list, {});
  EXPECT_FLOAT_EQ(list[0].logit, -4.0f);
  EXPECT_FLOAT_EQ(list[1].logit, -2.0f);
  EXPECT_FLOAT_EQ(list[2].logit, 0.0f);
  // logits [0, ln 3] are probs [1/4, 3/4]; at T = 0.5 they become [1, 9] / 10 = [0.1, 0.9].
  list = list_of({0.0f, static_cast<float>(std::log(3.0))});
  Temperature(0.5f).apply(list, {});
  list.softmax();
  EXPECT_NEAR(list[0].prob, 0.1, 1e-6);
  EXPECT_NEAR(list[1].prob, 0.9, 1e-6);
}

TEST(SamplingPenalty, RepetitionDividesPositiveAndMultipliesNegative) {
  // penalty 2, previous [0, 1, 1]: id 0 has logit 3 -> 3 / 2 = 1.5; id 1 has -1 -> -1 * 2 = -2
  // (once, although it occurs twice); ids 2 and 3 were not seen and keep 2 and 0.5.
  CandidateList list = list_of({3, -1, 2, 0.5f});
  const std::vector<int32_t> previous = {0, 1, 1};
  RepetitionPenalty(2.0f, 64).apply(list, previous);
  EXPECT_FLOAT_EQ(logit_of(list, 0), 1.5f);
  EXPECT_FLOAT_EQ(logit_of(list, 1), -2.0f);
  EXPECT_FLOAT_EQ(logit_of(list, 2), 2.0f);
  EXPECT_FLOAT_EQ(logit_of(list, 3), 0.5f);
}

TEST(SamplingPenalty, RepetitionLooksOnlyAtTheLastN) {
  // previous [2, 0, 1] with repeat_last_n = 2 sees only [0, 1]: id 2 keeps its logit 2.
  // With -1 it sees all three: id 2 -> 2 / 2 = 1.
  const std::vector<int32_t> previous = {2, 0, 1};
  CandidateList list = list_of({3, -1, 2, 0.5f});
  RepetitionPenalty(2.0f, 2).apply(list, previous);
  EXPECT_FLOAT_EQ(logit_of(list, 0), 1.5f);
  EXPECT_FLOAT_EQ(logit_of(list, 2), 2.0f);
  list = list_of({3, -1, 2, 0.5f});
  RepetitionPenalty(2.0f, -1).apply(list, previous);
  EXPECT_FLOAT_EQ(logit_of(list, 2), 1.0f);
}

TEST(SamplingPenalty, PresenceAndFrequencySubtractPerOccurrence) {
  // presence 0.5, frequency 0.25, previous [4, 4, 4, 1] (id 4 three times, id 1 once):
  // id 4: 1 - 0.5 - 0.25 * 3 = -0.25; id 1: 1 - 0.5 - 0.25 * 1 = 0.25; others stay at 1.
  CandidateList list = list_of({1, 1, 1, 1, 1});
  const std::vector<int32_t> previous = {4, 4, 4, 1};
  PresencePenalty(0.5f).apply(list, previous);
  FrequencyPenalty(0.25f).apply(list, previous);
  EXPECT_FLOAT_EQ(logit_of(list, 4), -0.25f);
  EXPECT_FLOAT_EQ(logit_of(list, 1), 0.25f);
  EXPECT_FLOAT_EQ(logit_of(list, 0), 1.0f);
  EXPECT_FLOAT_EQ(logit_of(list, 2), 1.0f);
  EXPECT_FLOAT_EQ(logit_of(list, 3), 1.0f);
}

TEST(SamplingLogitBias, AddsToTheNamedIdsEvenAfterTruncation) {
  // bias {1: +2.5, 3: -100} on [1, 2, 3, 4] -> [1, 4.5, 3, -96].
  CandidateList list = list_of({1, 2, 3, 4});
  LogitBias({{1, 2.5f}, {3, -100.0f}}).apply(list, {});
  EXPECT_FLOAT_EQ(logit_of(list, 1), 4.5f);
  EXPECT_FLOAT_EQ(logit_of(list, 3), -96.0f);
  EXPECT_FLOAT_EQ(logit_of(list, 0), 1.0f);
  // After top_k = 2 ({3, 2} remain, no longer in id order) the lookup falls back to a scan; the
  // truncated id 0 is skipped quietly.
  list = list_of({1, 2, 3, 4});
  TopK(2).apply(list, {});
  LogitBias({{2, 1.5f}, {0, 9.0f}}).apply(list, {});
  EXPECT_FLOAT_EQ(logit_of(list, 2), 4.5f);
  EXPECT_EQ(list.size(), 2u);
}

TEST(SamplingChain, OrderFollowsTheDocumentedChain) {
  SamplingParams params;
  params.temperature = 0.7f;
  params.top_k = 40;
  params.top_p = 0.9f;
  params.min_p = 0.05f;
  params.repetition_penalty = 1.1f;
  params.presence_penalty = 0.1f;
  params.frequency_penalty = 0.1f;
  params.logit_bias[0] = 1.0f;
  std::vector<std::string> names;
  for (const auto& p : make_processor_chain(params)) names.emplace_back(p->name());
  EXPECT_EQ(names, (std::vector<std::string>{"logit_bias", "repetition_penalty", "presence_penalty",
                                             "frequency_penalty", "top_k", "top_p", "min_p",
                                             "temperature"}));
  params.temperature = 0.0f;  // greedy: truncation and temperature cannot change the argmax
  EXPECT_EQ(make_processor_chain(params).size(), 4u);
  EXPECT_TRUE(make_processor_chain(SamplingParams{}).empty());  // all defaults are "off"
}

// ---- Sampler ----------------------------------------------------------------------------------

TEST(SamplingSampler, GreedyPicksTheArgmaxAndBreaksTiesByLowestId) {
  SamplingParams params;
  params.temperature = 0.0f;
  Sampler sampler(params, 4);
  EXPECT_EQ(sampler.sample(std::vector<float>{1, 5, 2, 3}, {}), 1);
  EXPECT_EQ(sampler.sample(std::vector<float>{1, 5, 5, 2}, {}), 1);  // tie between 1 and 2
  EXPECT_EQ(sampler.sample(std::vector<float>{7, 7, 7, 7}, {}), 0);
}

TEST(SamplingSampler, GreedyAppliesPenaltiesFirst) {
  // logits [4, 3.9], id 0 seen before, repetition penalty 2: id 0 -> 4 / 2 = 2 < 3.9, so id 1.
  SamplingParams params;
  params.temperature = 0.0f;
  params.repetition_penalty = 2.0f;
  Sampler sampler(params, 2);
  const std::vector<int32_t> previous = {0};
  EXPECT_EQ(sampler.sample(std::vector<float>{4.0f, 3.9f}, previous), 1);
  EXPECT_EQ(sampler.sample(std::vector<float>{4.0f, 3.9f}, {}), 0);
}

TEST(SamplingSampler, EmpiricalFrequenciesMatchTheFullDistribution) {
  // logits ln[0.1, 0.2, 0.3, 0.4] at temperature 1 with nothing truncated: probs 0.1 .. 0.4.
  // 20,000 draws; bound per token 3 sqrt(p (1 - p) / 20000), e.g. 0.0064 for p = 0.1 and 0.0104
  // for p = 0.4.
  SamplingParams params;
  params.seed = 1;
  Sampler sampler(params, 4);
  expect_frequencies(sampler, logits_of({0.1, 0.2, 0.3, 0.4}), {0.1, 0.2, 0.3, 0.4});
}

TEST(SamplingSampler, EmpiricalFrequenciesWithTopK) {
  // logits [1, 2, 3, 4], top_k = 2: p3 = 1 / (1 + e^-1) = 0.7310585786, p2 = 0.2689414214,
  // p0 = p1 = 0. Bound: 3 sqrt(0.731 * 0.269 / 20000) = 0.0094.
  SamplingParams params;
  params.top_k = 2;
  params.seed = 2;
  Sampler sampler(params, 4);
  expect_frequencies(sampler, {1, 2, 3, 4}, {0.0, 0.0, 0.2689414214, 0.7310585786});
}

TEST(SamplingSampler, EmpiricalFrequenciesWithTopP) {
  // probs [0.5, 0.3, 0.15, 0.05], top_p = 0.7 keeps {0, 1}; renormalised: 0.5 / 0.8 = 0.625 and
  // 0.3 / 0.8 = 0.375. Bound: 3 sqrt(0.625 * 0.375 / 20000) = 0.0103.
  SamplingParams params;
  params.top_p = 0.7f;
  params.seed = 3;
  Sampler sampler(params, 4);
  expect_frequencies(sampler, logits_of({0.5, 0.3, 0.15, 0.05}), {0.625, 0.375, 0.0, 0.0});
}

TEST(SamplingSampler, EmpiricalFrequenciesWithMinPAndTemperature) {
  // probs [0.5, 0.3, 0.15, 0.05], min_p = 0.2 keeps p >= 0.1: {0, 1, 2}. Temperature 0.5 squares
  // the kept probs: 0.25, 0.09, 0.0225, sum 0.3625 -> 0.6896551724, 0.2482758621, 0.0620689655.
  SamplingParams params;
  params.min_p = 0.2f;
  params.temperature = 0.5f;
  params.seed = 4;
  Sampler sampler(params, 4);
  expect_frequencies(sampler, logits_of({0.5, 0.3, 0.15, 0.05}),
                     {0.6896551724, 0.2482758621, 0.0620689655, 0.0});
}

TEST(SamplingSampler, SameSeedSameTokensDifferentSeedDifferentTokens) {
  // 16 equally likely tokens, 100 draws: two different seeds agree everywhere with chance 16^-100.
  const std::vector<float> logits(16, 0.0f);
  auto run = [&](uint64_t seed) {
    SamplingParams params;
    params.seed = seed;
    Sampler sampler(params, 16);
    std::vector<int32_t> tokens;
    for (int i = 0; i < 100; ++i) tokens.push_back(sampler.sample(logits, {}));
    return tokens;
  };
  EXPECT_EQ(run(7), run(7));
  EXPECT_NE(run(7), run(8));
}

TEST(SamplingSampler, SeededDrawsArePinned) {
  // Cross-platform reproducibility: seed 7 on probs [0.1, 0.2, 0.3, 0.4]. The expected ids come
  // from an independent Python re-implementation of SplitMix64 seeding, xoshiro256** and the
  // inverse-CDF walk (u = (x >> 11) * 2^-53; first id whose cumulative prob exceeds u).
  SamplingParams params;
  params.seed = 7;
  Sampler sampler(params, 4);
  const std::vector<float> logits = logits_of({0.1, 0.2, 0.3, 0.4});
  std::vector<int32_t> tokens;
  for (int i = 0; i < 12; ++i) tokens.push_back(sampler.sample(logits, {}));
  EXPECT_EQ(tokens, (std::vector<int32_t>{3, 1, 3, 3, 3, 3, 0, 1, 2, 1, 2, 3}));
}

TEST(SamplingLogprobs, LogSoftmaxOfTheRawLogits) {
  // logits [1, 2, 3, 4]: log Z = 4 + ln(1 + e^-1 + e^-2 + e^-3) = 4 + ln(1.5032147) = 4.4401897.
  // logprob(3) = 4 - 4.4401897 = -0.4401897; logprob(2) = -1.4401897; logprob(0) = -3.4401897.
  const std::vector<float> logits = {1, 2, 3, 4};
  LogprobSummary s = compute_logprobs(logits, 0, 2);
  EXPECT_EQ(s.chosen.token, 0);
  EXPECT_NEAR(s.chosen.logprob, -3.4401897, 1e-6);
  ASSERT_EQ(s.top.size(), 2u);
  EXPECT_EQ(s.top[0].token, 3);
  EXPECT_NEAR(s.top[0].logprob, -0.4401897, 1e-6);
  EXPECT_EQ(s.top[1].token, 2);
  EXPECT_NEAR(s.top[1].logprob, -1.4401897, 1e-6);
  EXPECT_EQ(compute_logprobs(logits, 1, 10).top.size(), 4u);  // clamped to n_vocab
}

TEST(SamplingLogprobs, ChosenRankCountsTheTokensAboveIt) {
  // vLLM's rank: 1 + the tokens with a higher logit; tied tokens share a rank.
  const std::vector<float> logits = {1, 4, 3, 4, 0};
  EXPECT_EQ(compute_logprobs(logits, 1, 0).chosen_rank, 1);
  EXPECT_EQ(compute_logprobs(logits, 3, 0).chosen_rank, 1);
  EXPECT_EQ(compute_logprobs(logits, 2, 0).chosen_rank, 3);
  EXPECT_EQ(compute_logprobs(logits, 0, 2).chosen_rank, 4);
  EXPECT_EQ(compute_logprobs(logits, 4, 0).chosen_rank, 5);
}

TEST(SamplingLogprobs, SamplerReportsTheRawDistributionNotThePenalisedOne) {
  // Greedy with bias {0: +10} picks id 0, but its logprob is still the raw -3.4401897.
  SamplingParams params;
  params.temperature = 0.0f;
  params.logit_bias[0] = 10.0f;
  Sampler sampler(params, 4);
  SampledToken t = sampler.sample_with_logprobs(std::vector<float>{1, 2, 3, 4}, {}, 1);
  EXPECT_EQ(t.token, 0);
  EXPECT_NEAR(t.logprobs.chosen.logprob, -3.4401897, 1e-6);
  ASSERT_EQ(t.logprobs.top.size(), 1u);
  EXPECT_EQ(t.logprobs.top[0].token, 3);
}

// The serving engine passes the prompt length: OpenAI's presence and frequency penalties then
// count only generated tokens, while the repetition penalty still counts the prompt (vLLM).
TEST(Sampler, PresenceAndFrequencyPenaltiesSkipThePrompt) {
  const std::vector<float> logits = {1.0f, 1.5f, 1.2f, 0.0f};
  const std::vector<int32_t> history = {1, 1, 2};  // prompt {1, 1}, generated {2}
  kestrel::SamplingParams p;
  p.temperature = 0;
  p.presence_penalty = 1.0f;
  kestrel::Sampler with_prompt(p, 4);
  EXPECT_EQ(with_prompt.sample(logits, history), 0);  // 1 and 2 penalised: 0.5, 0.2 < 1.0
  kestrel::Sampler generated_only(p, 4);
  EXPECT_EQ(generated_only.sample(logits, history, 2), 1);  // only 2 penalised: 1.5 wins
  p.presence_penalty = 0;
  p.frequency_penalty = 0.3f;
  kestrel::Sampler freq(p, 4);
  EXPECT_EQ(freq.sample(logits, history, 2), 1);  // 2 -> 0.9; 1 keeps 1.5
  kestrel::Sampler freq_all(p, 4);
  EXPECT_EQ(freq_all.sample(logits, history), 0);  // 1 -> 0.9, 2 -> 0.9, 0 keeps 1.0
  p.frequency_penalty = 0;
  p.repetition_penalty = 2.0f;
  kestrel::Sampler rep(p, 4);
  EXPECT_EQ(rep.sample(logits, history, 2), 0);  // prompt counts: 1 -> 0.75, 2 -> 0.6
}

// Non-finite logits are reported as NonFiniteLogitsError on both the plain-greedy and the
// processor-chain paths, so the engine can end just the request concerned.
TEST(Sampler, NonFiniteLogitsAreANamedError) {
  using kestrel::NonFiniteLogitsError;
  std::vector<float> logits = {0.5f, std::numeric_limits<float>::quiet_NaN(), 1.0f};
  kestrel::SamplingParams greedy;
  greedy.temperature = 0;
  kestrel::Sampler g(greedy, 3);
  EXPECT_THROW(g.sample(logits, {}), NonFiniteLogitsError);
  kestrel::SamplingParams sampled;
  sampled.temperature = 0.7f;
  sampled.top_k = 2;
  kestrel::Sampler s(sampled, 3);
  EXPECT_THROW(s.sample(logits, {}), NonFiniteLogitsError);
  // +inf is as bad: greedy would pick it silently, the softmax would make it NaN.
  logits[1] = std::numeric_limits<float>::infinity();
  try {
    g.sample(logits, {});
    ADD_FAILURE() << "no error for +inf";
  } catch (const NonFiniteLogitsError& e) {
    EXPECT_EQ(e.source(), NonFiniteLogitsError::Source::Model);
  }
  EXPECT_THROW(s.sample(logits, {}), NonFiniteLogitsError);
  // -inf bans a token; a row with nothing else has no distribution.
  const float ninf = -std::numeric_limits<float>::infinity();
  logits[1] = ninf;
  EXPECT_EQ(g.sample(logits, {}), 2);
  EXPECT_NE(s.sample(logits, {}), 1);
  const std::vector<float> banned = {ninf, ninf, ninf};
  EXPECT_THROW(g.sample(banned, {}), NonFiniteLogitsError);
  EXPECT_THROW(s.sample(banned, {}), NonFiniteLogitsError);
  logits[1] = 0.0f;
  EXPECT_EQ(g.sample(logits, {}), 2);
}

// Finite logits that a penalty takes past the float range end the request with a named error
// (Source::Processing), never an assertion, on the greedy and the sampled paths; within the
// validated ranges a model's logits cannot get there (sampling_params.h).
TEST(Sampler, PenaltiesThatOverflowAreANamedError) {
  using kestrel::NonFiniteLogitsError;
  const std::vector<float> logits = {3e37f, 1.0f, -2.0f};
  const std::vector<int32_t> history = {0, 2};
  for (float temperature : {0.0f, 1.0f, 0.5f}) {
    kestrel::SamplingParams p;
    p.temperature = temperature;
    p.top_p = 0.9f;
    p.repetition_penalty = kestrel::kMinRepetitionPenalty;
    kestrel::Sampler s(p, 3);
    try {
      s.sample(logits, history);
      ADD_FAILURE() << "no error at temperature " << temperature;
    } catch (const NonFiniteLogitsError& e) {
      EXPECT_EQ(e.source(), NonFiniteLogitsError::Source::Processing);
    }
    // The same sampler goes on with ordinary logits.
    EXPECT_EQ(s.sample(std::vector<float>{1.0f, 300.0f, -2.0f}, history), 1);  // 0 -> 100, 2 -> -0.02
  }
  // At the largest magnitudes the ranges keep finite: |logit| below FLT_MAX / 100.
  kestrel::SamplingParams edge;
  edge.temperature = 0;
  edge.repetition_penalty = kestrel::kMinRepetitionPenalty;
  edge.frequency_penalty = 2.0f;
  edge.logit_bias[1] = 100.0f;
  kestrel::Sampler e(edge, 3);
  const float big = std::numeric_limits<float>::max() / 101.0f;
  EXPECT_EQ(e.sample(std::vector<float>{big, -big, 0.0f}, history), 0);
  edge.repetition_penalty = kestrel::kMaxRepetitionPenalty;
  kestrel::Sampler e2(edge, 3);
  EXPECT_EQ(e2.sample(std::vector<float>{-big, big, 0.0f}, history), 1);
}

// ---- the device sampler's contract (cuda_ops.h: sample_tokens) ---------------------------------

TEST(SamplingSampler, DeviceCompatibleOnlyWithoutBiasAndPenalties) {
  auto compatible = [](auto edit) {
    SamplingParams params;
    edit(params);
    return Sampler(params, 8).device_compatible();
  };
  EXPECT_TRUE(compatible([](SamplingParams&) {}));
  EXPECT_TRUE(compatible([](SamplingParams& p) { p.temperature = 0.0f; }));
  EXPECT_TRUE(compatible([](SamplingParams& p) {
    p.temperature = 0.7f;
    p.top_k = 40;
    p.top_p = 0.9f;
    p.min_p = 0.05f;
  }));
  EXPECT_TRUE(compatible([](SamplingParams& p) {  // a penalty that looks at no token is left out
    p.repetition_penalty = 1.3f;
    p.repeat_last_n = 0;
  }));
  EXPECT_FALSE(compatible([](SamplingParams& p) { p.logit_bias[3] = 2.0f; }));
  EXPECT_FALSE(compatible([](SamplingParams& p) { p.repetition_penalty = 1.1f; }));
  EXPECT_FALSE(compatible([](SamplingParams& p) { p.presence_penalty = 0.5f; }));
  EXPECT_FALSE(compatible([](SamplingParams& p) {
    p.temperature = 0.0f;
    p.frequency_penalty = 0.5f;
  }));
}

TEST(SamplingSampler, TakeUniformIsTheDrawSampleWouldUse) {
  // The uniforms are the seed's xoshiro256** stream, one per sampled token.
  SamplingParams params;
  params.temperature = 0.8f;
  params.seed = 42;
  Sampler sampler(params, 16);
  Rng rng(42);
  for (int i = 0; i < 20; ++i) EXPECT_EQ(sampler.take_uniform(), rng.next_double());

  // Greedy draws nothing, and says so with 0.
  params.temperature = 0.0f;
  Sampler greedy(params, 16);
  EXPECT_EQ(greedy.take_uniform(), 0.0);
  EXPECT_EQ(greedy.take_uniform(), 0.0);
}

TEST(SamplingSampler, TakeUniformKeepsTheStreamOfSample) {
  // One sampler samples every step on the CPU; its twin draws every third token "on the device"
  // (take_uniform, then the CPU arithmetic with that uniform: sampling_reference.h). Same tokens
  // at every step: the uniform is the one sample() would have used, and the stream after it is
  // the same.
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  SamplingParams params;
  params.temperature = 0.9f;
  params.top_k = 20;
  params.top_p = 0.95f;
  params.min_p = 0.01f;
  params.seed = 77;
  Sampler cpu(params, 100), mixed(params, 100);
  const test::ReferenceParams ref{params.temperature, params.top_k, params.top_p, params.min_p};
  for (int step = 0; step < 60; ++step) {
    std::vector<float> logits(100);
    for (float& l : logits) l = normal(rng);
    const int32_t expected = cpu.sample(logits, {});
    const int32_t got = step % 3 == 0 ? test::reference_sample(logits.data(), 100, ref, mixed.take_uniform()).token
                                      : mixed.sample(logits, {});
    EXPECT_EQ(got, expected) << "step " << step;
  }
}

TEST(SamplingReference, MatchesTheSamplerOnRandomChains) {
  // tests/backend/sampling_reference.h re-implements the Sampler's arithmetic for the CUDA test;
  // with the uniform the Sampler draws it must pick the same token, exactly.
  std::mt19937 rng(9);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::bernoulli_distribution coin(0.3);
  const float temperatures[] = {0.0f, 0.3f, 0.7f, 1.0f, 2.0f};
  const int32_t top_ks[] = {0, 1, 5, 50, 400};
  const float top_ps[] = {1.0f, 0.95f, 0.9f, 0.5f};
  const float min_ps[] = {0.0f, 0.02f, 0.1f};
  int n_cases = 0;
  for (const int32_t n : {1, 7, 1000}) {
    for (int c = 0; c < 150; ++c) {
      SamplingParams params;
      params.temperature = temperatures[rng() % 5];
      params.top_k = top_ks[rng() % 5];
      params.top_p = top_ps[rng() % 4];
      params.min_p = min_ps[rng() % 3];
      params.seed = rng();
      std::vector<float> logits(static_cast<size_t>(n));
      const int kind = c % 3;  // plain, ties (halves), 30% banned
      for (float& l : logits) {
        l = normal(rng);
        if (kind == 1) l = std::round(l * 2.0f) / 2.0f;
        if (kind == 2 && coin(rng)) l = -INFINITY;
      }
      logits[rng() % logits.size()] = 1.0f;  // something finite
      Sampler sampler(params, n);
      Rng uniforms(params.seed);
      const double u = params.temperature > 0.0f ? uniforms.next_double() : 0.0;
      const test::ReferenceDraw ref = test::reference_sample(
          logits.data(), n, test::ReferenceParams{params.temperature, params.top_k, params.top_p, params.min_p}, u);
      EXPECT_EQ(ref.token, sampler.sample(logits, {}))
          << "n " << n << " temperature " << params.temperature << " top_k " << params.top_k << " top_p "
          << params.top_p << " min_p " << params.min_p;
      ++n_cases;
    }
  }
  EXPECT_EQ(n_cases, 450);
}
