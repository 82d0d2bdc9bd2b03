#include "template/jinja_lexer.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "template/jinja.h"
#include "template/jinja_text.h"

namespace kestrel::jinja {

SourceMap::SourceMap(std::string_view source) {
  line_starts_.push_back(0);
  chars_before_.resize(source.size() + 1);
  uint32_t n = 0;
  for (size_t i = 0; i < source.size(); ++i) {
    chars_before_[i] = n;
    if ((static_cast<unsigned char>(source[i]) & 0xC0) != 0x80) ++n;
    if (source[i] == '\n') line_starts_.push_back(i + 1);
  }
  chars_before_[source.size()] = n;
}

void SourceMap::locate(size_t offset, int* line, int* column) const {
  offset = std::min(offset, chars_before_.size() - 1);
  const auto it = std::upper_bound(line_starts_.begin(), line_starts_.end(), offset);
  const size_t l = static_cast<size_t>(it - line_starts_.begin()) - 1;
  *line = static_cast<int>(l + 1);
  *column = static_cast<int>(chars_before_[offset] - chars_before_[line_starts_[l]]) + 1;
}

namespace {

bool is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }
bool is_name_start(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
bool is_name_char(char c) { return is_name_start(c) || (c >= '0' && c <= '9'); }
bool is_digit(char c) { return c >= '0' && c <= '9'; }

// Operators, longest first where one is a prefix of another.
constexpr std::string_view kOps[] = {"//", "**", "==", "!=", "<=", ">=", "+", "-", "*", "/", "%", "~", "<",
                                     ">",  "=",  ".",  ",",  ":",  "|",  "(", ")", "[", "]", "{", "}"};

class Lexer {
 public:
  explicit Lexer(std::string src) : src_(std::move(src)), map_(src_) {}

  LexResult run() {
    size_t pos = 0;
    bool line_starting = true;  // the previous chunk ended a line (or this is the start)
    while (pos < src_.size()) {
      const size_t tag = find_tag(pos);
      if (tag == std::string::npos) {
        emit_text(std::string_view(src_).substr(pos));
        break;
      }
      const char kind = src_[tag + 1];  // '{', '%' or '#'
      const char sign = tag + 2 < src_.size() ? src_[tag + 2] : '\0';
      std::string_view text = std::string_view(src_).substr(pos, tag - pos);
      if (sign == '-') {
        text = rstrip(text);
      } else if (sign != '+' && kind != '{') {  // lstrip_blocks: block and comment tags only
        const size_t nl = text.rfind('\n');
        const size_t l_pos = nl == std::string_view::npos ? 0 : nl + 1;
        if (l_pos > 0 || line_starting) {
          std::string_view tail = text.substr(l_pos);
          if (!tail.empty() && std::all_of(tail.begin(), tail.end(), is_ws)) text = text.substr(0, l_pos);
        }
      }
      emit_text(text);
      const size_t inner = tag + 2 + ((sign == '-' || sign == '+') ? 1 : 0);
      if (kind == '#') {
        pos = lex_comment(tag, inner);
      } else if (kind == '%') {
        pos = lex_block(tag, inner);
      } else {
        pos = lex_var(tag, inner);
      }
      line_starting = pos > 0 && src_[pos - 1] == '\n';
    }
    Token end{TokenType::End, "", 0, 0.0, src_.size()};
    tokens_.push_back(end);
    return LexResult{std::move(src_), std::move(tokens_)};
  }

 private:
  std::string src_;
  SourceMap map_;
  std::vector<Token> tokens_;
  std::vector<char> brackets_;  // open brackets inside the current tag

  [[noreturn]] void fail(size_t offset, const std::string& msg) const {
    int line = 0, col = 0;
    map_.locate(offset, &line, &col);
    throw TemplateError(TemplateError::Kind::Syntax,
                        "template syntax error at line " + std::to_string(line) + ", column " +
                            std::to_string(col) + ": " + msg,
                        line, col);
  }

  static std::string_view rstrip(std::string_view s) {
    while (!s.empty() && is_ws(s.back())) s.remove_suffix(1);
    return s;
  }

  size_t find_tag(size_t pos) const {
    for (size_t i = src_.find('{', pos); i != std::string::npos; i = src_.find('{', i + 1)) {
      if (i + 1 < src_.size() && (src_[i + 1] == '{' || src_[i + 1] == '%' || src_[i + 1] == '#')) return i;
    }
    return std::string::npos;
  }

  // `text` is a view into src_ (its position is the token's offset).
  void emit_text(std::string_view text) {
    if (text.empty()) return;
    tokens_.push_back(Token{TokenType::Text, std::string(text), 0, 0.0, static_cast<size_t>(text.data() - src_.data())});
  }

  void push(TokenType type, size_t offset, std::string text = {}) {
    tokens_.push_back(Token{type, std::move(text), 0, 0.0, offset});
  }

  // After a tag's closing delimiter at `after`: "-" strips all following whitespace, otherwise
  // trim_blocks (block and comment tags) drops one newline.
  size_t after_end(size_t after, char sign, bool trim) const {
    if (sign == '-') {
      while (after < src_.size() && is_ws(src_[after])) ++after;
    } else if (sign != '+' && trim && after < src_.size() && src_[after] == '\n') {
      ++after;
    }
    return after;
  }

  size_t lex_comment(size_t tag, size_t inner) {
    const size_t end = src_.find("#}", inner);
    if (end == std::string::npos) fail(tag, "missing end of comment tag '#}'");
    const char sign = end > inner && (src_[end - 1] == '-' || src_[end - 1] == '+') ? src_[end - 1] : '\0';
    return after_end(end + 2, sign, true);
  }

  // {% raw %} ... {% endraw %}: `inner` is after "{%" and its sign. Returns npos when not raw.
  size_t try_raw(size_t tag, size_t inner) {
    size_t p = inner;
    while (p < src_.size() && is_ws(src_[p])) ++p;
    if (src_.compare(p, 3, "raw") != 0 || (p + 3 < src_.size() && is_name_char(src_[p + 3]))) return std::string::npos;
    p += 3;
    while (p < src_.size() && is_ws(src_[p])) ++p;
    char open_sign = '\0';
    if (p < src_.size() && (src_[p] == '-' || src_[p] == '+')) open_sign = src_[p++];
    if (src_.compare(p, 2, "%}") != 0) fail(p, "expected '%}' after 'raw'");
    const size_t body = after_end(p + 2, open_sign, true);
    // Find "{%" [-+] ws "endraw" ws [-+] "%}".
    for (size_t q = src_.find("{%", body); q != std::string::npos; q = src_.find("{%", q + 2)) {
      size_t r = q + 2;
      char close_sign = '\0';
      if (r < src_.size() && (src_[r] == '-' || src_[r] == '+')) close_sign = src_[r++];
      while (r < src_.size() && is_ws(src_[r])) ++r;
      if (src_.compare(r, 6, "endraw") != 0) continue;
      r += 6;
      while (r < src_.size() && is_ws(src_[r])) ++r;
      char end_sign = '\0';
      if (r < src_.size() && (src_[r] == '-' || src_[r] == '+')) end_sign = src_[r++];
      if (src_.compare(r, 2, "%}") != 0) continue;
      std::string_view text = std::string_view(src_).substr(body, q - body);
      if (close_sign == '-') text = rstrip(text);
      emit_text(text);
      return after_end(r + 2, end_sign, true);
    }
    fail(tag, "missing '{% endraw %}' for this raw block");
  }

  size_t lex_block(size_t tag, size_t inner) {
    if (const size_t raw_end = try_raw(tag, inner); raw_end != std::string::npos) return raw_end;
    push(TokenType::BlockBegin, tag);
    return lex_tag(tag, inner, '%');
  }

  size_t lex_var(size_t tag, size_t inner) {
    push(TokenType::VarBegin, tag);
    return lex_tag(tag, inner, '}');
  }

  // Tokens up to the closing "%}" or "}}" (outside brackets). Returns the position after it.
  size_t lex_tag(size_t tag, size_t p, char closer) {
    brackets_.clear();
    const bool block = closer == '%';
    while (true) {
      while (p < src_.size() && is_ws(src_[p])) ++p;
      if (p >= src_.size()) {
        fail(tag, block ? "unexpected end of template: '{%' tag not closed with '%}'"
                        : "unexpected end of template: '{{' not closed with '}}'");
      }
      if (brackets_.empty()) {
        char sign = '\0';
        size_t q = p;
        if (src_[q] == '-' || src_[q] == '+') sign = src_[q++];
        if (q + 1 < src_.size() && src_[q] == closer && src_[q + 1] == '}' && (sign != '+' || block)) {
          push(block ? TokenType::BlockEnd : TokenType::VarEnd, p);
          return after_end(q + 2, sign, block);
        }
      }
      const char c = src_[p];
      if (is_name_start(c) || static_cast<unsigned char>(c) >= 0x80) {
        size_t e = p;
        while (e < src_.size() && (is_name_char(src_[e]) || static_cast<unsigned char>(src_[e]) >= 0x80)) ++e;
        push(TokenType::Name, p, src_.substr(p, e - p));
        p = e;
      } else if (is_digit(c)) {
        p = lex_number(p);
      } else if (c == '\'' || c == '"') {
        p = lex_string(p);
      } else {
        p = lex_op(p);
      }
    }
  }

  size_t lex_number(size_t p) {
    const size_t start = p;
    const bool after_dot = !tokens_.empty() && tokens_.back().type == TokenType::Op && tokens_.back().text == ".";
    auto digits = [&](size_t q, auto pred) {
      // digits with single underscores between them
      while (q < src_.size() && (pred(src_[q]) || (src_[q] == '_' && q + 1 < src_.size() && pred(src_[q + 1]) && q > start))) ++q;
      return q;
    };
    auto dec = [](char ch) { return is_digit(ch); };
    if (src_[p] == '0' && p + 1 < src_.size() && std::string_view("xXoObB").find(src_[p + 1]) != std::string_view::npos) {
      const char base_ch = static_cast<char>(src_[p + 1] | 0x20);
      const int base = base_ch == 'x' ? 16 : (base_ch == 'o' ? 8 : 2);
      auto pred = [base](char ch) {
        if (base == 16) return is_digit(ch) || ((ch | 0x20) >= 'a' && (ch | 0x20) <= 'f');
        return ch >= '0' && ch < static_cast<char>('0' + base);
      };
      size_t q = p + 2;
      size_t e = q;
      while (e < src_.size() && (pred(src_[e]) || (src_[e] == '_' && e > q))) ++e;
      std::string body;
      for (size_t i = q; i < e; ++i) {
        if (src_[i] != '_') body += src_[i];
      }
      if (body.empty()) fail(p, "malformed number literal");
      errno = 0;
      char* endp = nullptr;
      const unsigned long long v = std::strtoull(body.c_str(), &endp, base);
      if (errno != 0 || v > static_cast<unsigned long long>(INT64_MAX)) fail(p, "integer literal too large");
      Token t{TokenType::Int, "", static_cast<int64_t>(v), 0.0, p};
      tokens_.push_back(t);
      return e;
    }
    size_t e = digits(p, dec);
    bool is_float = false;
    if (!after_dot && e + 1 < src_.size() && src_[e] == '.' && is_digit(src_[e + 1])) {
      is_float = true;
      const size_t frac = e + 1;
      e = frac;
      while (e < src_.size() && (is_digit(src_[e]) || (src_[e] == '_' && e > frac && e + 1 < src_.size() && is_digit(src_[e + 1])))) ++e;
    }
    if (!after_dot && e < src_.size() && (src_[e] == 'e' || src_[e] == 'E')) {
      size_t q = e + 1;
      if (q < src_.size() && (src_[q] == '+' || src_[q] == '-')) ++q;
      if (q < src_.size() && is_digit(src_[q])) {
        is_float = true;
        while (q < src_.size() && (is_digit(src_[q]) || (src_[q] == '_' && q + 1 < src_.size() && is_digit(src_[q + 1])))) ++q;
        e = q;
      }
    }
    std::string body;
    for (size_t i = start; i < e; ++i) {
      if (src_[i] != '_') body += src_[i];
    }
    Token t{is_float ? TokenType::Float : TokenType::Int, "", 0, 0.0, start};
    if (is_float) {
      t.float_value = std::strtod(body.c_str(), nullptr);
    } else {
      errno = 0;
      char* endp = nullptr;
      const long long v = std::strtoll(body.c_str(), &endp, 10);
      if (errno != 0) fail(start, "integer literal too large: " + body);
      t.int_value = v;
    }
    tokens_.push_back(t);
    return e;
  }

  static int hex_value(char c) {
    if (is_digit(c)) return c - '0';
    c = static_cast<char>(c | 0x20);
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  }

  // A quoted literal with Python's escapes (\n \t \r \\ \' \" \a \b \f \v, octal, \xhh, \uhhhh,
  // \Uhhhhhhhh, backslash-newline); other backslashes stay as they are.
  size_t lex_string(size_t p) {
    const char quote = src_[p];
    std::string value;
    size_t q = p + 1;
    while (true) {
      if (q >= src_.size()) fail(p, "unterminated string literal");
      const char c = src_[q];
      if (c == quote) break;
      if (c != '\\') {
        value += c;
        ++q;
        continue;
      }
      if (q + 1 >= src_.size()) fail(p, "unterminated string literal");
      const char e = src_[q + 1];
      q += 2;
      switch (e) {
        case 'n': value += '\n'; break;
        case 't': value += '\t'; break;
        case 'r': value += '\r'; break;
        case '\\': value += '\\'; break;
        case '\'': value += '\''; break;
        case '"': value += '"'; break;
        case 'a': value += '\a'; break;
        case 'b': value += '\b'; break;
        case 'f': value += '\f'; break;
        case 'v': value += '\v'; break;
        case '\n': break;  // line continuation
        case 'x':
        case 'u':
        case 'U': {
          const int n = e == 'x' ? 2 : (e == 'u' ? 4 : 8);
          uint32_t cp = 0;
          for (int k = 0; k < n; ++k) {
            const int h = q + k < src_.size() ? hex_value(src_[q + k]) : -1;
            if (h < 0) fail(q - 2, std::string("truncated \\") + e + " escape in string literal");
            cp = cp * 16 + static_cast<uint32_t>(h);
          }
          if (cp > 0x10FFFF) fail(q - 2, "escape out of the Unicode range in string literal");
          q += n;
          utf8_append(value, cp);
          break;
        }
        default:
          if (e >= '0' && e <= '7') {
            uint32_t cp = static_cast<uint32_t>(e - '0');
            for (int k = 0; k < 2 && q < src_.size() && src_[q] >= '0' && src_[q] <= '7'; ++k) cp = cp * 8 + static_cast<uint32_t>(src_[q++] - '0');
            utf8_append(value, cp);
          } else {
            value += '\\';
            value += e;
          }
      }
    }
    Token t{TokenType::String, std::move(value), 0, 0.0, p};
    tokens_.push_back(std::move(t));
    return q + 1;
  }

  size_t lex_op(size_t p) {
    for (std::string_view op : kOps) {
      if (src_.compare(p, op.size(), op) != 0) continue;
      const char c = op[0];
      if (op.size() == 1 && (c == '(' || c == '[' || c == '{')) {
        brackets_.push_back(c);
      } else if (op.size() == 1 && (c == ')' || c == ']' || c == '}')) {
        const char want = c == ')' ? '(' : (c == ']' ? '[' : '{');
        if (brackets_.empty()) fail(p, std::string("unexpected '") + c + "'");
        if (brackets_.back() != want) {
          const char expected = brackets_.back() == '(' ? ')' : (brackets_.back() == '[' ? ']' : '}');
          fail(p, std::string("unexpected '") + c + "', expected '" + expected + "'");
        }
        brackets_.pop_back();
      }
      push(TokenType::Op, p, std::string(op));
      return p + op.size();
    }
    size_t i = p;
    const uint32_t cp = utf8_next(src_, i);
    std::string ch;
    utf8_append(ch, cp);
    fail(p, "unexpected character '" + ch + "'");
  }
};

std::string normalise(std::string_view source) {
  std::string out;
  out.reserve(source.size());
  for (size_t i = 0; i < source.size(); ++i) {
    if (source[i] == '\r') {
      out += '\n';
      if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
    } else {
      out += source[i];
    }
  }
  if (!out.empty() && out.back() == '\n') out.pop_back();  // keep_trailing_newline=False
  return out;
}

}  // namespace

LexResult lex(std::string_view source) { return Lexer(normalise(source)).run(); }

}  // namespace kestrel::jinja
