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

// The adaptive draft length (NgramDrafter with adaptive_k): a sequence starts at k, drops to one
// past the accepted prefix after a cut draft, doubles after a whole one (capped at k), and a
// request's own room still caps a proposal; release forgets the sequence. Fixed: always the room.
TEST(NgramDrafter, AdaptiveDraftLengthFollowsWhatTheVerifierKept) {
  NgramDrafter d(1, 2, 8);
  const std::vector<int32_t> t = {5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 5, 6};  // 5 6 recurs
  std::vector<Draft> out;
  auto propose = [&](SeqId id, int32_t room) {
    const std::vector<DraftRequest> reqs = {{id, t, 4, room}};
    d.propose(reqs, out);
    return out[0].ids.size();
  };
  EXPECT_EQ(d.limit(1), 0);
  EXPECT_EQ(propose(1, 16), 8u);  // starts at k
  d.on_verified(1, 2, 0);         // 2 of 8 kept
  EXPECT_EQ(d.limit(1), 3);
  EXPECT_EQ(propose(1, 16), 3u);
  d.on_verified(1, 0, 0);  // cut at the first
  EXPECT_EQ(propose(1, 16), 1u);
  d.on_verified(1, 1, 0);  // whole: doubles
  EXPECT_EQ(propose(1, 16), 2u);
  d.on_verified(1, 2, 0);
  EXPECT_EQ(propose(1, 16), 4u);
  d.on_verified(1, 4, 0);
  EXPECT_EQ(propose(1, 16), 8u);
  d.on_verified(1, 8, 0);
  EXPECT_EQ(d.limit(1), 8);        // capped at k
  EXPECT_EQ(propose(1, 3), 3u);    // the request's room caps the proposal
  d.on_verified(1, 3, 0);          // whole (all 3 it could propose): stays at the cap
  EXPECT_EQ(d.limit(1), 8);
  EXPECT_EQ(propose(2, 16), 8u);   // another sequence has its own limit
  d.on_verified(2, 0, 0);
  EXPECT_EQ(d.limit(2), 1);
  EXPECT_EQ(d.limit(1), 8);
  d.on_verified(2, 5, 0);          // no proposal outstanding: nothing changes
  EXPECT_EQ(d.limit(2), 1);
  d.release(2);
  EXPECT_EQ(d.limit(2), 0);
  EXPECT_EQ(propose(2, 16), 8u);   // a released sequence starts over
  // An empty proposal leaves the limit alone.
  NgramDrafter e(3, 3, 4);
  const std::vector<DraftRequest> none = {{7, std::span<const int32_t>(t).subspan(0, 5), 2, 4}};
  e.propose(none, out);
  EXPECT_TRUE(out[0].ids.empty());
  e.on_verified(7, 0, 5);
  EXPECT_EQ(e.limit(7), 4);
  // Fixed: every proposal as long as the room allows, whatever was kept.
  NgramDrafter f(1, 2);
  const std::vector<DraftRequest> reqs = {{1, t, 4, 6}};
  f.propose(reqs, out);
  EXPECT_EQ(out[0].ids.size(), 6u);
  f.on_verified(1, 0, 0);
  f.propose(reqs, out);
  EXPECT_EQ(out[0].ids.size(), 6u);
  EXPECT_NE(test::error_of([] { NgramDrafter(1, 2, -1); }).find("negative draft limit"), std::string::npos);
}
