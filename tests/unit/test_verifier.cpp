// verify_drafts on hand-made logits rows: greedy accepts exactly the argmax whatever q says, a
// draft with p(x) = 0 is never accepted and the correction then comes from max(0, p - q), and
// penalties at a draft position count the drafts accepted before it; accept_sampled_drafts (rows
// sampled elsewhere with the peeked uniforms) gives verify_drafts' tokens and leaves the RNG where
// it does.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "spec/verifier.h"

using namespace kestrel;

namespace {
constexpr int kVocab = 6;
std::vector<float> rows_of(std::initializer_list<std::vector<float>> rows) {
  std::vector<float> out;
  for (const auto& r : rows) out.insert(out.end(), r.begin(), r.end());
  return out;
}
}  // namespace

TEST(Verifier, GreedyAcceptsExactlyTheArgmaxWithAnyQ) {
  SamplingParams g;
  g.temperature = 0;
  Sampler s(g, kVocab);
  // Argmax per row: 2, 4, 1. Drafts: 2 (accepted), 5 (rejected: corrected to 4).
  const auto rows = rows_of({{0, 1, 5, 0, 0, 0}, {0, 0, 0, 1, 3, 2}, {0, 9, 0, 0, 0, 0}});
  const std::vector<int32_t> seq = {0, 3, 2, 5};
  std::vector<float> q(2 * kVocab, 0.0f);
  q[2] = 0.5f, q[3] = 0.5f;                    // draft 0 drawn from {2, 3}
  q[kVocab + 5] = 0.9f, q[kVocab + 4] = 0.1f;  // draft 1 drawn from {5, 4}
  for (bool one_hot : {true, false}) {
    const Verification v = verify_drafts(s, rows, seq, 2, 2, one_hot ? std::span<const float>() : q, 2);
    EXPECT_EQ(v.n_accepted, 1);
    EXPECT_EQ(v.tokens, (std::vector<int32_t>{2, 4}));
    ASSERT_EQ(v.logprobs.size(), 2u);
    EXPECT_EQ(v.logprobs[1].chosen.token, 4);
    EXPECT_EQ(v.logprobs[1].top[0].token, 4);
  }
  // All accepted: the bonus token comes from the last row.
  const std::vector<int32_t> good = {0, 3, 2, 4};
  const Verification all = verify_drafts(s, rows, good, 2, 2, {}, -1);
  EXPECT_EQ(all.n_accepted, 2);
  EXPECT_EQ(all.tokens, (std::vector<int32_t>{2, 4, 1}));
  EXPECT_TRUE(all.logprobs.empty());
}

TEST(Verifier, ADraftOutsideTheTargetsSupportIsRejectedAndCorrectedFromTheResidual) {
  SamplingParams p;
  p.temperature = 1.0f;
  p.top_k = 2;  // p lives on {0, 1} only
  p.seed = 3;
  Sampler s(p, kVocab);
  const auto rows = rows_of({{2, 2, 0, 0, 0, 0}, {0, 0, 0, 0, 0, 0}});
  // q puts 0.6 on token 0 and 0.4 on the drafted 5: the residual max(0, p - q) is 0.5 - 0.6 < 0 at
  // 0 and 0.5 at 1, so every correction is 1.
  std::vector<float> q(kVocab, 0.0f);
  q[0] = 0.6f, q[5] = 0.4f;
  for (int i = 0; i < 50; ++i) {
    const Verification v = verify_drafts(s, rows, std::vector<int32_t>{3, 5}, 1, 1, q, -1);
    EXPECT_EQ(v.n_accepted, 0);
    EXPECT_EQ(v.tokens, (std::vector<int32_t>{1}));
  }
}

TEST(Verifier, PenaltiesAtADraftPositionCountTheAcceptedDraftsBeforeIt) {
  SamplingParams g;
  g.temperature = 0;
  g.frequency_penalty = 2.0f;  // OpenAI: counts generated tokens only
  Sampler s(g, kVocab);
  // Row 0 prefers 3; row 1 prefers 3 by 1.5 over 2, but 3 was just accepted (generated once):
  // 3 - 2 = 1 < 1.5, so 2 wins there.
  const auto rows = rows_of({{0, 0, 0, 4, 0, 0}, {0, 0, 1.5f, 3, 0, 0}});
  const Verification v = verify_drafts(s, rows, std::vector<int32_t>{1, 3}, 1, 1, {}, -1);
  EXPECT_EQ(v.n_accepted, 1);
  EXPECT_EQ(v.tokens, (std::vector<int32_t>{3, 2}));
}

// 300 random cases (vocab 6, k 1..4, greedy and seeded chains the device sampler implements,
// drafts that agree with the target's draw or not): each row sampled with Sampler::sample_with_uniform
// from the i-th peeked uniform, then accept_sampled_drafts, against verify_drafts on a twin sampler
// of the same seed with q one-hot: the same tokens and accepted count, and the same next draw.
TEST(Verifier, DeviceSampledRowsGiveVerifyDraftsTokensAndRngState) {
  std::mt19937 gen(11);
  std::uniform_real_distribution<float> logit(-3.0f, 3.0f);
  int accepted_some = 0, rejected_some = 0;
  for (int t = 0; t < 300; ++t) {
    SamplingParams p;
    p.temperature = t % 4 == 0 ? 0.0f : 0.5f + static_cast<float>(t % 3) * 0.4f;
    p.top_k = t % 5 == 1 ? 3 : 0;
    p.top_p = t % 7 == 2 ? 0.8f : 1.0f;
    p.min_p = t % 6 == 3 ? 0.1f : 0.0f;
    p.seed = static_cast<uint64_t>(t);
    Sampler ref(p, kVocab), dev(p, kVocab);
    const int64_t k = 1 + t % 4;
    std::vector<float> rows(static_cast<size_t>((k + 1) * kVocab));
    for (float& x : rows) x = logit(gen);
    std::vector<int32_t> seq = {0, 1};
    // Drafts: the target's argmax (often accepted) or a fixed token.
    for (int64_t i = 0; i < k; ++i) {
      const float* r = rows.data() + i * kVocab;
      seq.push_back(gen() % 2 == 0 ? static_cast<int32_t>(std::max_element(r, r + kVocab) - r) : 5);
    }
    const Verification want = verify_drafts(ref, rows, seq, k, 2, {}, -1);
    std::vector<double> u(static_cast<size_t>(k + 1));
    dev.peek_uniforms(u);
    std::vector<int32_t> sampled;
    for (int64_t i = 0; i <= k; ++i)
      sampled.push_back(dev.sample_with_uniform(std::span<const float>(rows).subspan(i * kVocab, kVocab), u[i]));
    const Verification got = accept_sampled_drafts(dev, sampled, std::span<const int32_t>(seq).last(k));
    EXPECT_EQ(got.tokens, want.tokens) << "case " << t;
    EXPECT_EQ(got.n_accepted, want.n_accepted) << "case " << t;
    EXPECT_EQ(dev.take_uniform(), ref.take_uniform()) << "case " << t;
    accepted_some += want.n_accepted > 0;
    rejected_some += want.n_accepted < k;
  }
  EXPECT_GT(accepted_some, 30);
  EXPECT_GT(rejected_some, 30);
}

// A row without a distribution (-1) ends the request only where the walk reaches it: after a
// rejection the rows are not read.
TEST(Verifier, DeviceSampledRowsReadNothingPastTheFirstRejection) {
  SamplingParams g;
  g.temperature = 0;
  Sampler s(g, kVocab);
  const std::vector<int32_t> drafts = {2, 4};
  const Verification v = accept_sampled_drafts(s, std::vector<int32_t>{2, 3, -1}, drafts);
  EXPECT_EQ(v.tokens, (std::vector<int32_t>{2, 3}));
  EXPECT_EQ(v.n_accepted, 1);
  EXPECT_THROW(accept_sampled_drafts(s, std::vector<int32_t>{2, -1, 0}, drafts), NonFiniteLogitsError);
}
