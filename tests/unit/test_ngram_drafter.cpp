// The n-gram (prompt lookup) drafter and --speculative-config's parser against hand-worked cases.
#include <gtest/gtest.h>

#include "spec/ngram_drafter.h"
#include "test_util.h"

using namespace kestrel;

TEST(NgramDrafter, ProposesWhatFollowedTheMostRecentLongestMatch) {
  const NgramDrafter d(1, 3);
  // Last 3 = {1, 2, 3}: it occurred at 0 (followed by 4 5) and at 5 (followed by 9 1 2 3); the
  // most recent wins.
  const std::vector<int32_t> t = {1, 2, 3, 4, 5, 1, 2, 3, 9, 1, 2, 3};
  EXPECT_EQ(d.lookup(t, 2), (std::vector<int32_t>{9, 1}));
  EXPECT_EQ(d.lookup(t, 1), (std::vector<int32_t>{9}));
  // Longest first: {7, 2, 3} never occurred before, {2, 3} did (most recently before 9).
  const std::vector<int32_t> u = {1, 2, 3, 4, 5, 2, 3, 9, 7, 2, 3};
  EXPECT_EQ(d.lookup(u, 3), (std::vector<int32_t>{9, 7, 2}));
  // Below prompt_lookup_min nothing is tried.
  const NgramDrafter d2(2, 3);
  EXPECT_TRUE(d2.lookup(std::vector<int32_t>{5, 6, 7, 8, 6}, 4).empty());
  EXPECT_EQ(NgramDrafter(1, 3).lookup(std::vector<int32_t>{5, 6, 7, 8, 6}, 4), (std::vector<int32_t>{7, 8, 6, 7}));
  EXPECT_TRUE(d.lookup(std::vector<int32_t>{1, 2, 3, 4}, 4).empty());
  EXPECT_TRUE(d.lookup(std::vector<int32_t>{7}, 4).empty());
  EXPECT_TRUE(d.lookup(t, 0).empty());
}

TEST(NgramDrafter, ARepeatingSpanKeepsRepeatingPastTheEnd) {
  const NgramDrafter d(1, 2);
  // {8, 9} last occurred at 2, followed by 8 9 (the suffix itself) and then the proposal's own ids.
  EXPECT_EQ(d.lookup(std::vector<int32_t>{1, 8, 9, 8, 9}, 5), (std::vector<int32_t>{8, 9, 8, 9, 8}));
  EXPECT_EQ(d.lookup(std::vector<int32_t>{4, 4, 4}, 3), (std::vector<int32_t>{4, 4, 4}));
}

TEST(NgramDrafter, ProposeAnswersEveryRequestWithAOneHotDraft) {
  NgramDrafter d(1, 2);
  const std::vector<int32_t> a = {3, 4, 3}, b = {1, 2};
  std::vector<DraftRequest> reqs = {{1, a, 1, 2}, {2, b, 1, 3}};
  std::vector<Draft> out;
  d.propose(reqs, out);
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[0].ids, (std::vector<int32_t>{4, 3}));
  EXPECT_TRUE(out[0].q.empty());
  EXPECT_TRUE(out[1].ids.empty());
  EXPECT_NE(test::error_of([] { NgramDrafter(0, 2); }).find("1 <= min <= max"), std::string::npos);
  EXPECT_NE(test::error_of([] { NgramDrafter(3, 2); }).find("prompt_lookup_min 3"), std::string::npos);
  SpeculativeConfig dm;
  dm.method = SpecMethod::DraftModel;
  dm.model = "/m";
  dm.num_speculative_tokens = 3;
  EXPECT_NE(test::error_of([&] { make_drafter(dm, DrafterContext{}); }).find("needs the draft model (/m) loaded"),
            std::string::npos);
}
