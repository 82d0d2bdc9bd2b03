// Names from a file (keys, tensor names) made safe for error messages.
#pragma once

#include <string>
#include <string_view>

namespace kestrel {

// `s` in single quotes with non-printable bytes, backslashes and quotes escaped as \xNN and cut
// after 96 bytes ("..."), so a hostile file cannot put control characters or megabytes into a
// message.
inline std::string quoted_name(std::string_view s) {
  constexpr size_t kMaxShown = 96;
  std::string out = "'";
  for (size_t i = 0; i < s.size() && i < kMaxShown; ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c >= 0x20 && c < 0x7f && c != '\\' && c != '\'') {
      out += static_cast<char>(c);
    } else {
      static constexpr char kHex[] = "0123456789abcdef";
      out += {'\\', 'x', kHex[c >> 4], kHex[c & 15]};
    }
  }
  if (s.size() > kMaxShown) out += "...";
  return out + "'";
}

}  // namespace kestrel
