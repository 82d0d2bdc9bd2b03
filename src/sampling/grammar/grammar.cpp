// GBNF parser and the checks a stack matcher needs (defined rules, no left recursion).
#include "sampling/grammar/grammar.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <functional>
#include <map>
#include <unordered_map>

#include "tokenizer/utf8.h"

namespace kestrel::grammar {

bool CharClass::intersects(uint32_t lo, uint32_t hi) const {
  if (!negated) {
    for (const auto& [a, b] : ranges)
      if (a <= hi && b >= lo) return true;
    return false;
  }
  // Negated: some code point of [lo, hi] lies outside every range. Walk [lo, hi] past the ranges
  // that cover its current start (ranges are few, so the quadratic walk is fine).
  uint32_t at = lo;
  for (bool moved = true; moved;) {
    moved = false;
    for (const auto& [a, b] : ranges) {
      if (a <= at && b >= at) {
        if (b >= hi) return false;
        at = b + 1;
        moved = true;
      }
    }
  }
  return at <= hi;
}

std::string gbnf_codepoint_escape(uint32_t cp) {
  char buf[16];
  switch (cp) {
    case '\n': return "\\n";
    case '\r': return "\\r";
    case '\t': return "\\t";
    case '\\': return "\\\\";
    case '"': return "\\\"";
    case '[': return "\\[";
    case ']': return "\\]";
    case '-': return "\\-";
    case '^': return "\\^";
    default: break;
  }
  if (cp < 0x20 || cp == 0x7F) {
    std::snprintf(buf, sizeof buf, "\\x%02X", cp);
    return buf;
  }
  if (cp >= 0xD800 && cp <= 0xDFFF) {  // not encodable in UTF-8 text: keep it as an escape
    std::snprintf(buf, sizeof buf, "\\u%04X", cp);
    return buf;
  }
  std::string out;
  utf8_append(cp, &out);
  return out;
}

std::string gbnf_literal(std::string_view utf8) {
  std::string out = "\"";
  for (size_t i = 0; i < utf8.size();) {
    size_t len = 1;
    uint32_t cp = utf8_decode(utf8, i, &len);
    i += len;
    out += (cp == '[' || cp == ']' || cp == '-' || cp == '^') ? std::string(1, static_cast<char>(cp))
                                                               : gbnf_codepoint_escape(cp);
  }
  return out + "\"";
}

namespace {

using Seq = std::vector<Element>;

class Parser {
 public:
  explicit Parser(std::string_view text) : s_(text) {
    if (!utf8_is_valid(text)) fail("grammar text is not valid UTF-8");
  }

  Grammar run() {
    skip_space();
    while (pos_ < s_.size()) {
      std::string name = parse_name();
      skip_space();
      if (s_.compare(pos_, 3, "::=") != 0) fail("expected '::=' after rule name '" + name + "'");
      pos_ += 3;
      uint32_t id = rule_id(name);
      if (defined_[id]) fail("rule '" + name + "' is defined twice");
      defined_[id] = true;
      alts_[id] = parse_alternatives(false);
    }
    for (size_t i = 0; i < names_.size(); ++i)
      if (!defined_[i]) throw GrammarError("gbnf", "gbnf: rule '" + names_[i] + "' is used but not defined");
    std::vector<bool> nullable = nullable_rules();
    make_star_bodies_non_empty(nullable);
    auto root = ids_.find("root");
    if (root == ids_.end()) throw GrammarError("gbnf", "gbnf: the grammar has no 'root' rule");
    Grammar g;
    g.root = root->second;
    g.classes = std::move(classes_);
    for (size_t r = 0; r < names_.size(); ++r) {
      Rule rule{names_[r], {}};
      for (const Seq& seq : alts_[r]) {
        rule.alternatives.push_back(static_cast<uint32_t>(g.elements.size()));
        g.elements.insert(g.elements.end(), seq.begin(), seq.end());
        g.elements.push_back({ElementKind::END, static_cast<uint32_t>(r)});
      }
      g.element_rule.resize(g.elements.size(), static_cast<uint32_t>(r));
      g.rules.push_back(std::move(rule));
    }
    g.chains = std::move(chains_);
    check_left_recursion(g, nullable);
    return g;
  }

 private:
  [[noreturn]] void fail(const std::string& msg) const {
    size_t line = 1, col = 1;
    for (size_t i = 0; i < pos_ && i < s_.size(); ++i) {
      if (s_[i] == '\n') {
        ++line;
        col = 1;
      } else {
        ++col;
      }
    }
    throw GrammarError("gbnf", "gbnf: line " + std::to_string(line) + ", column " + std::to_string(col) + ": " + msg);
  }

  static bool is_name_char(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '_';
  }

  void skip_space() {
    while (pos_ < s_.size()) {
      char c = s_[pos_];
      if (c == ' ' || c == '\t' || c == '\n' || c == '\r') {
        ++pos_;
      } else if (c == '#') {
        while (pos_ < s_.size() && s_[pos_] != '\n') ++pos_;
      } else {
        break;
      }
    }
  }

  std::string parse_name() {
    size_t start = pos_;
    while (pos_ < s_.size() && is_name_char(s_[pos_])) ++pos_;
    if (pos_ == start) fail("expected a rule name");
    return std::string(s_.substr(start, pos_ - start));
  }

  uint32_t rule_id(const std::string& name) {
    auto [it, fresh] = ids_.try_emplace(name, static_cast<uint32_t>(names_.size()));
    if (fresh) {
      names_.push_back(name);
      alts_.emplace_back();
      defined_.push_back(false);
    }
    return it->second;
  }

  uint32_t helper_rule(std::vector<Seq> alts) {
    uint32_t id = rule_id("$group" + std::to_string(helper_count_++));  // not a valid user name
    defined_[id] = true;
    alts_[id] = std::move(alts);
    return id;
  }

  uint32_t class_id(CharClass c) {
    std::string key(c.negated ? "^" : "");
    for (auto [a, b] : c.ranges) key += std::to_string(a) + "-" + std::to_string(b) + ",";
    auto [it, fresh] = class_ids_.try_emplace(key, static_cast<uint32_t>(classes_.size()));
    if (fresh) classes_.push_back(std::move(c));
    return it->second;
  }

  uint32_t hex(size_t digits) {
    if (pos_ + digits > s_.size()) fail("truncated hex escape");
    uint32_t v = 0;
    for (size_t i = 0; i < digits; ++i) {
      char c = s_[pos_++];
      int d = (c >= '0' && c <= '9') ? c - '0' : (c >= 'a' && c <= 'f') ? c - 'a' + 10 : (c >= 'A' && c <= 'F') ? c - 'A' + 10 : -1;
      if (d < 0) fail("bad hex digit in escape");
      v = v * 16 + static_cast<uint32_t>(d);
    }
    if (v > 0x10FFFF) fail("escape beyond U+10FFFF");
    return v;
  }

  // One code point of a literal or class, escapes resolved.
  uint32_t parse_char() {
    if (pos_ >= s_.size()) fail("unexpected end of grammar");
    if (s_[pos_] == '\\') {
      ++pos_;
      if (pos_ >= s_.size()) fail("unexpected end after '\\'");
      char c = s_[pos_++];
      switch (c) {
        case 'n': return '\n';
        case 'r': return '\r';
        case 't': return '\t';
        case 'f': return '\f';
        case 'v': return '\v';
        case '0': return 0;
        case 'x': return hex(2);
        case 'u': return hex(4);
        case 'U': return hex(8);
        default:
          if (static_cast<unsigned char>(c) < 0x80 && !std::isalnum(static_cast<unsigned char>(c))) return static_cast<unsigned char>(c);
          fail(std::string("unknown escape '\\") + c + "'");
      }
    }
    size_t len = 1;
    uint32_t cp = utf8_decode(s_, pos_, &len);
    pos_ += len;
    return cp;
  }

  std::vector<Seq> parse_alternatives(bool nested) {
    std::vector<Seq> alts;
    alts.push_back(parse_sequence(nested));
    while (pos_ < s_.size() && s_[pos_] == '|') {
      ++pos_;
      alts.push_back(parse_sequence(nested));
    }
    return alts;
  }

  // Whether a rule definition (`name ::=`) starts at pos_.
  bool at_definition() const {
    size_t p = pos_;
    while (p < s_.size() && is_name_char(s_[p])) ++p;
    if (p == pos_) return false;
    while (p < s_.size() && (s_[p] == ' ' || s_[p] == '\t' || s_[p] == '\n' || s_[p] == '\r')) ++p;
    return s_.compare(p, 3, "::=") == 0;
  }

  Seq parse_sequence(bool nested) {
    Seq seq;
    size_t last_start = 0;  // where the last atom's elements begin in seq
    bool have_atom = false;
    skip_space();
    while (pos_ < s_.size()) {
      char c = s_[pos_];
      if (c == '|' || c == ')') break;
      if (c == '"') {
        ++pos_;
        last_start = seq.size();
        while (true) {
          if (pos_ >= s_.size()) fail("unterminated literal");
          if (s_[pos_] == '"') break;
          uint32_t cp = parse_char();
          seq.push_back({ElementKind::CLASS, class_id({{{cp, cp}}, false})});
        }
        ++pos_;
        // An empty literal "" is the empty string: a postfix operator then applies to nothing.
        have_atom = seq.size() > last_start;
      } else if (c == '[') {
        ++pos_;
        CharClass cls;
        if (pos_ < s_.size() && s_[pos_] == '^') {
          cls.negated = true;
          ++pos_;
        }
        while (true) {
          if (pos_ >= s_.size()) fail("unterminated character class");
          if (s_[pos_] == ']') break;
          uint32_t lo = parse_char(), hi = lo;
          if (pos_ + 1 < s_.size() && s_[pos_] == '-' && s_[pos_ + 1] != ']') {
            ++pos_;
            hi = parse_char();
            if (hi < lo) fail("character range is reversed");
          }
          cls.ranges.emplace_back(lo, hi);
        }
        ++pos_;
        last_start = seq.size();
        seq.push_back({ElementKind::CLASS, class_id(std::move(cls))});
        have_atom = true;
      } else if (c == '.') {
        ++pos_;
        last_start = seq.size();
        seq.push_back({ElementKind::CLASS, class_id({{}, true})});
        have_atom = true;
      } else if (c == '(') {
        ++pos_;
        // One recursion per open group: bounded, so a hostile grammar cannot exhaust the stack.
        if (++depth_ > kMaxGroupDepth) fail("groups nested deeper than " + std::to_string(kMaxGroupDepth) + " levels");
        auto alts = parse_alternatives(true);
        --depth_;
        if (pos_ >= s_.size() || s_[pos_] != ')') fail("expected ')'");
        ++pos_;
        last_start = seq.size();
        seq.push_back({ElementKind::RULE, helper_rule(std::move(alts))});
        have_atom = true;
      } else if (is_name_char(c)) {
        if (!nested && at_definition()) break;
        std::string name = parse_name();
        last_start = seq.size();
        seq.push_back({ElementKind::RULE, rule_id(name)});
        have_atom = true;
      } else if (c == '*' || c == '+' || c == '?' || c == '{') {
        if (!have_atom) fail(std::string("'") + c + "' follows nothing");
        apply_postfix(seq, last_start);
        have_atom = false;
      } else {
        fail(std::string("unexpected character '") + c + "'");
      }
      skip_space();
    }
    return seq;
  }

  size_t parse_int() {
    size_t start = pos_, v = 0;
    while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') {
      v = v * 10 + static_cast<size_t>(s_[pos_++] - '0');
      if (v > 100000) fail("repetition count above 100000");
    }
    if (pos_ == start) fail("expected a number in '{m,n}'");
    return v;
  }

  // Replaces seq[from..] (one atom) by its repetition.
  void apply_postfix(Seq& seq, size_t from) {
    Seq atom(seq.begin() + static_cast<std::ptrdiff_t>(from), seq.end());
    seq.resize(from);
    size_t lo = 0, hi = SIZE_MAX;
    char c = s_[pos_++];
    if (c == '*') {
    } else if (c == '+') {
      lo = 1;
    } else if (c == '?') {
      hi = 1;
    } else {
      skip_space();
      lo = parse_int();
      skip_space();
      hi = lo;
      if (pos_ < s_.size() && s_[pos_] == ',') {
        ++pos_;
        skip_space();
        hi = (pos_ < s_.size() && s_[pos_] == '}') ? SIZE_MAX : parse_int();
        skip_space();
      }
      if (pos_ >= s_.size() || s_[pos_] != '}') fail("expected '}'");
      ++pos_;
      if (hi < lo) fail("repetition {m,n} with n < m");
    }
    // An atom of rule references alone may match the empty string (known once every rule is
    // defined): its bounded repetition goes into a rule of its own, which
    // make_star_bodies_non_empty rewrites over the atom's non-empty strings if so, and otherwise
    // splices back in place.
    const bool maybe_empty =
        hi != SIZE_MAX && hi >= 2 &&
        std::all_of(atom.begin(), atom.end(), [](const Element& e) { return e.kind == ElementKind::RULE; });
    Seq outer;
    if (maybe_empty) std::swap(seq, outer);
    for (size_t i = 0; i < lo; ++i) seq.insert(seq.end(), atom.begin(), atom.end());
    if (hi == SIZE_MAX) {  // star: S ::= atom S | empty
      uint32_t star = helper_rule({});
      Seq again = atom;
      again.push_back({ElementKind::RULE, star});
      alts_[star] = {again, {}};
      stars_.push_back(star);
      seq.push_back({ElementKind::RULE, star});
    } else if (hi > lo) {  // (atom (atom (...)?)?)? with hi - lo levels
      uint32_t inner = helper_rule({atom, {}});
      std::vector<uint32_t> chain = {inner};
      for (size_t k = 1; k < hi - lo; ++k) {
        Seq more = atom;
        more.push_back({ElementKind::RULE, inner});
        inner = helper_rule({more, {}});
        chain.push_back(inner);
      }
      seq.push_back({ElementKind::RULE, inner});
      if (chain.size() > 1) chains_.push_back(std::move(chain));
    }
    if (maybe_empty) {
      const uint32_t rep = helper_rule({seq});
      reps_.push_back({rep, std::move(atom), hi});
      seq = std::move(outer);
      seq.push_back({ElementKind::RULE, rep});
    }
  }

  // A star S ::= atom S | empty whose atom can match the empty string ((a*)*, (a?)+, x* with a
  // nullable rule x) could reach S again without consuming input, which the matcher cannot
  // expand. Its atom is replaced by the atom's non-empty strings (atom* = (atom minus empty)*):
  // for each position i whose elements before it can all be empty, element i's non-empty form
  // followed by the rest. A rule's non-empty form is a helper rule of its alternatives' non-empty
  // forms (itself when it cannot be empty). Runs once every rule is defined; `nullable`
  // (nullable_rules) grows with the helper rules it adds, which cannot match the empty string.
  void make_star_bodies_non_empty(std::vector<bool>& nullable) {
    auto seq_nullable = [&](const Seq& q) { return seq_can_be_empty(q, nullable); };
    std::unordered_map<uint32_t, uint32_t> non_empty_rule;  // rule -> its non-empty form
    std::function<uint32_t(uint32_t)> rule_without_empty;
    // The forms copy each position's suffix, quadratic in a long sequence of parts that can be
    // empty ((("a"?){20000})* would take gigabytes): past this many elements, a clear error.
    constexpr size_t kMaxRewrittenElements = size_t{1} << 20;
    size_t rewritten = 0;
    auto seq_without_empty = [&](const Seq& q) {
      std::vector<Seq> out;
      for (size_t i = 0; i < q.size(); ++i) {
        rewritten += q.size() - i;
        if (rewritten > kMaxRewrittenElements)
          throw GrammarError("gbnf", "gbnf: a repetition of a part that can match the empty string is too large to "
                                     "rewrite over the part's non-empty strings (over " +
                                         std::to_string(kMaxRewrittenElements) + " elements)");
        Element first = q[i];
        const bool can_be_empty = first.kind == ElementKind::RULE && nullable[first.index];
        if (can_be_empty) first.index = rule_without_empty(first.index);
        Seq alt{first};
        alt.insert(alt.end(), q.begin() + static_cast<std::ptrdiff_t>(i) + 1, q.end());
        out.push_back(std::move(alt));
        if (!can_be_empty) break;  // a later element cannot be the first to consume input
      }
      return out;
    };
    // The forms recurse through rules that can be empty, one level per rule: a bound keeps a
    // hostile chain of them (x0 ::= "a"? x1, x1 ::= "a"? x2, ...) from exhausting the stack.
    constexpr int kMaxFormDepth = 2000;
    int form_depth = 0;
    rule_without_empty = [&](uint32_t r) -> uint32_t {
      if (auto it = non_empty_rule.find(r); it != non_empty_rule.end()) return it->second;
      if (form_depth >= kMaxFormDepth)
        throw GrammarError("gbnf", "gbnf: a repetition of a part that can match the empty string goes through more "
                                   "than 2000 nested rules that can match the empty string");
      ++form_depth;  // an error ends the whole parse: nothing to restore then
      const uint32_t id = helper_rule({});
      nullable.resize(alts_.size(), false);  // a non-empty form never matches the empty string
      non_empty_rule.emplace(r, id);         // before the alternatives: a recursive rule refers to itself
      const std::vector<Seq> alts = alts_[r];  // a copy: helper_rule may grow alts_
      std::vector<Seq> out;
      for (const Seq& a : alts)
        for (Seq& x : seq_without_empty(a)) out.push_back(std::move(x));
      alts_[id] = std::move(out);
      --form_depth;
      return id;
    };
    // A bounded repetition x{m,n} whose x can match the empty string is ambiguous (each of the n
    // copies may or may not take input: (a?){0,5000} gives the matcher 5,000 stacks at every
    // step, and nested ones multiply). Its language is (x minus empty){0,n}: the chain
    // L_1 ::= f | ... | empty, L_d ::= f L_{d-1} | ... | empty over x's non-empty forms f, which
    // takes at most one stack per way of splitting the input into x's. A repetition of an atom
    // that cannot be empty is spliced back (its rule adds a stack frame, and the token splits
    // key on the top frames).
    std::vector<uint8_t> splice(alts_.size(), 0);
    for (const Repetition& rep : reps_) {
      if (!seq_nullable(rep.atom)) {
        splice[rep.rule] = 1;
        continue;
      }
      const std::vector<Seq> forms = seq_without_empty(rep.atom);
      std::vector<uint32_t> chain;
      for (size_t d = 1; d <= rep.max; ++d) {
        std::vector<Seq> link;
        for (const Seq& f : forms) {
          link.push_back(f);
          if (d > 1) link.back().push_back({ElementKind::RULE, chain.back()});
        }
        link.push_back({});
        chain.push_back(helper_rule(std::move(link)));
      }
      nullable.resize(alts_.size(), true);  // every link can be empty
      alts_[rep.rule] = {{{ElementKind::RULE, chain.back()}}};
      if (chain.size() > 1) chains_.push_back(std::move(chain));
    }
    splice.resize(alts_.size(), 0);
    for (const uint32_t star : std::vector<uint32_t>(stars_)) {
      Seq atom = alts_[star][0];
      atom.pop_back();  // the trailing reference to the star itself
      if (!seq_nullable(atom)) continue;
      std::vector<Seq> alts;
      for (Seq& x : seq_without_empty(atom)) {
        x.push_back({ElementKind::RULE, star});
        alts.push_back(std::move(x));
      }
      alts.push_back({});
      alts_[star] = std::move(alts);
    }
    // Splices the kept repetitions' rules into every sequence that refers to them (theirs
    // included: a repetition inside another's atom).
    std::function<void(const Seq&, Seq&)> spliced = [&](const Seq& in, Seq& out) {
      for (const Element& e : in)
        if (e.kind == ElementKind::RULE && e.index < splice.size() && splice[e.index]) spliced(alts_[e.index][0], out);
        else out.push_back(e);
    };
    if (std::find(splice.begin(), splice.end(), 1) != splice.end())
      for (size_t r = 0; r < alts_.size(); ++r) {
        if (splice[r]) continue;
        for (Seq& q : alts_[r]) {
          Seq out;
          spliced(q, out);
          q = std::move(out);
        }
      }
  }

  static bool seq_can_be_empty(const Seq& q, const std::vector<bool>& nullable) {
    return std::all_of(q.begin(), q.end(),
                       [&](const Element& e) { return e.kind == ElementKind::RULE && nullable[e.index]; });
  }

  // Per rule, whether it can match the empty string: the least fixpoint, by a worklist in time
  // linear in the grammar (a pass per change would be quadratic in a chain of 100,000 rules).
  std::vector<bool> nullable_rules() const {
    std::vector<bool> nullable(alts_.size(), false);
    std::vector<std::vector<int64_t>> pending(alts_.size());  // [rule][alt]: elements not yet empty; -1 never
    std::vector<std::vector<std::pair<uint32_t, uint32_t>>> users(alts_.size());  // rule -> (rule, alt) using it
    std::vector<uint32_t> work;
    const auto found = [&](uint32_t r) {
      if (!nullable[r]) nullable[r] = true, work.push_back(r);
    };
    for (uint32_t r = 0; r < alts_.size(); ++r) {
      pending[r].resize(alts_[r].size());
      for (uint32_t a = 0; a < alts_[r].size(); ++a) {
        int64_t n = 0;
        for (const Element& e : alts_[r][a])
          if (e.kind == ElementKind::CLASS) n = INT64_MIN;
          else ++n, users[e.index].push_back({r, a});
        pending[r][a] = n < 0 ? -1 : n;
        if (n == 0) found(r);
      }
    }
    while (!work.empty()) {
      const uint32_t q = work.back();
      work.pop_back();
      for (const auto& [r, a] : users[q])
        if (pending[r][a] > 0 && --pending[r][a] == 0) found(r);
    }
    return nullable;
  }

  // A rule that can reach itself without consuming input would send the matcher's expansion
  // into an endless loop. nullable: per rule of g, whether it can match the empty string.
  static void check_left_recursion(const Grammar& g, const std::vector<bool>& nullable) {
    auto seq_nullable_until = [&](uint32_t start, const std::function<void(uint32_t)>& on_rule) {
      for (uint32_t p = start;; ++p) {
        const Element& e = g.elements[p];
        if (e.kind == ElementKind::END) return true;
        if (e.kind == ElementKind::CLASS) return false;
        if (on_rule) on_rule(e.index);
        if (!nullable[e.index]) return false;
      }
    };
    std::vector<std::vector<uint32_t>> left(g.rules.size());
    for (size_t r = 0; r < g.rules.size(); ++r)
      for (uint32_t a : g.rules[r].alternatives) seq_nullable_until(a, [&](uint32_t s) { left[r].push_back(s); });
    // Depth-first with an explicit stack (a chain of 100,000 nullable links is that deep): each
    // frame a rule and the index of its next successor to visit.
    std::vector<uint8_t> mark(g.rules.size(), 0);  // 0 new, 1 on the DFS path, 2 done
    std::vector<std::pair<uint32_t, size_t>> path;
    for (uint32_t root = 0; root < g.rules.size(); ++root) {
      if (mark[root] != 0) continue;
      mark[root] = 1;
      path.push_back({root, 0});
      while (!path.empty()) {
        auto& [r, next] = path.back();
        if (next == left[r].size()) {
          mark[r] = 2;
          path.pop_back();
          continue;
        }
        const uint32_t s = left[r][next++];
        if (mark[s] == 1) throw LeftRecursionError(g.rules[s].name);
        if (mark[s] == 0) {
          mark[s] = 1;
          path.push_back({s, 0});
        }
      }
    }
  }

  std::string_view s_;
  size_t pos_ = 0;
  static constexpr int kMaxGroupDepth = 1000;
  int depth_ = 0;  // groups open at pos_
  std::vector<std::string> names_;
  std::vector<std::vector<Seq>> alts_;
  std::vector<bool> defined_;
  std::unordered_map<std::string, uint32_t> ids_;
  std::vector<CharClass> classes_;
  std::map<std::string, uint32_t> class_ids_;
  size_t helper_count_ = 0;
  std::vector<std::vector<uint32_t>> chains_;  // Grammar::chains
  std::vector<uint32_t> stars_;                // the star helper rules (make_star_bodies_non_empty)
  // Bounded repetitions of atoms that may match the empty string, each in its rule (apply_postfix).
  struct Repetition {
    uint32_t rule;
    Seq atom;
    size_t max;
  };
  std::vector<Repetition> reps_;
};

}  // namespace

Grammar Grammar::parse_gbnf(std::string_view text) { return Parser(text).run(); }

}  // namespace kestrel::grammar
