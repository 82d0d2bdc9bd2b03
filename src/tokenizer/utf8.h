// UTF-8 helpers for the tokenizers: stepping through possibly broken byte strings, replacing
// ill-formed parts by U+FFFD, and encoding code points.
//
// Ill-formed input is replaced per "maximal subpart" (Unicode 15, section 3.9, U+FFFD substitution
// of maximal subparts, the practice WHATWG's decoder also follows): each maximal prefix of a
// would-be sequence that cannot be completed becomes one U+FFFD. Decoders that agree on this
// produce the same replacement text for the same bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace kestrel {

inline constexpr std::string_view kReplacementChar = "\xEF\xBF\xBD";  // U+FFFD

enum class Utf8Kind : uint8_t {
  VALID,       // `len` bytes form one well-formed character
  INVALID,     // `len` bytes are a maximal ill-formed subpart: replace them by one U+FFFD
  INCOMPLETE,  // the string ends inside a character that could still become well-formed
};

struct Utf8Step {
  size_t len = 0;
  Utf8Kind kind = Utf8Kind::VALID;
};

// Classifies the bytes starting at s[pos] (pos < s.size()).
Utf8Step utf8_step(std::string_view s, size_t pos);

// Length of a well-formed character from its lead byte (1 for ASCII, 2..4), 1 for anything that
// cannot start one. Only for text already known to be valid.
inline size_t utf8_char_len(uint8_t lead) {
  if (lead < 0x80) return 1;
  if ((lead & 0xE0) == 0xC0) return 2;
  if ((lead & 0xF0) == 0xE0) return 3;
  if ((lead & 0xF8) == 0xF0) return 4;
  return 1;
}

bool utf8_is_valid(std::string_view s);

// A copy of s where every ill-formed subpart (and an incomplete tail) is replaced by U+FFFD.
std::string utf8_sanitize(std::string_view s);

// Appends the UTF-8 encoding of code point cp (cp <= 0x10FFFF, not a surrogate) to *out.
void utf8_append(uint32_t cp, std::string* out);

// Decodes the well-formed character at s[pos]; *len receives its length. For valid text only.
uint32_t utf8_decode(std::string_view s, size_t pos, size_t* len);

}  // namespace kestrel
