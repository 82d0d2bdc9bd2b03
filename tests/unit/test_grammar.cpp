// The grammar engine (src/sampling/grammar): GBNF, regex and JSON Schema compiled and matched
// against hand-checked strings, the token masks against token-by-token acceptance, rollback, and
// the errors that name unsupported constructs.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "sampling/grammar/constraint.h"
#include "sampling/grammar/grammar.h"
#include "sampling/grammar/json_schema.h"
#include "sampling/grammar/matcher.h"
#include "sampling/grammar/regex.h"

namespace kestrel::grammar {
namespace {

// A vocabulary of every single byte (id = byte value, id 0 is EOS) plus a few multi-byte tokens,
// among them pieces that split a UTF-8 character ("\xC3" + "\xA9" is U+00E9).
std::shared_ptr<const TokenVocab> test_vocab() {
  std::vector<std::string> bytes(256);
  for (int i = 1; i < 256; ++i) bytes[static_cast<size_t>(i)] = std::string(1, static_cast<char>(i));
  for (const char* t : {"ab", "abc", "\":", "\",\"", "{\"", "\"}", "true", "12", "é", "\xC3\xA9x", "é\"", "1,\"", "\"a"})
    bytes.push_back(t);
  return TokenVocab::from_bytes(std::move(bytes), 0);
}

// Feeds `text` one byte token at a time, checking at each step that the mask agrees with
// accept_token. Returns whether the whole text is a sentence of the grammar.
bool matches(const std::shared_ptr<const CompiledGrammar>& cg, const std::string& text) {
  GrammarMatcher m(cg);
  std::vector<uint32_t> mask(bitmask_words(cg->vocab().n_vocab));
  for (unsigned char c : text) {
    m.fill_next_token_bitmask(mask);
    bool in_mask = (mask[c / 32] >> (c % 32)) & 1u;
    bool ok = m.accept_token(c);
    EXPECT_EQ(in_mask, ok) << "mask and accept_token disagree on byte " << int(c) << " of '" << text << "'";
    if (!ok) return false;
  }
  m.fill_next_token_bitmask(mask);
  EXPECT_EQ((mask[0] & 1u) != 0, m.can_end()) << "EOS bit for '" << text << "'";
  return m.can_end();
}

// The next draw of a fixed-seed linear congruential generator (Knuth's MMIX constants), for walks
// that repeat from run to run.
uint32_t next_draw(uint64_t& state) {
  state = state * 6364136223846793005ull + 1442695040888963407ull;
  return static_cast<uint32_t>(state >> 33);
}

// The ids whose bits are set in mask.
std::vector<int32_t> allowed_ids(const std::vector<uint32_t>& mask, int32_t n_vocab) {
  std::vector<int32_t> ids;
  for (int32_t id = 0; id < n_vocab; ++id)
    if ((mask[static_cast<size_t>(id) / 32] >> (id % 32)) & 1u) ids.push_back(id);
  return ids;
}

std::shared_ptr<const CompiledGrammar> compile(const std::string& gbnf) {
  return std::make_shared<CompiledGrammar>(Grammar::parse_gbnf(gbnf), test_vocab());
}

void expect_language(const std::string& gbnf, const std::vector<std::string>& yes, const std::vector<std::string>& no) {
  auto cg = compile(gbnf);
  for (const auto& s : yes) EXPECT_TRUE(matches(cg, s)) << "should accept '" << s << "' under\n" << gbnf;
  for (const auto& s : no) EXPECT_FALSE(matches(cg, s)) << "should reject '" << s << "' under\n" << gbnf;
}

// The message of the GrammarError that f throws ("" when it throws none).
std::string grammar_error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const GrammarError& e) {
    return e.what();
  }
  return "";
}

std::string schema_gbnf(const std::string& schema, JsonSchemaOptions o = {}) {
  return json_schema_to_gbnf(nlohmann::ordered_json::parse(schema), o);
}

TEST(Grammar, GbnfLiteralsClassesGroupsRepetition) {
  expect_language(R"(
# a comment
root ::= "a" [b-d]+ ("x" | "yz")? tail
tail ::= [^0-9\n]{0,2} "\x21"   # hex escape
)",
                  {"ab!", "abbx!", "abyzq!", "acdxqq!"}, {"a!", "abxqqq!", "ab1!", "ab", "abcdyzq"});
  expect_language("root ::= \"\\u00e9\" . [\\u0100-\\U0010FFFF]*", {"éa", "éaĀ😀"}, {"e", "éaa", "é"});
  expect_language("root ::= (\"ab\"){2,} | \"\"", {"", "abab", "ababab"}, {"ab", "aba"});
  expect_language("root ::= x{3}\nx ::= [0-1]", {"010"}, {"01", "0101"});
}

TEST(Grammar, GbnfErrorsNameTheProblem) {
  auto err = [](const std::string& g) {
    try {
      Grammar::parse_gbnf(g);
    } catch (const GrammarError& e) {
      EXPECT_EQ(e.keyword(), "gbnf");
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(err("root ::= a").find("rule 'a' is used but not defined"), std::string::npos);
  EXPECT_NE(err("x ::= \"a\"").find("no 'root'"), std::string::npos);
  EXPECT_NE(err("root ::= root \"a\" | \"b\"").find("left-recursive"), std::string::npos);
  EXPECT_NE(err("root ::= x \"a\"\nx ::= (root)?").find("left-recursive"), std::string::npos);
  EXPECT_NE(err("root ::= \"a").find("line 1"), std::string::npos);
  EXPECT_NE(err("root ::= [z-a]").find("reversed"), std::string::npos);
}

// A repetition of a part that can match the empty string, (a*)* or x* with a nullable rule x,
// means the repetition of that part's non-empty strings: the same language, with no loop that
// consumes nothing.
TEST(Grammar, RepetitionOfAPartThatCanBeEmpty) {
  expect_language("root ::= (\"a\"*)* \"b\"", {"b", "ab", "aaab"}, {"", "a", "ba", "abb"});
  expect_language("root ::= (\"a\"?)+", {"", "a", "aaaa"}, {"b", "ab"});
  expect_language("root ::= x* \"b\"\nx ::= \"a\"*", {"b", "aab"}, {"a", "bb"});
  expect_language("root ::= (\"a\"? \"b\"?)* \"c\"", {"c", "abc", "bac", "abbac"}, {"ca", "ab"});
  expect_language("root ::= ((x)*)* \"d\"\nx ::= \"\" | \"a\" x | y\ny ::= \"b\"?", {"d", "abd", "aaabbd"},
                  {"", "ad d"});
  expect_language("root ::= (e)* \"z\"\ne ::= \"\"", {"z"}, {"", "zz"});
  auto re = [](const std::string& p) { return "root ::= " + regex_to_gbnf(p) + "\n"; };
  expect_language(re("(a*)*b"), {"b", "aab"}, {"a", "ba"});
  expect_language(re("(a|)*"), {"", "aaa"}, {"b"});
  expect_language(re("(|a)+b"), {"b", "ab", "aab"}, {"a"});
  expect_language(re("((((a*)*)*)*)*b"), {"b", "aaaab"}, {"bb"});
  expect_language(re("(?:a?b?)*c"), {"c", "babac"}, {"cc"});
  // The rewrite copies suffixes: a long run of parts that can be empty is refused, not expanded
  // into gigabytes.
  std::string run = "root ::= (";
  for (int i = 0; i < 20000; ++i) run += " x";
  run += ")*\nx ::= \"a\"?";
  const std::string too_large = grammar_error_of([&] { Grammar::parse_gbnf(run); });
  EXPECT_NE(too_large.find("too large to rewrite"), std::string::npos) << too_large;
  expect_language("root ::= ((\"a\"?){3})* \"b\"", {"b", "aaaab"}, {"ba"});
  // A bounded repetition of such a part is one repetition of its non-empty strings: the same
  // language, in a chain of 20,000 links rather than 20,000 copies.
  expect_language("root ::= ((\"a\"?){20000})*", {"", "a", "aaaa"}, {"b", "ab"});
}

// x{m,n} of an x that can be empty is (x minus empty){0,n}: the language of the written form,
// without its ambiguity, so the matcher holds one stack per way of splitting the input into x's
// (at most two here) where the written form had one per copy that could still be skipped.
TEST(Grammar, BoundedRepetitionOfAPartThatCanBeEmptyIsNotAmbiguous) {
  expect_language("root ::= (\"a\"?){2,3} \"b\"", {"b", "ab", "aab", "aaab"}, {"aaaab", "a"});
  expect_language("root ::= (\"a\"? \"b\"?){2}", {"", "ab", "abab", "ba", "aa", "bb"}, {"aaa", "abba", "bbb"});
  expect_language("root ::= x{0,2} \"c\"\nx ::= \"ab\" | \"\"", {"c", "abc", "ababc"}, {"abababc", "ac"});
  auto re = [](const std::string& p) { return "root ::= " + regex_to_gbnf(p) + "\n"; };
  expect_language(re("(a?){2}b"), {"b", "ab", "aab"}, {"aaab"});
  expect_language(re("((a{0,3}){0,3}){0,2}"), {"", "a", std::string(18, 'a')}, {std::string(19, 'a'), "b"});
  for (const std::string g : {re("(a?){0,99999}"), re("(a?){5000}"), re("(a?){2,5000}b")}) {
    const Grammar parsed = Grammar::parse_gbnf(g);
    StackPool pool(parsed);
    std::vector<int32_t> tops, next;
    bool completed = false;
    pool.start(&tops, &completed);
    EXPECT_EQ(completed, g.find('b') == std::string::npos) << g;
    EXPECT_LE(tops.size(), 2u) << g;
    for (int i = 0; i < 50; ++i) {  // the written (a?){0,99999} had 99,999 stacks at each step
      completed = false;
      pool.step(tops, 'a', &next, &completed);
      ASSERT_EQ(completed, g.find('b') == std::string::npos) << g;
      ASSERT_FALSE(next.empty()) << g;
      tops.swap(next);
    }
    EXPECT_LE(tops.size(), 2u) << g;
  }
}

// A grammar ambiguous by its own strings keeps one parse per way of cutting the text so far, and
// every mask costs that many: past the matcher's bound on the parses summed over its tokens it is
// an error, while a choice of 10,000 strings (10,000 parses at the start, dying as it goes) runs.
TEST(Grammar, AGrammarTooAmbiguousToMatchIsAnErrorNotAStall) {
  const std::vector<std::string> bytes = {"a", "item", "0", "1", "2", "3", "4", "5", "6", "7", "8", "9"};
  auto vocab = TokenVocab::from_bytes(bytes, -1);
  std::vector<uint32_t> mask(bitmask_words(vocab->n_vocab));
  auto re = [](const std::string& p) { return "root ::= " + regex_to_gbnf(p) + "\n"; };
  GrammarMatcher m(std::make_shared<CompiledGrammar>(Grammar::parse_gbnf(re("(((((a?){0,8}){0,8}){0,8}){0,8}){0,8}")), vocab));
  int accepted = 0;
  try {
    for (; accepted < 4096; ++accepted) {
      m.fill_next_token_bitmask(mask);
      ASSERT_TRUE(mask[0] & 1u) << accepted;  // "a" allowed
      ASSERT_TRUE(m.accept_token(0)) << accepted;
    }
    ADD_FAILURE() << "no error after " << accepted << " tokens";
  } catch (const GrammarError& e) {
    EXPECT_NE(std::string(e.what()).find("too ambiguous"), std::string::npos) << e.what();
    EXPECT_GE(accepted, 16);  // short texts of it still match
  }
  std::string choice = "root ::= ";
  for (int i = 0; i < 10000; ++i) {
    char b[16];
    std::snprintf(b, sizeof b, "\"item%04d\"", i);
    choice += (i > 0 ? " | " : "") + std::string(b);
  }
  GrammarMatcher c(std::make_shared<CompiledGrammar>(Grammar::parse_gbnf(choice), vocab));
  for (const int id : {1, 2 + 4, 2 + 2, 2 + 9, 2 + 1}) {  // "item", "4", "2", "9", "1"
    c.fill_next_token_bitmask(mask);
    ASSERT_TRUE(mask[0] & (1u << id)) << id;
    ASSERT_TRUE(c.accept_token(id)) << id;
  }
  EXPECT_TRUE(c.can_end());
}

// Groups nested deeper than the parsers' bound, and rules nested deeper than the rewrite's, are
// errors, not a stack overflow.
TEST(Grammar, DeeplyNestedGroupsAreRefused) {
  const int depth = 20000;
  for (const std::string& err :
       {grammar_error_of([&] { Grammar::parse_gbnf("root ::= " + std::string(depth, '(') + "\"a\"" + std::string(depth, ')')); }),
        grammar_error_of([&] { regex_to_gbnf(std::string(depth, '(') + "a" + std::string(depth, ')')); })})
    EXPECT_NE(err.find("nested deeper than 1000"), std::string::npos) << err;
  expect_language("root ::= " + std::string(1000, '(') + "\"a\"" + std::string(1000, ')'), {"a"}, {"", "aa"});
  // A repetition of a chain of 100,000 rules that can each be empty: rewriting it over its
  // non-empty strings would recurse once per rule.
  std::string chain = "root ::= (x0)*\n";
  for (int i = 0; i < 100000; ++i) chain += "x" + std::to_string(i) + " ::= \"a\"? x" + std::to_string(i + 1) + "\n";
  chain += "x100000 ::= \"b\"?\n";
  const std::string deep_forms = grammar_error_of([&] { Grammar::parse_gbnf(chain); });
  EXPECT_NE(deep_forms.find("more than 2000 nested rules"), std::string::npos) << deep_forms;
}

// Random regexes over {a, b} built from concatenation, alternation (with empty branches), groups
// and *, +, ? nested freely (so repetitions of parts that can be empty come often), each against
// the set semantics of the regex tree (a span matches a star if it is empty or splits into a
// non-empty match of the part and a match of the star) on every string of length 0 to 5: the same
// language. Fixed seed. (std::regex backtracks exponentially on such nests.)
TEST(Grammar, RandomRegexesAgreeWithTheirSetSemantics) {
  struct Node {
    char op;  // 'a', 'b', 'e' (empty), '.' (concatenation), '|', '*', '+', '?'
    std::unique_ptr<Node> l, r;
  };
  std::mt19937 rng(20261206);
  std::function<std::unique_ptr<Node>(int, std::string&)> gen = [&](int depth, std::string& p) {
    auto n = std::make_unique<Node>();
    switch (rng() % (depth > 0 ? 7 : 3)) {
      case 0: n->op = 'a', p += "a"; break;
      case 1: n->op = 'b', p += "b"; break;
      case 2: n->op = 'e', p += "(?:)"; break;
      case 3: n->op = '.', n->l = gen(depth - 1, p), n->r = gen(depth - 1, p); break;
      case 4:
        n->op = '|';
        p += "(?:";
        n->l = gen(depth - 1, p);
        p += "|";
        if (rng() % 3 == 0) {
          n->r = std::make_unique<Node>(Node{'e', nullptr, nullptr});
        } else {
          n->r = gen(depth - 1, p);
        }
        p += ")";
        break;
      default:
        n->op = "*+?"[rng() % 3];
        p += "(?:";
        n->l = gen(depth - 1, p);
        p += std::string(")") + n->op;
    }
    return n;
  };
  // Whether node n matches text[i, j); star: empty, or a non-empty match of the part and then
  // the star again; plus: a match of the part (maybe empty) and then the star.
  std::function<bool(const Node&, const std::string&, size_t, size_t)> in;
  std::function<bool(const Node&, const std::string&, size_t, size_t)> star = [&](const Node& part, const std::string& t,
                                                                                  size_t i, size_t j) {
    if (i == j) return true;
    for (size_t k = i + 1; k <= j; ++k)
      if (in(part, t, i, k) && star(part, t, k, j)) return true;
    return false;
  };
  in = [&](const Node& n, const std::string& t, size_t i, size_t j) -> bool {
    switch (n.op) {
      case 'a':
      case 'b': return j == i + 1 && t[i] == n.op;
      case 'e': return i == j;
      case '.':
        for (size_t k = i; k <= j; ++k)
          if (in(*n.l, t, i, k) && in(*n.r, t, k, j)) return true;
        return false;
      case '|': return in(*n.l, t, i, j) || in(*n.r, t, i, j);
      case '?': return i == j || in(*n.l, t, i, j);
      case '*': return star(*n.l, t, i, j);
      default:  // '+'
        for (size_t k = i; k <= j; ++k)
          if (in(*n.l, t, i, k) && star(*n.l, t, k, j)) return true;
        return false;
    }
  };
  std::vector<std::string> strings = {""};
  for (size_t begin = 0, len = 1; len <= 5; ++len) {
    const size_t end = strings.size();
    for (size_t i = begin; i < end; ++i)
      for (char c : {'a', 'b'}) strings.push_back(strings[i] + c);
    begin = end;
  }
  for (int n = 0; n < 300; ++n) {
    std::string pattern;
    const auto tree = gen(4, pattern);
    const auto cg = compile("root ::= " + regex_to_gbnf(pattern) + "\n");
    for (const std::string& text : strings)
      ASSERT_EQ(matches(cg, text), in(*tree, text, 0, text.size())) << "'" << text << "' under " << pattern;
  }
}

TEST(Grammar, RegexSubset) {
  auto re = [](const std::string& p) { return "root ::= " + regex_to_gbnf(p) + "\n"; };
  expect_language(re("^\\d{2,3}-(ab|c)*$"), {"12-", "123-abc", "12-ababc"}, {"1-ab", "1234-", "12-a"});
  expect_language(re("[^a-c]x?|\\w+@\\w+\\.com"), {"d", "dx", "a_1@b.com", "é"}, {"ax", "a@b.co", ""});
  expect_language(re("(?:a|b)+?c{1}\\s\\S"), {"abc x", "bc\t1"}, {"c x", "abc  "});
  for (const auto& [p, kw] : std::vector<std::pair<std::string, std::string>>{
           {"a(?=b)", "lookahead"}, {"(?<!a)b", "lookbehind"}, {"(a)\\1", "backreference"},
           {"\\bword", "word boundary"}, {"a^b", "anchor"}, {"a*+", "possessive quantifier"}, {"\\p{L}", "unicode property"}}) {
    try {
      regex_to_gbnf(p);
      ADD_FAILURE() << "no error for " << p;
    } catch (const GrammarError& e) {
      EXPECT_EQ(e.keyword(), kw) << p;
    }
  }
}

TEST(Grammar, JsonSchemaObjectsArraysRefs) {
  expect_language(schema_gbnf(R"({"type":"object","properties":{"a":{"type":"integer","minimum":-5,"maximum":120},
      "b":{"type":"string","maxLength":3}},"required":["a"]})"),
                  {R"({"a":5})", R"({"a":-5,"b":"xyz"})", R"({"a":1,"c":null})", R"({"a":1,"b":"x","zz":[1,{}]})",
                   R"({"0":true,"a":120})"},
                  {R"({"a":121})", R"({"a":1,"b":"xyzw"})", R"({"b":"x"})", R"({"a":1,"a":2})", R"({"a":-6})", R"({"a":05})"});
  expect_language(schema_gbnf(R"({"$defs":{"n":{"type":"object","properties":{"v":{"type":"integer"},
      "next":{"$ref":"#/$defs/n"}},"required":["v"],"additionalProperties":false}},"$ref":"#/$defs/n"})"),
                  {R"({"v":1,"next":{"v":2,"next":{"v":3}}})", R"({"v":-0})"}, {R"({"v":1,"next":{}})", R"({"v":1,"w":2})"});
  expect_language(schema_gbnf(R"({"type":"array","items":[{"type":"integer"},{"type":"string"}],"additionalItems":false,"minItems":1})"),
                  {"[1]", "[1,\"a\"]"}, {"[]", "[1,\"a\",2]", "[\"a\"]"});
  expect_language(schema_gbnf(R"({"type":"array","prefixItems":[{"const":"k"}],"items":{"type":"boolean"},"maxItems":3})"),
                  {"[]", "[\"k\"]", "[\"k\",true,false]"}, {"[\"k\",true,false,true]", "[true]"});
  expect_language(schema_gbnf(R"({"type":"array","items":{"enum":["x",1,null]},"minItems":2,"maxItems":3})"),
                  {"[\"x\",1]", "[1,1,null]"}, {"[1]", "[1,1,1,1]", "[2,1]", "[1,1.0]"});
  // JSON Schema counts 1.0 as the integer 1: accepted on request (the test suite's instances).
  JsonSchemaOptions frac;
  frac.integral_fraction = true;
  expect_language(schema_gbnf(R"({"type":"array","items":{"enum":["x",1,null]},"minItems":2,"maxItems":3})", frac),
                  {"[1,1.0,null]", "[1,1.00]"}, {"[1,1.]", "[1,1.5]"});
  expect_language(schema_gbnf(R"({"type":"integer","minimum":2})", frac), {"2", "2.0", "30.00"}, {"1.0", "2.5"});
  expect_language(schema_gbnf(R"({"type":"integer"})"), {"2", "-0"}, {"2.0", "2.5"});
}

TEST(Grammar, JsonSchemaStringsNumbersCombinators) {
  expect_language(schema_gbnf(R"({"type":"string","pattern":"^[a-z]+\\d$"})"), {"\"abc1\""}, {"\"ab\"", "\"Ab1\""});
  expect_language(schema_gbnf(R"({"type":"string","pattern":"\\d"})"), {"\"ab1c\"", "\"a\\\"1\""}, {"\"ab\""});
  expect_language(schema_gbnf(R"({"type":"string","format":"date-time"})"), {"\"2024-01-31T10:20:30.5+01:00\""},
                  {"\"2024-13-01T00:00:00Z\"", "\"2024-01-01\""});
  // Real calendar days only (Python's jsonschema checks dates with datetime.date): month lengths,
  // February 29 in leap years, no year 0000.
  expect_language(schema_gbnf(R"({"type":"string","format":"date"})"),
                  {"\"2024-02-29\"", "\"2000-02-29\"", "\"0004-02-29\"", "\"2023-02-28\"", "\"2023-04-30\"",
                   "\"2023-12-31\"", "\"0001-01-01\"", "\"9999-12-31\"", "\"1996-02-29\""},
                  {"\"2023-02-29\"", "\"1900-02-29\"", "\"2100-02-29\"", "\"2023-04-31\"", "\"2023-02-30\"",
                   "\"0000-01-01\"", "\"2023-11-31\"", "\"2023-06-00\""});
  {  // Every month and day number of years around the leap rules, against std::chrono's calendar.
    auto cg = compile(schema_gbnf(R"({"type":"string","format":"date"})"));
    for (int y : {1, 4, 100, 400, 1900, 1996, 2000, 2023, 2024, 2100, 9999})
      for (unsigned m = 0; m <= 13; ++m)
        for (unsigned d = 0; d <= 32; ++d) {
          char text[32];
          std::snprintf(text, sizeof text, "\"%04d-%02u-%02u\"", y, m, d);
          const bool real = std::chrono::year_month_day{std::chrono::year{y}, std::chrono::month{m}, std::chrono::day{d}}.ok();
          EXPECT_EQ(matches(cg, text), real) << text;
        }
  }
  expect_language(schema_gbnf(R"({"type":"string","format":"uuid"})"), {"\"123e4567-e89b-12d3-a456-426614174000\""},
                  {"\"123e4567e89b12d3a456426614174000\""});
  expect_language(schema_gbnf(R"({"type":"string","minLength":2,"maxLength":3})"), {"\"ab\"", "\"é\\n\"", "\"abc\""},
                  {"\"a\"", "\"abcd\""});
  expect_language(schema_gbnf(R"({"type":"integer","exclusiveMinimum":9,"maximum":1234})"), {"10", "99", "1234", "1000"},
                  {"9", "1235", "-1", "1e3"});
  expect_language(schema_gbnf(R"({"type":"integer","minimum":-120,"maximum":-7})"), {"-7", "-120", "-99"},
                  {"-6", "-121", "7", "-0"});
  expect_language(schema_gbnf(R"({"type":"number"})"), {"0", "-1.5e+3", "2.0"}, {"01", "1.", ".5", "+1"});
  expect_language(schema_gbnf(R"({"anyOf":[{"type":"string"},{"type":"null"}]})"), {"\"x\"", "null"}, {"1"});
  expect_language(schema_gbnf(R"({"allOf":[{"type":"object","properties":{"a":{"type":"integer"}}},
      {"required":["a"]}]})"),
                  {R"({"a":1})"}, {"{}", R"({"a":"x"})"});
  expect_language(schema_gbnf(R"({"enum":["a\"b",{"k":[1]},2.5]})"), {"\"a\\\"b\"", R"({"k":[1]})", "2.5"}, {"\"ab\"", "2"});
  JsonSchemaOptions ws;
  ws.any_whitespace = true;
  expect_language(schema_gbnf(R"({"type":"object","properties":{"a":{"type":"array"}},"additionalProperties":false})", ws),
                  {"{ \"a\" : [ 1 , 2 ] }", "{}"}, {"{ \"b\": 1}"});
}

// An enum of more than 64 values compiles as a prefix tree of rules (json_schema.cpp): the same
// language as the plain alternation, values that are prefixes of others included, branches that
// split inside the shared bytes of a UTF-8 character (é, è: C3 A9, C3 A8), duplicates, and, with
// integral_fraction, the values that are not plain literals (integers with an optional ".0") kept
// beside the tree.
TEST(Grammar, JsonSchemaLargeEnumIsAPrefixTreeOfTheSameLanguage) {
  nlohmann::ordered_json values = nlohmann::ordered_json::array();
  std::vector<std::string> yes;
  for (int i = 0; i < 150; ++i) {
    const std::string v = "k" + std::to_string(i);  // k1 is a prefix of k10..k19 and k100..k149
    values.push_back(v);
    yes.push_back("\"" + v + "\"");
  }
  for (const char* v : {"é", "è", "éa", "éb", "pé", "pè", "a\"q", "k7"}) values.push_back(std::string(v));
  for (const char* v : {"\"é\"", "\"è\"", "\"éa\"", "\"éb\"", "\"pé\"", "\"pè\"", "\"a\\\"q\""}) yes.push_back(v);
  for (int v : {3, 30, 300, 31}) values.push_back(v);  // 3 is a prefix of 30, 300 and 31
  values.push_back(nullptr);
  for (const char* v : {"3", "30", "300", "31", "null"}) yes.push_back(v);
  nlohmann::ordered_json schema = {{"enum", values}};
  const std::string gbnf = json_schema_to_gbnf(schema, {});
  EXPECT_GT(std::count(gbnf.begin(), gbnf.end(), '\n'), 20) << "expected a tree of rules:\n" << gbnf;
  expect_language(gbnf, yes, {"\"k\"", "\"k150\"", "\"k1000\"", "\"k01\"", "\"é\"x", "\"\"", "\"a\"", "4", "\"ék\"", "\"p\"", "3000", "32"});
  JsonSchemaOptions frac;
  frac.integral_fraction = true;
  expect_language(json_schema_to_gbnf(schema, frac), {"3", "3.0", "30.0", "\"k149\""}, {"3.1", "\"k150\""});
}

TEST(Grammar, JsonSchemaOneOfCompilesOnlyWhenItsBranchesAreExclusive) {
  // A discriminated union: both branches require "kind" with different consts, so no object
  // matches both and the alternation is exact.
  const std::string shapes = R"({"oneOf":[
      {"type":"object","properties":{"kind":{"const":"c"},"r":{"type":"integer"}},"required":["kind","r"],
       "additionalProperties":false},
      {"type":"object","properties":{"kind":{"enum":["s","q"]},"w":{"type":"integer"}},"required":["kind","w"],
       "additionalProperties":false}]})";
  expect_language(schema_gbnf(shapes), {R"({"kind":"c","r":1})", R"({"kind":"q","w":2})"},
                  {R"({"kind":"c","w":1})", R"({"kind":"x","r":1})", R"({"r":1})"});
  // Branches of disjoint types are exclusive too.
  expect_language(schema_gbnf(R"({"oneOf":[{"type":"string"},{"type":"integer"}]})"), {"\"a\"", "3"}, {"null"});
  // "kind" required by one branch only: {"kind":"c","r":1,...} cannot be told apart, so refused.
  for (const char* schema : {R"({"oneOf":[{"type":"integer"},{"minimum":2}]})",
                             R"({"oneOf":[{"type":"object","properties":{"kind":{"const":"a"}},"required":["kind"]},
                                          {"type":"object","properties":{"kind":{"const":"b"}}}]})"}) {
    try {
      schema_gbnf(schema);
      ADD_FAILURE() << "no error for " << schema;
    } catch (const GrammarError& e) {
      EXPECT_NE(std::string(e.what()).find("oneOf"), std::string::npos) << e.what();
    }
  }
  JsonSchemaOptions loose;
  loose.oneof_as_anyof = true;
  expect_language(schema_gbnf(R"({"oneOf":[{"type":"integer"},{"type":"integer","minimum":2}]})", loose), {"1", "3"},
                  {"\"a\""});
}

TEST(Grammar, JsonSchemaUnsupportedKeywordsAreErrors) {
  JsonSchemaOptions strict;
  strict.oneof_as_anyof = false;
  for (const auto& [schema, kw] : std::vector<std::pair<std::string, std::string>>{
           {R"({"type":"array","uniqueItems":true})", "uniqueItems"},
           {R"({"type":"number","multipleOf":2})", "multipleOf"},
           {R"({"not":{"type":"string"}})", "not"},
           {R"({"type":"number","minimum":1.5})", "minimum"},
           {R"({"$ref":"http://example.com/s.json"})", "$ref"},
           {R"({"patternProperties":{"^a":{}}})", "patternProperties"},
           {R"({"type":"string","format":"hostname"})", "format"},
           {R"({"oneOf":[{"type":"integer"},{"minimum":2}]})", "oneOf"},
           {R"({"type":[]})", "type"}}) {
    try {
      schema_gbnf(schema, strict);
      ADD_FAILURE() << "no error for " << schema;
    } catch (const GrammarError& e) {
      EXPECT_EQ(e.keyword(), kw) << schema << ": " << e.what();
    }
  }
  // Branches of different types are exclusive, so oneOf stays supported for them.
  EXPECT_NO_THROW(schema_gbnf(R"({"oneOf":[{"type":"integer"},{"type":"string"}]})", strict));
  // Annotations are ignored.
  EXPECT_NO_THROW(schema_gbnf(R"({"title":"t","description":"d","examples":[1],"default":2,"$schema":"x","type":"integer"})"));
}

TEST(Grammar, MultiByteTokensSplitCharactersAndRollback) {
  auto cg = compile("root ::= \"{\\\"\" [a-zé]+ \"\\\":\" [0-9]+ \",\\\"\" \"x\" \"\\\"}\"");
  const TokenVocab& v = cg->vocab();
  auto id_of = [&](const std::string& b) {
    for (int32_t i = 0; i < v.n_vocab; ++i)
      if (v.bytes[static_cast<size_t>(i)] == b) return i;
    return -1;
  };
  GrammarMatcher m(cg);
  std::vector<uint32_t> mask(bitmask_words(v.n_vocab));
  auto allowed = [&](int32_t id) {
    m.fill_next_token_bitmask(mask);
    return ((mask[static_cast<size_t>(id) / 32] >> (id % 32)) & 1u) != 0;
  };
  EXPECT_TRUE(allowed(id_of("{\"")));
  EXPECT_FALSE(allowed(id_of("ab")));
  EXPECT_FALSE(allowed(0));  // EOS only once the grammar can end
  ASSERT_TRUE(m.accept_token(id_of("{\"")));
  EXPECT_TRUE(allowed(id_of("abc")));
  EXPECT_TRUE(allowed(0xC3));   // the first byte of é
  EXPECT_FALSE(allowed(0xC4));  // a character no class position holds
  ASSERT_TRUE(m.accept_token(0xC3));
  EXPECT_TRUE(allowed(0xA9));
  EXPECT_FALSE(allowed(0xAA));  // U+00EA is not in [a-zé]
  EXPECT_FALSE(allowed('a'));
  ASSERT_TRUE(m.accept_token(0xA9));
  EXPECT_TRUE(allowed(id_of("\":")));
  ASSERT_TRUE(m.accept_token(id_of("\":")));
  EXPECT_TRUE(allowed(id_of("12")));
  EXPECT_TRUE(allowed(id_of("1,\"")));  // crosses from the digits into the next literal
  ASSERT_TRUE(m.accept_token(id_of("1,\"")));
  ASSERT_TRUE(m.accept_token('x'));
  EXPECT_FALSE(m.can_end());
  ASSERT_TRUE(m.accept_token(id_of("\"}")));
  EXPECT_TRUE(m.can_end());
  EXPECT_TRUE(allowed(0));
  m.rollback(2);
  EXPECT_FALSE(m.can_end());
  EXPECT_FALSE(m.accept_token('y'));
  EXPECT_TRUE(m.accept_token('x'));
  EXPECT_TRUE(m.accept_token(id_of("\"}")));
  EXPECT_TRUE(m.is_terminated());
  EXPECT_TRUE(m.accept_token(0));
  EXPECT_FALSE(m.accept_token('x'));
  m.rollback(1);
  EXPECT_FALSE(m.accept_token('x'));  // still at the end of the grammar, but EOS undone
  EXPECT_TRUE(m.accept_token(0));
}

TEST(Grammar, ConstraintsAndTheirCache) {
  GrammarCache cache(test_vocab(), 2);
  Constraint choice;
  choice.kind = ConstraintKind::CHOICE;
  choice.choices = {"ab", "abc", "x\"y"};
  auto g = cache.get(choice);
  EXPECT_EQ(cache.get(choice), g);  // the same grammar object, splits already computed
  EXPECT_TRUE(matches(g, "ab"));
  EXPECT_TRUE(matches(g, "x\"y"));
  EXPECT_FALSE(matches(g, "a"));
  Constraint re;
  re.kind = ConstraintKind::REGEX;
  re.text = "[0-9]+";
  EXPECT_TRUE(matches(cache.get(re), "123"));
  Constraint obj;
  obj.kind = ConstraintKind::JSON_OBJECT;
  EXPECT_TRUE(matches(cache.get(obj), R"({"a":[1,{"b":null}]})"));
  EXPECT_FALSE(matches(cache.get(obj), "[1]"));
  EXPECT_NE(cache.get(choice), g);  // evicted (capacity 2), compiled again
  Constraint bad;
  bad.kind = ConstraintKind::JSON_SCHEMA;
  bad.text = "{not json";
  try {
    cache.get(bad);
    ADD_FAILURE() << "no error for a schema that is not JSON";
  } catch (const GrammarError& e) {
    EXPECT_EQ(e.keyword(), "json");
  }
  Constraint none;
  none.kind = ConstraintKind::CHOICE;
  EXPECT_THROW(compile_constraint(none), GrammarError);
  // A $ref cycle that consumes nothing is named as the schema's, not as a GBNF rule.
  for (const char* text : {R"({"$ref": "#"})", R"({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                                                  "$ref": "#/$defs/a"})"}) {
    Constraint cycle;
    cycle.kind = ConstraintKind::JSON_SCHEMA;
    cycle.text = text;
    try {
      compile_constraint(cycle);
      ADD_FAILURE() << "no error for " << text;
    } catch (const GrammarError& e) {
      EXPECT_EQ(e.keyword(), "$ref") << text;
      EXPECT_NE(std::string(e.what()).find("a $ref cycle"), std::string::npos) << e.what();
    }
  }
}

// Matchers of one grammar on several threads, every split computed for the first time while other
// threads need it or others (position_masks computes outside the grammar's lock): each thread's
// masks equal those of one matcher alone on a grammar of its own.
TEST(Grammar, MatchersOnManyThreadsShareSplitsAndGiveTheSameMasks) {
  const std::string gbnf = schema_gbnf(
      R"({"type": "object", "properties": {"name": {"type": "string", "maxLength": 24}, "tags": {"type": "array",
          "items": {"type": "string", "minLength": 2, "maxLength": 6}}}, "required": ["name", "tags"],
          "additionalProperties": false})");
  const std::string text = R"({"name":"abcdefghijklmnopqrstu","tags":["ab","abc12","xyz"]})";
  auto masks_of = [&](const std::shared_ptr<const CompiledGrammar>& cg, size_t shift) {
    // Yields once at byte `shift`, so that the threads drift apart and meet the splits in different orders.
    GrammarMatcher m(cg);
    std::vector<uint32_t> mask(bitmask_words(cg->vocab().n_vocab));
    std::vector<std::vector<uint32_t>> out;
    for (size_t i = 0; i < text.size(); ++i) {
      if (i == shift % text.size()) std::this_thread::yield();
      m.fill_next_token_bitmask(mask);
      out.push_back(mask);
      EXPECT_TRUE(m.accept_token(static_cast<unsigned char>(text[i]))) << "byte " << i;
    }
    return out;
  };
  const auto reference = masks_of(compile(gbnf), 0);
  auto shared = compile(gbnf);
  constexpr int kThreads = 8;
  std::vector<std::vector<std::vector<uint32_t>>> got(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] { got[static_cast<size_t>(t)] = masks_of(shared, static_cast<size_t>(t) * 7); });
  for (auto& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) {
    ASSERT_EQ(got[static_cast<size_t>(t)].size(), reference.size());
    for (size_t i = 0; i < reference.size(); ++i)
      EXPECT_EQ(got[static_cast<size_t>(t)][i], reference[i]) << "thread " << t << ", before byte " << i;
  }
  EXPECT_GT(shared->n_splits(), 10u);
}

// Long bounded repetitions share the split of their capped link (CompiledGrammar's chain cap).
// With a cap of 3 and tokens of up to 14 bytes, walks through strings of maxLength 20, a
// {2,15} pattern, an array of at most 9 items and a repeated group: at every step the mask is
// exactly the set of tokens accept_token takes (each token tried and rolled back), the same as
// with the sharing off, and the chains cost fewer splits.
TEST(Grammar, CappedChainLinksKeepTheMasksExact) {
  std::vector<std::string> bytes(256);
  for (int i = 1; i < 256; ++i) bytes[static_cast<size_t>(i)] = std::string(1, static_cast<char>(i));
  for (const char* t : {"ab", "abc", "abcd", "aaaaaaa", "abababababab", "bbbbbbbbbbbbb\"", "a\"", "abc\",\"", "\",\"",
                        "\"]", "\"],\"n\":", "cccccc\"]}", "xyzxyzxyzxyzxy", "12", "1234567", "\"ab\",\"ab\",\"",
                        "{\"s\":\"", "ab_cd", "a_b_c_d_e_f", "abcabc", "abcabcabcabc"})
    bytes.push_back(t);
  auto vocab = TokenVocab::from_bytes(std::move(bytes), 0);
  const std::vector<std::string> grammars = {
      schema_gbnf(R"({"type": "object", "properties": {"s": {"type": "string", "maxLength": 20},
          "id": {"type": "string", "pattern": "^[a-z][a-z0-9_]{2,15}$"},
          "t": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 9},
          "n": {"type": "integer"}}, "required": ["s", "id", "t", "n"], "additionalProperties": false})"),
      // A repeated group inside a star, and a repetition whose item can be empty.
      "root ::= \"<\" ((\"ab\" | \"c\"){0,12} \",\")* (\"a\"? \"b\"?){1,11} \">\"",
  };
  size_t steps = 0;
  for (const std::string& gbnf : grammars) {
    auto capped = std::make_shared<CompiledGrammar>(Grammar::parse_gbnf(gbnf), vocab, 3);
    auto plain = std::make_shared<CompiledGrammar>(Grammar::parse_gbnf(gbnf), vocab, 0);
    const int32_t n_vocab = vocab->n_vocab;
    uint64_t rng = 12345;
    for (int walk = 0; walk < 40; ++walk) {
      GrammarMatcher m(capped), p(plain);
      std::vector<uint32_t> mask(bitmask_words(n_vocab)), mask_plain(mask.size());
      for (int step = 0; step < 60 && !m.is_terminated(); ++step, ++steps) {
        m.fill_next_token_bitmask(mask);
        p.fill_next_token_bitmask(mask_plain);
        ASSERT_EQ(mask, mask_plain) << "walk " << walk << ", step " << step << " of\n" << gbnf;
        std::vector<int32_t> ok;
        for (int32_t id = 0; id < n_vocab; ++id) {
          const bool in_mask = (mask[static_cast<size_t>(id) / 32] >> (id % 32)) & 1u;
          const bool takes = m.accept_token(id);
          if (takes) {
            m.rollback(1);
            ok.push_back(id);
          }
          ASSERT_EQ(in_mask, takes) << "token '" << vocab->bytes[static_cast<size_t>(id)] << "', walk " << walk
                                    << ", step " << step << " of\n" << gbnf;
        }
        ASSERT_FALSE(ok.empty());
        // Favour long tokens so that walks run deep into the chains; end a walk now and then.
        int32_t pick = ok[next_draw(rng) % ok.size()];
        for (int tries = 0; tries < 3; ++tries) {
          int32_t other = ok[next_draw(rng) % ok.size()];
          if (vocab->bytes[static_cast<size_t>(other)].size() > vocab->bytes[static_cast<size_t>(pick)].size()) pick = other;
        }
        if (ok[0] == 0 && next_draw(rng) % 8 == 0) pick = 0;
        ASSERT_TRUE(m.accept_token(pick));
        ASSERT_TRUE(p.accept_token(pick));
      }
    }
    EXPECT_LT(capped->n_splits(), plain->n_splits()) << gbnf;
  }
  EXPECT_GT(steps, 2000u);
}

// CompiledGrammar::precompute_splits visits every stack a matcher can reach: after it, walks
// through a non-recursive schema (strings bounded past the chain cap, an array, numbers) compute
// no split of their own, and their masks equal those of the same grammar computed on demand. On
// a recursive grammar it stops at its bound. SplitPrefetcher runs it in the background, once per
// grammar.
TEST(Grammar, PrecomputedSplitsCoverEveryStackAWalkReaches) {
  const std::string gbnf = schema_gbnf(
      R"({"type": "object", "properties": {"name": {"type": "string", "maxLength": 40}, "tags": {"type": "array",
          "items": {"type": "string", "minLength": 2, "maxLength": 6}, "maxItems": 4}, "n": {"type": "integer"},
          "kind": {"enum": ["a", "bc"]}}, "required": ["name", "tags", "n", "kind"], "additionalProperties": false})");
  auto pre = compile(gbnf);
  auto lazy = compile(gbnf);
  const size_t visited = pre->precompute_splits(CompiledGrammar::kPrecomputeStacks);
  EXPECT_LT(visited, CompiledGrammar::kPrecomputeStacks);  // all of them: the grammar is finite
  const size_t splits = pre->n_splits();
  EXPECT_GT(splits, 20u);
  const int32_t n_vocab = pre->vocab().n_vocab;
  uint64_t rng = 99;
  size_t steps = 0;
  for (int walk = 0; walk < 30; ++walk) {
    GrammarMatcher m(pre), l(lazy);
    std::vector<uint32_t> mask(bitmask_words(n_vocab)), mask_lazy(mask.size());
    for (int step = 0; step < 80 && !m.is_terminated(); ++step, ++steps) {
      m.fill_next_token_bitmask(mask);
      l.fill_next_token_bitmask(mask_lazy);
      ASSERT_EQ(mask, mask_lazy) << "walk " << walk << ", step " << step;
      const std::vector<int32_t> ok = allowed_ids(mask, n_vocab);
      ASSERT_FALSE(ok.empty());
      const int32_t pick = ok[next_draw(rng) % ok.size()];
      ASSERT_TRUE(m.accept_token(pick));
      ASSERT_TRUE(l.accept_token(pick));
    }
  }
  EXPECT_GT(steps, 500u);
  EXPECT_EQ(pre->n_splits(), splits) << "a walk met a stack precompute_splits did not visit";
  EXPECT_GT(lazy->n_splits(), 0u);

  auto recursive = compile("root ::= \"[\" (root (\",\" root)*)? \"]\" | [0-9]+");
  EXPECT_EQ(recursive->precompute_splits(500), 500u);

  // Three grammars on two prefetch threads: each computed whole, once.
  std::vector<std::shared_ptr<const CompiledGrammar>> queued = {compile(gbnf), compile(gbnf), compile(gbnf)};
  {
    SplitPrefetcher prefetcher(CompiledGrammar::kPrecomputeStacks, 2);
    for (const auto& q : queued) prefetcher.add(q);
    prefetcher.add(queued[0]);  // once only
    const auto all_done = [&] {
      return std::all_of(queued.begin(), queued.end(), [&](const auto& q) { return q->n_splits() >= splits; });
    };
    for (int i = 0; i < 2000 && !all_done(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  for (const auto& q : queued) {
    EXPECT_EQ(q->n_splits(), splits);
    EXPECT_FALSE(q->claim_precompute());
  }
}

TEST(Grammar, ApplyBitmaskBlocksClearedBits) {
  std::vector<float> logits(40, 1.0f);
  std::vector<uint32_t> mask = {0x5u, 0x80u};  // ids 0, 2 and 39
  apply_token_bitmask(logits, mask);
  for (size_t i = 0; i < logits.size(); ++i) EXPECT_EQ(std::isinf(logits[i]), i != 0 && i != 2 && i != 39) << i;
}

}  // namespace
}  // namespace kestrel::grammar
