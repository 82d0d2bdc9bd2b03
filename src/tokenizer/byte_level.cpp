#include "tokenizer/byte_level.h"

#include <array>

#include "tokenizer/utf8.h"

namespace kestrel {

namespace {

struct ByteLevelTables {
  std::array<std::string, 256> to_text;  // byte -> UTF-8 of its code point
  std::array<int16_t, 512> from_cp{};    // code point (< 512) -> byte, or -1

  ByteLevelTables() {
    from_cp.fill(-1);
    uint32_t next_extra = 256;
    for (uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      const uint32_t cp = printable ? b : next_extra++;
      utf8_append(cp, &to_text[b]);
      from_cp[cp] = static_cast<int16_t>(b);
    }
  }
};

const ByteLevelTables& tables() {
  static const ByteLevelTables t;
  return t;
}

}  // namespace

std::string_view byte_level_char(uint8_t b) { return tables().to_text[b]; }

std::string byte_level_encode(std::string_view bytes) {
  const auto& t = tables();
  std::string out;
  out.reserve(bytes.size() * 2);
  for (char c : bytes) out.append(t.to_text[static_cast<uint8_t>(c)]);
  return out;
}

std::string byte_level_decode(std::string_view text) {
  const auto& t = tables();
  std::string out;
  out.reserve(text.size());
  size_t i = 0;
  while (i < text.size()) {
    const Utf8Step st = utf8_step(text, i);
    if (st.kind == Utf8Kind::VALID) {
      size_t len = 0;
      const uint32_t cp = utf8_decode(text, i, &len);
      if (cp < t.from_cp.size() && t.from_cp[cp] >= 0) {
        out.push_back(static_cast<char>(t.from_cp[cp]));
      } else {
        out.append(text.substr(i, st.len));
      }
    } else {
      out.append(text.substr(i, st.len));
    }
    i += st.len;
  }
  return out;
}

}  // namespace kestrel
