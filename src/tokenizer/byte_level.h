// The GPT-2 byte-level alphabet: every byte 0..255 gets a printable code point, so that a
// byte-level BPE vocabulary can be stored as text. Bytes that are printable Latin-1 characters
// ('!'..'~', U+00A1..U+00AC, U+00AE..U+00FF) map to themselves; the remaining 68 bytes map, in
// increasing byte order, to U+0100, U+0101, ... (so ' ' = 0x20 becomes U+0120 'Ġ' and '\n'
// becomes U+010A 'Ċ'). Source: the GPT-2 encoder's bytes_to_unicode table (openai/gpt-2), which
// every byte-level BPE (GPT-2, Llama 3, Qwen2, SmolLM, ...) shares.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace kestrel {

// UTF-8 text of the code point standing for byte b.
std::string_view byte_level_char(uint8_t b);

// Maps raw bytes to their byte-level text (each byte becomes one character).
std::string byte_level_encode(std::string_view bytes);

// Maps byte-level text back to raw bytes. A character outside the alphabet (for example in an
// added token stored verbatim) is copied through as its UTF-8 bytes.
std::string byte_level_decode(std::string_view text);

}  // namespace kestrel
