// Regex to GBNF by recursive descent; each construct becomes a parenthesised GBNF expression.
#include "sampling/grammar/regex.h"

#include <algorithm>
#include <cstdio>
#include <utility>
#include <vector>

#include "tokenizer/utf8.h"

namespace kestrel::grammar {

namespace {

using Ranges = std::vector<std::pair<uint32_t, uint32_t>>;

Ranges normalize(Ranges r) {
  std::sort(r.begin(), r.end());
  Ranges out;
  for (auto [a, b] : r) {
    if (!out.empty() && a <= out.back().second + 1) {
      out.back().second = std::max(out.back().second, b);
    } else {
      out.emplace_back(a, b);
    }
  }
  return out;
}

Ranges complement(const Ranges& r) {
  Ranges n = normalize(r), out;
  uint32_t at = 0;
  for (auto [a, b] : n) {
    if (a > at) out.emplace_back(at, a - 1);
    at = b + 1;
  }
  if (at <= 0x10FFFF) out.emplace_back(at, 0x10FFFF);
  return out;
}

Ranges intersect(const Ranges& x, const Ranges& y) {
  Ranges out;
  for (auto [a, b] : normalize(x))
    for (auto [c, d] : normalize(y))
      if (std::max(a, c) <= std::min(b, d)) out.emplace_back(std::max(a, c), std::min(b, d));
  return normalize(out);
}

const Ranges kDigit = {{'0', '9'}};
const Ranges kWord = {{'0', '9'}, {'A', 'Z'}, {'_', '_'}, {'a', 'z'}};
const Ranges kSpace = {{'\t', '\r'}, {' ', ' '}, {0xA0, 0xA0}, {0x1680, 0x1680}, {0x2000, 0x200A},
                       {0x2028, 0x2029}, {0x202F, 0x202F}, {0x205F, 0x205F}, {0x3000, 0x3000}, {0xFEFF, 0xFEFF}};

std::string class_text(const Ranges& r) {
  std::string out = "[";
  for (auto [a, b] : r) {
    out += gbnf_codepoint_escape(a);
    if (b != a) out += "-" + gbnf_codepoint_escape(b);
  }
  return out + "]";
}

// The JSON text of any character in r (r normalised, surrogates excluded by the caller).
std::string json_class_text(const Ranges& r) {
  Ranges plain = intersect(r, {{0x20, 0x21}, {0x23, 0x5B}, {0x5D, 0xD7FF}, {0xE000, 0x10FFFF}});
  std::vector<std::string> alts;
  if (!plain.empty()) alts.push_back(class_text(plain));
  auto has = [&](uint32_t cp) {
    for (auto [a, b] : r)
      if (cp >= a && cp <= b) return true;
    return false;
  };
  if (has('"')) alts.push_back("\"\\\\\\\"\"");
  if (has('\\')) alts.push_back("\"\\\\\\\\\"");
  for (uint32_t c = 0; c < 0x20; ++c) {
    if (!has(c)) continue;
    const char* esc = c == '\b' ? "b" : c == '\t' ? "t" : c == '\n' ? "n" : c == '\f' ? "f" : c == '\r' ? "r" : nullptr;
    char buf[32];
    if (esc != nullptr) {
      std::snprintf(buf, sizeof buf, "\"\\\\%s\"", esc);
    } else {
      std::snprintf(buf, sizeof buf, "\"\\\\u%04x\"", c);
    }
    alts.push_back(buf);
  }
  if (alts.empty()) throw GrammarError("regex", "regex: a character class matches no character");
  if (alts.size() == 1) return alts[0];
  std::string out = "(";
  for (size_t i = 0; i < alts.size(); ++i) out += (i ? " | " : "") + alts[i];
  return out + ")";
}

class RegexParser {
 public:
  RegexParser(std::string_view p, const RegexOptions& o) : s_(p), opts_(o) {
    if (!utf8_is_valid(p)) throw GrammarError("regex", "regex: pattern is not valid UTF-8");
  }

  std::string run() {
    bool start_anchor = false, end_anchor = false;
    if (!s_.empty() && s_.front() == '^') {
      start_anchor = true;
      pos_ = 1;
    }
    size_t end = s_.size();
    if (end > pos_ && s_[end - 1] == '$' && !escaped_at(end - 1)) {
      end_anchor = true;
      s_ = s_.substr(0, end - 1);
    }
    std::string body = parse_alt();
    if (pos_ != s_.size()) fail("regex", "unbalanced ')'");
    if (!opts_.search) return "(" + body + ")";
    std::string any = opts_.json_string ? "(" + json_char_gbnf() + ")*" : ".*";
    return "(" + (start_anchor ? "" : any + " ") + body + (end_anchor ? "" : " " + any) + ")";
  }

 private:
  [[noreturn]] void fail(const std::string& keyword, const std::string& msg) const {
    throw GrammarError(keyword, "regex: " + msg + " at offset " + std::to_string(pos_) + " in '" + std::string(s_) + "'");
  }

  bool escaped_at(size_t i) const {  // odd number of backslashes before s_[i]
    size_t n = 0;
    while (i > n && s_[i - n - 1] == '\\') ++n;
    return n % 2 == 1;
  }

  bool more() const { return pos_ < s_.size(); }
  char peek() const { return s_[pos_]; }

  std::string parse_alt() {
    std::vector<std::string> alts{parse_seq()};
    while (more() && peek() == '|') {
      ++pos_;
      alts.push_back(parse_seq());
    }
    if (alts.size() == 1) return alts[0];
    std::string out = "(";
    for (size_t i = 0; i < alts.size(); ++i) out += (i ? " | " : "") + (alts[i].empty() ? std::string("\"\"") : alts[i]);
    return out + ")";
  }

  std::string parse_seq() {
    std::string out;
    while (more() && peek() != '|' && peek() != ')') {
      std::string atom = parse_atom();
      atom = parse_quantifier(atom);
      out += (out.empty() ? "" : " ") + atom;
    }
    return out;
  }

  std::string parse_quantifier(std::string atom) {
    if (!more()) return atom;
    char c = peek();
    std::string q;
    if (c == '*' || c == '+' || c == '?') {
      ++pos_;
      q = std::string(1, c);
    } else if (c == '{') {
      size_t save = pos_++;
      std::string m, n;
      bool comma = false;
      while (more() && (std::isdigit(static_cast<unsigned char>(peek())) || peek() == ',')) {
        if (peek() == ',') {
          if (comma) break;
          comma = true;
        } else {
          (comma ? n : m) += peek();
        }
        ++pos_;
      }
      if (!more() || peek() != '}' || m.empty()) {  // a literal '{', as ECMAScript's Annex B reads it
        pos_ = save;
        return atom;
      }
      ++pos_;
      if (m.size() > 5 || n.size() > 5) fail("regex", "repetition count too large");
      if (!n.empty() && std::stoul(n) < std::stoul(m)) fail("regex", "repetition {m,n} with n < m");
      q = "{" + m + (comma ? "," + n : "") + "}";
    } else {
      return atom;
    }
    if (more() && peek() == '?') ++pos_;  // lazy: the same language
    if (more() && peek() == '+') fail("possessive quantifier", "possessive quantifiers are not supported");
    if (more() && (peek() == '*' || peek() == '+' || peek() == '{'))
      fail("regex", "nothing to repeat");
    return "(" + atom + ")" + q;
  }

  std::string chars(const Ranges& r) {
    Ranges n = normalize(r);
    if (opts_.json_string) return json_class_text(intersect(n, {{0, 0xD7FF}, {0xE000, 0x10FFFF}}));
    return class_text(n);
  }

  std::string parse_atom() {
    char c = peek();
    if (c == '(') {
      ++pos_;
      if (more() && peek() == '?') {
        ++pos_;
        if (!more()) fail("regex", "unterminated group");
        char k = peek();
        if (k == ':') {
          ++pos_;
        } else if (k == '=' || k == '!') {
          fail("lookahead", "lookahead (?= (?! is not supported");
        } else if (k == '<' && pos_ + 1 < s_.size() && (s_[pos_ + 1] == '=' || s_[pos_ + 1] == '!')) {
          fail("lookbehind", "lookbehind (?<= (?<! is not supported");
        } else if (k == '<' || (k == 'P' && pos_ + 1 < s_.size() && s_[pos_ + 1] == '<')) {
          size_t close = s_.find('>', pos_);
          if (close == std::string_view::npos) fail("regex", "unterminated group name");
          pos_ = close + 1;
        } else {
          fail("inline flags", "inline flags and other (? groups are not supported");
        }
      }
      // The parser recurses once per open group: a bound keeps a hostile pattern from exhausting
      // the thread's stack.
      if (++depth_ > kMaxGroupDepth) fail("regex", "groups nested deeper than 1000 levels");
      std::string inner = parse_alt();
      --depth_;
      if (!more() || peek() != ')') fail("regex", "missing ')'");
      ++pos_;
      return "(" + (inner.empty() ? std::string("\"\"") : inner) + ")";
    }
    if (c == '[') return parse_class();
    if (c == '.') {
      ++pos_;
      return chars(complement(opts_.json_string ? Ranges{{'\n', '\n'}, {'\r', '\r'}, {0x2028, 0x2029}} : Ranges{{'\n', '\n'}}));
    }
    if (c == '^' || c == '$') fail("anchor", "anchors are only supported at the start and end of the pattern");
    if (c == '*' || c == '+' || c == '?') fail("regex", "nothing to repeat");
    if (c == '\\') {
      Ranges r = parse_escape(false);
      return chars(r);
    }
    size_t len = 1;
    uint32_t cp = utf8_decode(s_, pos_, &len);
    pos_ += len;
    return chars({{cp, cp}});
  }

  uint32_t hex(size_t digits) {
    if (pos_ + digits > s_.size()) fail("regex", "truncated hex escape");
    uint32_t v = 0;
    for (size_t i = 0; i < digits; ++i) {
      char h = s_[pos_++];
      if (!std::isxdigit(static_cast<unsigned char>(h))) fail("regex", "bad hex digit");
      v = v * 16 + static_cast<uint32_t>(std::isdigit(static_cast<unsigned char>(h)) ? h - '0' : (std::tolower(h) - 'a' + 10));
    }
    return v;
  }

  // After a backslash: the set of code points it stands for.
  Ranges parse_escape(bool in_class) {
    ++pos_;
    if (!more()) fail("regex", "pattern ends in '\\'");
    char c = s_[pos_++];
    switch (c) {
      case 'd': return kDigit;
      case 'D': return complement(kDigit);
      case 'w': return kWord;
      case 'W': return complement(kWord);
      case 's': return kSpace;
      case 'S': return complement(kSpace);
      case 'n': return {{'\n', '\n'}};
      case 'r': return {{'\r', '\r'}};
      case 't': return {{'\t', '\t'}};
      case 'f': return {{'\f', '\f'}};
      case 'v': return {{'\v', '\v'}};
      case '0': return {{0, 0}};
      case 'x': {
        uint32_t v = hex(2);
        return {{v, v}};
      }
      case 'u': {
        uint32_t v;
        if (more() && peek() == '{') {
          ++pos_;
          size_t close = s_.find('}', pos_);
          if (close == std::string_view::npos || close == pos_ || close - pos_ > 6) fail("regex", "bad \\u{...} escape");
          v = hex(close - pos_);
          ++pos_;
        } else {
          v = hex(4);
        }
        if (v > 0x10FFFF) fail("regex", "escape beyond U+10FFFF");
        return {{v, v}};
      }
      case 'b':
        if (in_class) return {{'\b', '\b'}};
        fail("word boundary", "word boundaries (\\b) are not supported");
      case 'B': fail("word boundary", "word boundaries (\\B) are not supported");
      case 'p':
      case 'P': fail("unicode property", "Unicode property escapes (\\p) are not supported");
      case 'k': fail("backreference", "backreferences are not supported");
      case 'c': fail("regex", "control escapes (\\c) are not supported");
      default: break;
    }
    if (c >= '1' && c <= '9') fail("backreference", "backreferences are not supported");
    if (std::isalnum(static_cast<unsigned char>(c))) fail("regex", std::string("unknown escape '\\") + c + "'");
    --pos_;
    size_t len = 1;
    uint32_t cp = utf8_decode(s_, pos_, &len);
    pos_ += len;
    return {{cp, cp}};
  }

  std::string parse_class() {
    ++pos_;
    bool negated = false;
    if (more() && peek() == '^') {
      negated = true;
      ++pos_;
    }
    Ranges r;
    bool first = true;
    while (true) {
      if (!more()) fail("regex", "unterminated character class");
      if (peek() == ']' && !first) break;
      first = false;
      if (peek() == '[' && pos_ + 1 < s_.size() && s_[pos_ + 1] == ':') fail("posix class", "POSIX classes [:...:] are not supported");
      Ranges lo_set = read_class_atom();
      if (lo_set.size() == 1 && lo_set[0].first == lo_set[0].second && pos_ + 1 < s_.size() && peek() == '-' &&
          s_[pos_ + 1] != ']') {
        ++pos_;
        Ranges hi_set = read_class_atom();
        if (hi_set.size() != 1 || hi_set[0].first != hi_set[0].second) fail("regex", "bad range in class");
        if (hi_set[0].first < lo_set[0].first) fail("regex", "character range is reversed");
        r.emplace_back(lo_set[0].first, hi_set[0].first);
      } else {
        r.insert(r.end(), lo_set.begin(), lo_set.end());
      }
    }
    ++pos_;
    return chars(negated ? complement(r) : r);
  }

  Ranges read_class_atom() {
    if (peek() == '\\') return parse_escape(true);
    size_t len = 1;
    uint32_t cp = utf8_decode(s_, pos_, &len);
    pos_ += len;
    return {{cp, cp}};
  }

  std::string_view s_;
  RegexOptions opts_;
  size_t pos_ = 0;
  static constexpr int kMaxGroupDepth = 1000;  // the limit fail() names
  int depth_ = 0;                             // groups open at pos_
};

}  // namespace

std::string json_char_gbnf() {
  return "[^\"\\\\\\x00-\\x1F] | \"\\\\\" ([\"\\\\/bfnrt] | \"u\" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F])";
}

std::string regex_to_gbnf(std::string_view pattern, const RegexOptions& opts) { return RegexParser(pattern, opts).run(); }

}  // namespace kestrel::grammar
