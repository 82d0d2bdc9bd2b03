// Helpers shared by the GGUF reader tests (test_gguf.cpp, test_gguf_golden.cpp) and the tests that
// parse GGUF images of their own (test_model_footprint.cpp).
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "io/gguf.h"
#include "test_util.h"

namespace kestrel::test::gguf {

using ::kestrel::test::error_of;

inline constexpr const char* kName = "img.gguf";

inline GgufFile parse(const std::vector<uint8_t>& img) {
  return GgufFile::parse(img.data(), img.size(), kName);
}

// Succeeds when parsing img throws exactly one kestrel::Error whose message starts with the image
// name and contains phrase. Any other exception escapes and fails the test.
inline ::testing::AssertionResult fails_with(const std::vector<uint8_t>& img, const std::string& phrase) {
  return fails_naming(kName, phrase, [&] { parse(img); });
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
