// Helpers shared by the GGUF reader tests (test_gguf.cpp, test_gguf_golden.cpp).
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "core/error.h"
#include "io/gguf.h"

namespace kestrel::test::gguf {

inline constexpr const char* kName = "img.gguf";

inline GgufFile parse(const std::vector<uint8_t>& img) {
  return GgufFile::parse(img.data(), img.size(), kName);
}

// Succeeds when parsing img throws exactly one kestrel::Error whose message starts with the image
// name and contains phrase. Any other exception escapes and fails the test.
inline ::testing::AssertionResult fails_with(const std::vector<uint8_t>& img, const std::string& phrase) {
  try {
    parse(img);
  } catch (const Error& e) {
    const std::string msg = e.what();
    if (msg.rfind(std::string(kName) + ": ", 0) != 0)
      return ::testing::AssertionFailure() << "message lacks the name prefix: " << msg;
    if (msg.find(phrase) == std::string::npos)
      return ::testing::AssertionFailure() << "message lacks \"" << phrase << "\": " << msg;
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure() << "parsed without error; expected \"" << phrase << "\"";
}

// The message of the Error fn throws ("" when it throws none).
template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

inline float f32_at(const uint8_t* p) {
  float f;
  std::memcpy(&f, p, 4);
  return f;
}

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

}  // namespace kestrel::test::gguf
