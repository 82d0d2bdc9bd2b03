// A context-free grammar over Unicode code points, the form every structured-output constraint
// (GBNF text, regular expressions, choice lists, JSON Schema) is compiled to before matching.
//
// Rules are alternatives of sequences; each sequence element is either a character class (a set
// of code point ranges, possibly negated) or a reference to a rule. Repetition is written out as
// right-recursive helper rules (x* becomes R ::= x R | empty), so the matcher (matcher.h) only
// steps over classes and references. All alternatives live in one flat element array: a position
// is an index into it, and every alternative ends with an END element.
//
// Text syntax: llama.cpp's GBNF (grammars/README.md in llama.cpp): `name ::= body`, literals
// "..." with \n \r \t \\ \" \xHH \uHHHH \UHHHHHHHH escapes, classes [a-z] [^"\\] with the same
// escapes, `.` (any code point), groups ( ), postfix * + ? {m} {m,} {m,n}, `|`, `#` comments.
// The start rule is `root`.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/error.h"

namespace kestrel::grammar {

// A grammar, regex or schema the compiler cannot take. keyword: the construct at fault (a JSON
// Schema keyword such as "uniqueItems", a regex construct such as "lookahead", or "gbnf" for
// syntax errors); the server turns this error into a 400 that names it.
class GrammarError : public Error {
 public:
  GrammarError(std::string keyword, const std::string& what) : Error(what), keyword_(std::move(keyword)) {}
  const std::string& keyword() const { return keyword_; }

 private:
  std::string keyword_;
};

// A rule that can reach itself without consuming input (the matcher could not expand it).
class LeftRecursionError : public GrammarError {
 public:
  explicit LeftRecursionError(const std::string& rule)
      : GrammarError("gbnf", "gbnf: rule '" + rule +
                                 "' is left-recursive (it can reach itself without consuming input); "
                                 "write it right-recursively") {}
};

struct CharClass {
  std::vector<std::pair<uint32_t, uint32_t>> ranges;  // inclusive code point ranges
  bool negated = false;
  bool contains(uint32_t cp) const {
    bool in = false;
    for (const auto& [lo, hi] : ranges) in |= (cp >= lo && cp <= hi);
    return in != negated;
  }
  // Whether some code point in [lo, hi] is in the class (for a partly decoded UTF-8 character).
  bool intersects(uint32_t lo, uint32_t hi) const;
};

enum class ElementKind : uint8_t { END, CLASS, RULE };

struct Element {
  ElementKind kind;
  uint32_t index;  // CLASS: into Grammar::classes; RULE: into Grammar::rules; END: the owning rule
};

struct Rule {
  std::string name;
  std::vector<uint32_t> alternatives;  // start positions in Grammar::elements
};

struct Grammar {
  std::vector<Rule> rules;
  std::vector<CharClass> classes;
  std::vector<Element> elements;
  uint32_t root = 0;
  // The rule each element belongs to ([elements.size()]).
  std::vector<uint32_t> element_rule;
  // Bounded repetitions x{m,n} (n > m), written out as nested optional rules: chains[c][d - 1] is
  // the rule of chain c that allows d more repetitions (R_1 ::= x | empty, R_d ::= x R_{d-1} |
  // empty). Every R_d with d >= 2 has the same element layout, which lets the matcher share one
  // token split between the links of a long chain (CompiledGrammar's chain cap).
  std::vector<std::vector<uint32_t>> chains;

  // Parses GBNF text (see the file comment). Errors: GrammarError("gbnf", ...) naming the line
  // and column for a syntax error, an undefined rule, a missing `root`, or a left-recursive rule
  // (the stack matcher cannot run one; rewrite it right-recursively).
  static Grammar parse_gbnf(std::string_view text);
};

// GBNF text helpers for the compilers that emit grammar text.
std::string gbnf_literal(std::string_view utf8);  // "..." with escapes
std::string gbnf_codepoint_escape(uint32_t cp);    // one code point, escaped for use inside [ ] or " "

}  // namespace kestrel::grammar
