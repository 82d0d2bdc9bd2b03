// Errors and invariant checks.
//
// Errors at boundaries (files, requests, flags) throw kestrel::Error with a message that names the
// field and the bad value. Inside the engine, KESTREL_ASSERT reports file and line for broken
// invariants (a bug, never bad input).
#pragma once

#include <stdexcept>
#include <string>

namespace kestrel {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

[[noreturn]] void assert_fail(const char* expr, const char* file, int line, const std::string& msg);

}  // namespace kestrel

#define KESTREL_ASSERT(cond, msg)                                          \
  do {                                                                     \
    if (!(cond)) ::kestrel::assert_fail(#cond, __FILE__, __LINE__, (msg)); \
  } while (0)
