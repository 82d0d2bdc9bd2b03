// A small stand-in for the part of GoogleTest's API that the CUDA op tests use, for building them
// on machines without GoogleTest (the GPU machine: scripts/device/cuda_tests.sh). Its output lines
// ([ RUN ], [ OK ], [ SKIPPED ], [ FAILED ]) have GoogleTest's shape, so one parser reads both.
// Supported: TEST, EXPECT_/ASSERT_ TRUE FALSE EQ NE LT LE GT GE, EXPECT_THROW, GTEST_SKIP,
// SCOPED_TRACE, and `<< message` after each of them; --gtest_filter with '*' and '?' patterns.
#pragma once

#include <concepts>
#include <sstream>
#include <string>
#include <vector>

namespace mini_gtest {

struct TestCase {
  std::string suite, name;
  void (*body)();
};
std::vector<TestCase>& registry();

struct Registrar {
  Registrar(const char* suite, const char* name, void (*body)()) { registry().push_back({suite, name, body}); }
};

class Message {
 public:
  template <class T>
  Message& operator<<(const T& v) {
    os_ << v;
    return *this;
  }
  std::string str() const { return os_.str(); }

 private:
  std::ostringstream os_;
};

// Records a failure of the running test when a message is assigned to it (file, line, what failed,
// the message, the active SCOPED_TRACEs).
class Failure {
 public:
  Failure(const char* file, int line, std::string what) : file_(file), line_(line), what_(std::move(what)) {}
  void operator=(const Message& m) const;

 private:
  const char* file_;
  int line_;
  std::string what_;
};

// Marks the running test skipped.
struct Skip {
  void operator=(const Message& m) const;
};

class ScopedTrace {
 public:
  ScopedTrace(const char* file, int line, const std::string& msg);
  ~ScopedTrace();
  ScopedTrace(const ScopedTrace&) = delete;
  ScopedTrace& operator=(const ScopedTrace&) = delete;
};

template <class T>
std::string text_of(const T& v) {
  if constexpr (requires(std::ostream& os) { os << v; }) {
    std::ostringstream os;
    os << v;
    return os.str();
  } else {
    return "(unprintable)";
  }
}

struct Outcome {
  bool ok;
  std::string text;
};

template <class A, class B, class Op>
Outcome compare(const A& a, const B& b, Op op, const char* a_text, const char* b_text, const char* op_text) {
  if (op(a, b)) return {true, {}};
  return {false, std::string("Expected: (") + a_text + ") " + op_text + " (" + b_text + "), actual: " + text_of(a) +
                     " vs " + text_of(b)};
}

template <class E, class F>
bool throws(F&& f) {
  try {
    f();
  } catch (const E&) {
    return true;
  } catch (...) {
    return false;
  }
  return false;
}

}  // namespace mini_gtest

#define MINI_GTEST_CAT2_(a, b) a##b
#define MINI_GTEST_CAT_(a, b) MINI_GTEST_CAT2_(a, b)

#define TEST(suite, name)                                                                        \
  static void mini_gtest_##suite##_##name();                                                     \
  static const ::mini_gtest::Registrar mini_gtest_registrar_##suite##_##name(#suite, #name,      \
                                                                             &mini_gtest_##suite##_##name); \
  static void mini_gtest_##suite##_##name()

// `switch (0) case 0: default:` keeps a following `else` from binding to the macro's `if`.
#define MINI_GTEST_BOOL_(cond, text, on_failure) \
  switch (0)                                     \
  case 0:                                        \
  default:                                       \
    if (cond)                                    \
      ;                                          \
    else                                         \
      on_failure ::mini_gtest::Failure(__FILE__, __LINE__, text) = ::mini_gtest::Message()

#define MINI_GTEST_CMP_(a, b, op, on_failure)                                                              \
  switch (0)                                                                                               \
  case 0:                                                                                                  \
  default:                                                                                                 \
    if (const ::mini_gtest::Outcome mini_gtest_outcome_ = ::mini_gtest::compare(                          \
            (a), (b), [](const auto& x, const auto& y) { return x op y; }, #a, #b, #op);                  \
        mini_gtest_outcome_.ok)                                                                            \
      ;                                                                                                    \
    else                                                                                                   \
      on_failure ::mini_gtest::Failure(__FILE__, __LINE__, mini_gtest_outcome_.text) = ::mini_gtest::Message()

#define EXPECT_TRUE(c) MINI_GTEST_BOOL_(static_cast<bool>(c), "Expected true: " #c, )
#define EXPECT_FALSE(c) MINI_GTEST_BOOL_(!static_cast<bool>(c), "Expected false: " #c, )
#define ASSERT_TRUE(c) MINI_GTEST_BOOL_(static_cast<bool>(c), "Expected true: " #c, return)
#define ASSERT_FALSE(c) MINI_GTEST_BOOL_(!static_cast<bool>(c), "Expected false: " #c, return)
#define EXPECT_EQ(a, b) MINI_GTEST_CMP_(a, b, ==, )
#define EXPECT_NE(a, b) MINI_GTEST_CMP_(a, b, !=, )
#define EXPECT_LT(a, b) MINI_GTEST_CMP_(a, b, <, )
#define EXPECT_LE(a, b) MINI_GTEST_CMP_(a, b, <=, )
#define EXPECT_GT(a, b) MINI_GTEST_CMP_(a, b, >, )
#define EXPECT_GE(a, b) MINI_GTEST_CMP_(a, b, >=, )
#define ASSERT_EQ(a, b) MINI_GTEST_CMP_(a, b, ==, return)
#define ASSERT_NE(a, b) MINI_GTEST_CMP_(a, b, !=, return)
#define ASSERT_LT(a, b) MINI_GTEST_CMP_(a, b, <, return)
#define ASSERT_LE(a, b) MINI_GTEST_CMP_(a, b, <=, return)
#define ASSERT_GT(a, b) MINI_GTEST_CMP_(a, b, >, return)
#define ASSERT_GE(a, b) MINI_GTEST_CMP_(a, b, >=, return)
#define EXPECT_THROW(stmt, exc)                                                                       \
  MINI_GTEST_BOOL_(::mini_gtest::throws<exc>([&] { stmt; }), "Expected " #stmt " to throw " #exc, )
#define GTEST_SKIP() return ::mini_gtest::Skip() = ::mini_gtest::Message()
#define SCOPED_TRACE(msg) \
  const ::mini_gtest::ScopedTrace MINI_GTEST_CAT_(mini_gtest_trace_, __LINE__)(__FILE__, __LINE__, (msg))
