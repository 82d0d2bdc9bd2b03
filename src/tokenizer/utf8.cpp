#include "tokenizer/utf8.h"

namespace kestrel {

namespace {

// Allowed range of the second byte for each lead byte (Unicode Table 3-7); later continuation
// bytes are always 80..BF. Restricting the second byte is what rules out overlong forms,
// surrogates and code points above U+10FFFF.
bool second_byte_ok(uint8_t lead, uint8_t b) {
  switch (lead) {
    case 0xE0: return b >= 0xA0 && b <= 0xBF;
    case 0xED: return b >= 0x80 && b <= 0x9F;
    case 0xF0: return b >= 0x90 && b <= 0xBF;
    case 0xF4: return b >= 0x80 && b <= 0x8F;
    default: return b >= 0x80 && b <= 0xBF;
  }
}

size_t expected_len(uint8_t lead) {
  if (lead < 0x80) return 1;
  if (lead >= 0xC2 && lead <= 0xDF) return 2;
  if (lead >= 0xE0 && lead <= 0xEF) return 3;
  if (lead >= 0xF0 && lead <= 0xF4) return 4;
  return 0;  // 80..C1, F5..FF never start a character
}

}  // namespace

Utf8Step utf8_step(std::string_view s, size_t pos) {
  const auto lead = static_cast<uint8_t>(s[pos]);
  const size_t need = expected_len(lead);
  if (need == 0) return {1, Utf8Kind::INVALID};
  if (need == 1) return {1, Utf8Kind::VALID};
  size_t n = 1;
  while (n < need) {
    if (pos + n >= s.size()) return {n, Utf8Kind::INCOMPLETE};
    const auto b = static_cast<uint8_t>(s[pos + n]);
    const bool ok = n == 1 ? second_byte_ok(lead, b) : (b >= 0x80 && b <= 0xBF);
    if (!ok) return {n, Utf8Kind::INVALID};
    ++n;
  }
  return {need, Utf8Kind::VALID};
}

bool utf8_is_valid(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    if (static_cast<uint8_t>(s[i]) < 0x80) {
      ++i;
      continue;
    }
    const Utf8Step st = utf8_step(s, i);
    if (st.kind != Utf8Kind::VALID) return false;
    i += st.len;
  }
  return true;
}

std::string utf8_sanitize(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    const Utf8Step st = utf8_step(s, i);
    if (st.kind == Utf8Kind::VALID) {
      out.append(s.substr(i, st.len));
    } else {
      out.append(kReplacementChar);
    }
    i += st.len;
  }
  return out;
}

void utf8_append(uint32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

uint32_t utf8_decode(std::string_view s, size_t pos, size_t* len) {
  const auto b0 = static_cast<uint8_t>(s[pos]);
  const size_t n = utf8_char_len(b0);
  *len = n;
  if (n == 1) return b0;
  uint32_t cp = b0 & (0x7F >> n);
  for (size_t k = 1; k < n && pos + k < s.size(); ++k) {
    cp = (cp << 6) | (static_cast<uint8_t>(s[pos + k]) & 0x3F);
  }
  return cp;
}

}  // namespace kestrel
