// Stop strings over streamed text: nothing that could begin a stop string is released early, a
// match cuts the text right before it, and deltas never split a UTF-8 character.
#include <gtest/gtest.h>

#include "engine/stop_checker.h"

namespace kestrel {
namespace {

TEST(StopChecker, MatchAcrossPiecesCutsBeforeTheStop) {
  StopChecker c({"o w"});
  std::string out;
  EXPECT_FALSE(c.push("Hel", out));
  EXPECT_EQ(out, "H");  // "el" could start "o w"? no, but the last 2 bytes are held regardless
  EXPECT_TRUE(c.push("lo world", out));
  EXPECT_EQ(out, "Hell");
}

TEST(StopChecker, HoldsBackOnlyAPossibleStart) {
  StopChecker c({"xyz", "q"});
  std::string out;
  EXPECT_FALSE(c.push("abcx", out));
  EXPECT_EQ(out, "ab");
  EXPECT_TRUE(c.push("yz and more", out));
  EXPECT_EQ(out, "abc");
}

TEST(StopChecker, EarliestOfSeveralStopsWins) {
  StopChecker c({"END", "stop"});
  std::string out;
  EXPECT_TRUE(c.push("a stop then END", out));
  EXPECT_EQ(out, "a ");
}

TEST(StopChecker, FlushReleasesHeldText) {
  StopChecker c({"abc"});
  std::string out;
  EXPECT_FALSE(c.push("xxab", out));
  EXPECT_EQ(out, "xx");
  EXPECT_EQ(c.flush("!"), "ab!");
  StopChecker none;
  std::string all;
  EXPECT_FALSE(none.push("anything", all));
  EXPECT_EQ(all, "anything");
}

TEST(StopChecker, NeverSplitsAUtf8Character) {
  StopChecker c({"ab"});  // holds 1 byte
  std::string out;
  EXPECT_FALSE(c.push("\xC3\xA9", out));  // é: the cut would fall inside it
  EXPECT_EQ(out, "");
  EXPECT_FALSE(c.push("c", out));
  EXPECT_EQ(out, "\xC3\xA9");
}

// vLLM's min_tokens: before it is reached (may_stop false) a stop string is ordinary text; after,
// only a match that the new text completes ends generation, including one that began earlier.
TEST(StopChecker, MatchesBeforeMayStopAreText) {
  StopChecker c({"ab", "xab"});
  std::string out;
  EXPECT_FALSE(c.push("1ab2x", out, /*may_stop=*/false));
  EXPECT_EQ(out, "1ab");  // "2x" may still start "xab"
  EXPECT_FALSE(c.push("a", out, /*may_stop=*/true));
  EXPECT_EQ(out, "1ab2");
  // The match that began before may_stop and ends now counts: "xab" at "2xab".
  EXPECT_TRUE(c.push("b tail", out, /*may_stop=*/true));
  EXPECT_EQ(out, "1ab2");
}

TEST(StopChecker, AMatchHeldFromBeforeMayStopNeverCounts) {
  StopChecker c({"ab", "abcdef"});  // holds 5 bytes: "ab" can lie wholly in the held text
  std::string out;
  EXPECT_FALSE(c.push("zab", out, /*may_stop=*/false));
  EXPECT_EQ(out, "");
  EXPECT_FALSE(c.push("z", out, /*may_stop=*/true));  // "ab" is held, but it ended earlier
  EXPECT_EQ(out, "");
  EXPECT_EQ(c.flush("", /*may_stop=*/true), "zabz");
  StopChecker d({"ab"});
  std::string dout;
  EXPECT_FALSE(d.push("a", dout, /*may_stop=*/false));
  EXPECT_EQ(d.flush("b!", /*may_stop=*/false), "ab!");  // a flush before min_tokens keeps the match as text
}

// matched() names the stop string that ended the text (vLLM's stop_reason).
TEST(StopChecker, MatchedNamesTheStopString) {
  StopChecker c({"END", "stop"});
  std::string out;
  EXPECT_EQ(c.matched(), "");
  EXPECT_FALSE(c.push("a st", out));
  EXPECT_EQ(c.matched(), "");
  EXPECT_TRUE(c.push("op", out));
  EXPECT_EQ(c.matched(), "stop");
}

// vLLM's include_stop_str_in_output: nothing is held back (every delta goes out as it comes), a
// match spanning deltas is still found, and the text ends right after the stop string (what a
// delta holds past it is dropped).
TEST(StopChecker, IncludeInOutputKeepsTheStopString) {
  StopChecker c({"o w", "xyz"}, /*include_in_output=*/true);
  std::string out;
  EXPECT_FALSE(c.push("Hel", out));
  EXPECT_EQ(out, "Hel");
  EXPECT_FALSE(c.push("lo", out));
  EXPECT_EQ(out, "Hello");
  EXPECT_TRUE(c.push(" world", out));
  EXPECT_EQ(out, "Hello w");
  EXPECT_EQ(c.matched(), "o w");

  StopChecker early({"END", "stop"}, true);
  std::string e;
  EXPECT_TRUE(early.push("a stop then END", e));
  EXPECT_EQ(e, "a stop");

  // Before min_tokens a match is text; a flush adds only what is new.
  StopChecker held({"ab"}, true);
  std::string h;
  EXPECT_FALSE(held.push("xab", h, /*may_stop=*/false));
  EXPECT_EQ(h, "xab");
  EXPECT_EQ(held.flush("c", /*may_stop=*/true), "c");
  StopChecker tail({"ab"}, true);
  std::string t;
  EXPECT_FALSE(tail.push("xa", t));
  EXPECT_EQ(tail.flush("b!"), "b");  // the match completes in the tail: cut after it
  EXPECT_EQ(tail.matched(), "ab");
}

}  // namespace
}  // namespace kestrel
