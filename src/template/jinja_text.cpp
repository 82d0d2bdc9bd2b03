#include "template/jinja_text.h"

#include <algorithm>

namespace kestrel::jinja {

uint32_t utf8_next(std::string_view s, size_t& i) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  int n = 0;
  uint32_t cp = 0;
  if (b0 < 0x80) {
    ++i;
    return b0;
  } else if ((b0 & 0xE0) == 0xC0) {
    n = 1, cp = b0 & 0x1F;
  } else if ((b0 & 0xF0) == 0xE0) {
    n = 2, cp = b0 & 0x0F;
  } else if ((b0 & 0xF8) == 0xF0) {
    n = 3, cp = b0 & 0x07;
  } else {
    ++i;
    return b0;  // a stray continuation or invalid lead byte stands for itself
  }
  if (i + n >= s.size()) {  // truncated sequence
    ++i;
    return b0;
  }
  for (int k = 1; k <= n; ++k) {
    const auto b = static_cast<unsigned char>(s[i + k]);
    if ((b & 0xC0) != 0x80) {
      ++i;
      return b0;
    }
    cp = (cp << 6) | (b & 0x3F);
  }
  i += n + 1;
  return cp;
}

void utf8_append(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

size_t utf8_length(std::string_view s) {
  size_t n = 0;
  for (size_t i = 0; i < s.size(); ++n) utf8_next(s, i);
  return n;
}

std::vector<std::string_view> utf8_chars(std::string_view s) {
  std::vector<std::string_view> out;
  for (size_t i = 0; i < s.size();) {
    const size_t start = i;
    utf8_next(s, i);
    out.push_back(s.substr(start, i - start));
  }
  return out;
}

bool is_py_space(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 ||
         cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 ||
         cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

namespace {

// Pairs in blocks where one parity is uppercase and the next code point its lowercase.
bool in_pair_block(uint32_t cp, bool* upper) {
  struct Block {
    uint32_t lo, hi;
    bool even_upper;
  };
  static constexpr Block kBlocks[] = {
      {0x0100, 0x012F, true}, {0x0132, 0x0137, true}, {0x0139, 0x0148, false},
      {0x014A, 0x0177, true}, {0x0179, 0x017E, false}, {0x0460, 0x0481, true},
      {0x048A, 0x04BF, true},
  };
  for (const Block& b : kBlocks) {
    if (cp >= b.lo && cp <= b.hi) {
      *upper = ((cp % 2) == 0) == b.even_upper;
      return true;
    }
  }
  return false;
}

}  // namespace

uint32_t to_upper_cp(uint32_t cp) {
  if (cp >= 'a' && cp <= 'z') return cp - 32;
  if (cp < 0x80) return cp;
  if (cp >= 0xE0 && cp <= 0xFE && cp != 0xF7) return cp - 32;
  if (cp == 0xFF) return 0x178;
  if (cp == 0x131) return 'I';
  if (cp == 0x17F) return 'S';
  bool upper = false;
  if (in_pair_block(cp, &upper)) return upper ? cp : cp - 1;
  if (cp >= 0x3B1 && cp <= 0x3C9 && cp != 0x3C2) return cp - 32;
  if (cp == 0x3C2) return 0x3A3;
  if (cp == 0x3AC) return 0x386;
  if (cp >= 0x3AD && cp <= 0x3AF) return cp - 37;
  if (cp == 0x3CC) return 0x38C;
  if (cp == 0x3CD || cp == 0x3CE) return cp - 63;
  if (cp >= 0x430 && cp <= 0x44F) return cp - 32;
  if (cp >= 0x450 && cp <= 0x45F) return cp - 80;
  return cp;
}

uint32_t to_lower_cp(uint32_t cp) {
  if (cp >= 'A' && cp <= 'Z') return cp + 32;
  if (cp < 0x80) return cp;
  if (cp >= 0xC0 && cp <= 0xDE && cp != 0xD7) return cp + 32;
  if (cp == 0x178) return 0xFF;
  if (cp == 0x130) return 'i';
  bool upper = false;
  if (in_pair_block(cp, &upper)) return upper ? cp + 1 : cp;
  if (cp >= 0x391 && cp <= 0x3A9 && cp != 0x3A2) return cp + 32;
  if (cp == 0x386) return 0x3AC;
  if (cp >= 0x388 && cp <= 0x38A) return cp + 37;
  if (cp == 0x38C) return 0x3CC;
  if (cp == 0x38E || cp == 0x38F) return cp + 63;
  if (cp >= 0x410 && cp <= 0x42F) return cp + 32;
  if (cp >= 0x400 && cp <= 0x40F) return cp + 80;
  return cp;
}

bool is_upper_cp(uint32_t cp) { return to_lower_cp(cp) != cp; }
bool is_lower_cp(uint32_t cp) { return to_upper_cp(cp) != cp || cp == 0xDF; }
bool is_cased(uint32_t cp) { return is_upper_cp(cp) || is_lower_cp(cp); }

bool is_alnum_cp(uint32_t cp) {
  if (cp < 0x80) return (cp >= '0' && cp <= '9') || (cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z');
  if (is_cased(cp)) return true;
  return cp >= 0x100 && !is_py_space(cp);
}

std::string py_upper(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const uint32_t cp = utf8_next(s, i);
    if (cp == 0xDF) {
      out += "SS";  // ß has no single uppercase letter
    } else {
      utf8_append(out, to_upper_cp(cp));
    }
  }
  return out;
}

std::string py_lower(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) utf8_append(out, to_lower_cp(utf8_next(s, i)));
  return out;
}

std::string py_title(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  bool prev_cased = false;
  for (size_t i = 0; i < s.size();) {
    const uint32_t cp = utf8_next(s, i);
    utf8_append(out, prev_cased ? to_lower_cp(cp) : to_upper_cp(cp));
    prev_cased = is_cased(cp);
  }
  return out;
}

std::string py_capitalize(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  bool first = true;
  for (size_t i = 0; i < s.size();) {
    const uint32_t cp = utf8_next(s, i);
    utf8_append(out, first ? to_upper_cp(cp) : to_lower_cp(cp));
    first = false;
  }
  return out;
}

std::string jinja_title(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  bool word_start = true;
  for (size_t i = 0; i < s.size();) {
    const uint32_t cp = utf8_next(s, i);
    const bool sep = is_py_space(cp) || cp == '-' || cp == '(' || cp == '{' || cp == '[' || cp == '<';
    if (sep) {
      utf8_append(out, cp);
      word_start = true;
    } else {
      utf8_append(out, word_start ? to_upper_cp(cp) : to_lower_cp(cp));
      word_start = false;
    }
  }
  return out;
}

std::string py_strip(std::string_view s, const std::optional<std::string>& chars, bool left, bool right) {
  std::vector<uint32_t> set;
  if (chars) {
    for (size_t i = 0; i < chars->size();) set.push_back(utf8_next(*chars, i));
  }
  auto strippable = [&](uint32_t cp) {
    return chars ? std::find(set.begin(), set.end(), cp) != set.end() : is_py_space(cp);
  };
  size_t begin = 0;
  size_t end = s.size();
  if (left) {
    while (begin < end) {
      size_t j = begin;
      if (!strippable(utf8_next(s, j))) break;
      begin = j;
    }
  }
  if (right) {
    while (end > begin) {
      size_t start = end - 1;
      while (start > begin && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
      size_t j = start;
      const uint32_t cp = utf8_next(s, j);
      if (j != end) {  // a malformed tail: step back one byte only
        start = end - 1;
        j = start;
        if (!strippable(utf8_next(s, j))) break;
      } else if (!strippable(cp)) {
        break;
      }
      end = start;
    }
  }
  return std::string(s.substr(begin, end - begin));
}

namespace {

// Position and length of the whitespace run starting at or after `from`, or npos.
size_t next_space(std::string_view s, size_t from, size_t* len) {
  for (size_t i = from; i < s.size();) {
    size_t j = i;
    if (is_py_space(utf8_next(s, j))) {
      size_t k = j;
      while (k < s.size()) {
        size_t m = k;
        if (!is_py_space(utf8_next(s, m))) break;
        k = m;
      }
      *len = k - i;
      return i;
    }
    i = j;
  }
  return std::string_view::npos;
}

}  // namespace

std::vector<std::string> py_split(std::string_view s, const std::optional<std::string>& sep, int64_t maxsplit) {
  std::vector<std::string> out;
  if (sep) {
    size_t pos = 0;
    while (maxsplit < 0 || static_cast<int64_t>(out.size()) < maxsplit) {
      const size_t hit = s.find(*sep, pos);
      if (hit == std::string_view::npos) break;
      out.emplace_back(s.substr(pos, hit - pos));
      pos = hit + sep->size();
    }
    out.emplace_back(s.substr(pos));
    return out;
  }
  const std::string trimmed = py_strip(s, std::nullopt, true, false);
  std::string_view t = trimmed;
  size_t pos = 0;
  while (pos < t.size()) {
    if (maxsplit >= 0 && static_cast<int64_t>(out.size()) >= maxsplit) {
      out.emplace_back(t.substr(pos));
      return out;
    }
    size_t len = 0;
    const size_t hit = next_space(t, pos, &len);
    if (hit == std::string_view::npos) {
      out.emplace_back(t.substr(pos));
      return out;
    }
    out.emplace_back(t.substr(pos, hit - pos));
    pos = hit + len;
  }
  return out;
}

std::vector<std::string> py_rsplit(std::string_view s, const std::optional<std::string>& sep, int64_t maxsplit) {
  if (maxsplit < 0) return py_split(s, sep, -1);
  std::vector<std::string> out;
  if (sep) {
    size_t end = s.size();
    while (static_cast<int64_t>(out.size()) < maxsplit && end >= sep->size()) {
      const size_t hit = s.rfind(*sep, end - sep->size());
      if (hit == std::string_view::npos) break;
      out.emplace_back(s.substr(hit + sep->size(), end - hit - sep->size()));
      end = hit;
    }
    out.emplace_back(s.substr(0, end));
    std::reverse(out.begin(), out.end());
    return out;
  }
  // Split on whitespace from the right: take words off the end.
  std::vector<std::string> words = py_split(s, std::nullopt, -1);
  if (static_cast<int64_t>(words.size()) <= maxsplit + 1) return words;
  const std::string trimmed = py_strip(s, std::nullopt, false, true);
  std::string_view t = trimmed;
  size_t end = t.size();
  for (int64_t k = 0; k < maxsplit; ++k) {
    const std::string& w = words[words.size() - 1 - k];
    end -= w.size();
    out.push_back(w);
    // Skip the whitespace before the word.
    while (end > 0) {
      size_t start = end - 1;
      while (start > 0 && (static_cast<unsigned char>(t[start]) & 0xC0) == 0x80) --start;
      size_t j = start;
      if (!is_py_space(utf8_next(t, j))) break;
      end = start;
    }
  }
  out.emplace_back(t.substr(0, end));
  std::reverse(out.begin(), out.end());
  return out;
}

std::vector<std::string> py_splitlines(std::string_view s) {
  std::vector<std::string> out;
  size_t line_start = 0;
  for (size_t i = 0; i < s.size();) {
    const size_t at = i;
    const uint32_t cp = utf8_next(s, i);
    const bool brk = cp == '\n' || cp == '\r' || cp == 0x0B || cp == 0x0C || (cp >= 0x1C && cp <= 0x1E) ||
                     cp == 0x85 || cp == 0x2028 || cp == 0x2029;
    if (!brk) continue;
    out.emplace_back(s.substr(line_start, at - line_start));
    if (cp == '\r' && i < s.size() && s[i] == '\n') ++i;
    line_start = i;
  }
  if (line_start < s.size()) out.emplace_back(s.substr(line_start));
  return out;
}

bool py_replace(std::string_view s, std::string_view old, std::string_view repl, int64_t count,
                size_t max_bytes, std::string& out) {
  out.clear();
  int64_t done = 0;
  if (old.empty()) {
    const std::vector<std::string_view> chars = utf8_chars(s);
    for (size_t k = 0; k <= chars.size(); ++k) {
      if (count < 0 || done < count) {
        out += repl;
        ++done;
      }
      if (k < chars.size()) out += chars[k];
      if (out.size() > max_bytes) return false;
    }
    return true;
  }
  size_t pos = 0;
  while (count < 0 || done < count) {
    const size_t hit = s.find(old, pos);
    if (hit == std::string_view::npos) break;
    out.append(s.substr(pos, hit - pos));
    out.append(repl);
    pos = hit + old.size();
    ++done;
    if (out.size() > max_bytes) return false;
  }
  out.append(s.substr(pos));
  return out.size() <= max_bytes;
}

void append_py_string_repr(std::string& out, std::string_view s) {
  const bool has_single = s.find('\'') != std::string_view::npos;
  const bool has_double = s.find('"') != std::string_view::npos;
  const char quote = has_single && !has_double ? '"' : '\'';
  static const char* hex = "0123456789abcdef";
  out += quote;
  for (size_t i = 0; i < s.size();) {
    const size_t start = i;
    const uint32_t cp = utf8_next(s, i);
    if (cp == static_cast<uint32_t>(quote) || cp == '\\') {
      out += '\\';
      out += static_cast<char>(cp);
    } else if (cp == '\n') {
      out += "\\n";
    } else if (cp == '\r') {
      out += "\\r";
    } else if (cp == '\t') {
      out += "\\t";
    } else if (cp < 0x20 || (cp >= 0x7F && cp <= 0xA0) || cp == 0xAD) {
      out += "\\x";
      out += hex[(cp >> 4) & 0xF];
      out += hex[cp & 0xF];
    } else if (cp == 0x2028 || cp == 0x2029) {
      out += cp == 0x2028 ? "\\u2028" : "\\u2029";
    } else {
      out.append(s.substr(start, i - start));
    }
  }
  out += quote;
}

std::string html_escape(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&#34;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

}  // namespace kestrel::jinja
