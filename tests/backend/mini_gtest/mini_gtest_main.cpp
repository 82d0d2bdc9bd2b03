// The stand-in GoogleTest's runner (gtest/gtest.h beside this file).
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

namespace mini_gtest {

namespace {

struct RunState {
  bool failed = false;
  bool skipped = false;
  std::vector<std::string> traces;
};
RunState g_state;

// Glob match with '*' and '?'.
bool glob(const char* pat, const char* s) {
  if (*pat == '\0') return *s == '\0';
  if (*pat == '*') return glob(pat + 1, s) || (*s != '\0' && glob(pat, s + 1));
  if (*s == '\0') return false;
  return (*pat == '?' || *pat == *s) && glob(pat + 1, s + 1);
}

bool any_match(const std::string& patterns, const std::string& name) {
  size_t start = 0;
  while (start <= patterns.size()) {
    const size_t end = patterns.find(':', start);
    const std::string p = patterns.substr(start, end == std::string::npos ? std::string::npos : end - start);
    if (!p.empty() && glob(p.c_str(), name.c_str())) return true;
    if (end == std::string::npos) break;
    start = end + 1;
  }
  return false;
}

// GoogleTest's filter: positive patterns, then optionally '-' and negative patterns.
bool selected(const std::string& filter, const std::string& name) {
  const size_t dash = filter.find('-');
  const std::string pos = filter.substr(0, dash);
  const std::string neg = dash == std::string::npos ? "" : filter.substr(dash + 1);
  return (pos.empty() || any_match(pos, name)) && !any_match(neg, name);
}

}  // namespace

std::vector<TestCase>& registry() {
  static std::vector<TestCase> tests;
  return tests;
}

void Failure::operator=(const Message& m) const {
  g_state.failed = true;
  std::printf("%s:%d: Failure\n%s\n", file_, line_, what_.c_str());
  const std::string msg = m.str();
  if (!msg.empty()) std::printf("%s\n", msg.c_str());
  for (auto it = g_state.traces.rbegin(); it != g_state.traces.rend(); ++it) std::printf("%s\n", it->c_str());
  std::fflush(stdout);
}

void Skip::operator=(const Message& m) const {
  g_state.skipped = true;
  const std::string msg = m.str();
  if (!msg.empty()) std::printf("Skipped\n%s\n", msg.c_str());
}

ScopedTrace::ScopedTrace(const char* file, int line, const std::string& msg) {
  g_state.traces.push_back(std::string("Trace: ") + file + ":" + std::to_string(line) + ": " + msg);
}
ScopedTrace::~ScopedTrace() { g_state.traces.pop_back(); }

}  // namespace mini_gtest

int main(int argc, char** argv) {
  using mini_gtest::g_state;
  std::string filter;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.rfind("--gtest_filter=", 0) == 0) filter = arg.substr(15);
  }
  std::vector<std::string> failed;
  int n_run = 0, n_passed = 0, n_skipped = 0;
  const auto t_all = std::chrono::steady_clock::now();
  for (const auto& tc : mini_gtest::registry()) {
    const std::string name = tc.suite + "." + tc.name;
    if (!mini_gtest::selected(filter, name)) continue;
    ++n_run;
    g_state = {};
    std::printf("[ RUN      ] %s\n", name.c_str());
    std::fflush(stdout);
    const auto t0 = std::chrono::steady_clock::now();
    try {
      tc.body();
    } catch (const std::exception& e) {
      g_state.failed = true;
      std::printf("C++ exception thrown in the test body: %s\n", e.what());
    } catch (...) {
      g_state.failed = true;
      std::printf("unknown C++ exception thrown in the test body\n");
    }
    const long long ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count();
    if (g_state.failed) {
      failed.push_back(name);
      std::printf("[  FAILED  ] %s (%lld ms)\n", name.c_str(), ms);
    } else if (g_state.skipped) {
      ++n_skipped;
      std::printf("[  SKIPPED ] %s (%lld ms)\n", name.c_str(), ms);
    } else {
      ++n_passed;
      std::printf("[       OK ] %s (%lld ms)\n", name.c_str(), ms);
    }
    std::fflush(stdout);
  }
  const long long ms_all =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t_all).count();
  std::printf("[==========] %d tests ran. (%lld ms total)\n[  PASSED  ] %d tests.\n", n_run, ms_all, n_passed);
  if (n_skipped > 0) std::printf("[  SKIPPED ] %d tests.\n", n_skipped);
  if (!failed.empty()) {
    std::printf("[  FAILED  ] %zu tests, listed below:\n", failed.size());
    for (const auto& f : failed) std::printf("[  FAILED  ] %s\n", f.c_str());
  }
  return failed.empty() ? 0 : 1;
}
