// Overflow-checked int64 arithmetic for sizes computed from untrusted files and flags (a config
// that says vocab_size = 1e18 must give an error, not a wrapped negative byte count).
#pragma once

#include <cstdint>
#include <string>

#include "core/error.h"

namespace kestrel {

// a * b; throws kestrel::Error("<what> overflows int64") when the product does not fit.
inline int64_t checked_mul(int64_t a, int64_t b, const std::string& what) {
  int64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r)) throw Error(what + " overflows int64");
  return r;
}

// a + b; throws kestrel::Error("<what> overflows int64") when the sum does not fit.
inline int64_t checked_add(int64_t a, int64_t b, const std::string& what) {
  int64_t r = 0;
  if (__builtin_add_overflow(a, b, &r)) throw Error(what + " overflows int64");
  return r;
}

}  // namespace kestrel
