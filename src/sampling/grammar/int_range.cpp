// Digit-range grammars: split [lo, hi] by digit count, then by the first digit where the bounds
// differ (the classic construction of numeric-range regular expressions).
#include "sampling/grammar/int_range.h"

#include <string>
#include <vector>

namespace kestrel::grammar {

namespace {

std::string join_alts(const std::vector<std::string>& alts) {
  if (alts.size() == 1) return alts[0];
  std::string out = "(";
  for (size_t i = 0; i < alts.size(); ++i) out += (i ? " | " : "") + alts[i];
  return out + ")";
}

std::string digit_class(char a, char b) {
  if (a == b) return std::string("\"") + a + "\"";
  return std::string("[") + a + "-" + b + "]";
}

std::string any_digits(size_t n) {
  if (n == 0) return "";
  if (n == 1) return "[0-9]";
  return "[0-9]{" + std::to_string(n) + "}";
}

// Equal-length digit strings lo <= hi: every string of that length between them.
std::string same_length(const std::string& lo, const std::string& hi) {
  if (lo.empty()) return "\"\"";
  size_t p = 0;
  while (p < lo.size() && lo[p] == hi[p]) ++p;
  std::string prefix = p > 0 ? "\"" + lo.substr(0, p) + "\"" : "";
  if (p == lo.size()) return prefix;
  size_t rest = lo.size() - p - 1;
  std::string lo_rest = lo.substr(p + 1), hi_rest = hi.substr(p + 1);
  auto sp = [&](const std::string& x) { return prefix.empty() ? x : prefix + " " + x; };
  bool lo_zeros = lo_rest.find_first_not_of('0') == std::string::npos;
  bool hi_nines = hi_rest.find_first_not_of('9') == std::string::npos;
  if (lo_zeros && hi_nines) return sp(digit_class(lo[p], hi[p]) + (rest ? " " + any_digits(rest) : ""));
  std::vector<std::string> alts;
  char first = lo[p], last = hi[p];
  if (lo_zeros) {
    ++first;
    alts.push_back(digit_class(lo[p], lo[p]) + (rest ? " " + any_digits(rest) : ""));
  } else {
    alts.push_back(digit_class(lo[p], lo[p]) + " " + same_length(lo_rest, std::string(rest, '9')));
    ++first;
  }
  if (hi_nines) {
    alts.push_back(digit_class(first, last) + (rest ? " " + any_digits(rest) : ""));
  } else {
    if (first <= last - 1) alts.push_back(digit_class(first, static_cast<char>(last - 1)) + (rest ? " " + any_digits(rest) : ""));
    alts.push_back(digit_class(last, last) + " " + same_length(std::string(rest, '0'), hi_rest));
  }
  return sp(join_alts(alts));
}

// Non-negative [a, b]; b absent: unbounded.
std::string nonneg(uint64_t a, std::optional<uint64_t> b) {
  std::string as = std::to_string(a);
  std::vector<std::string> alts;
  size_t max_len = b ? std::to_string(*b).size() : as.size();
  for (size_t len = as.size(); len <= max_len; ++len) {
    std::string lo = len == as.size() ? as : "1" + std::string(len - 1, '0');
    if (len == 1 && len != as.size()) lo = "0";
    std::string hi = (b && len == max_len) ? std::to_string(*b) : std::string(len, '9');
    alts.push_back(same_length(lo, hi));
  }
  if (!b) alts.push_back("[1-9] [0-9]{" + std::to_string(as.size()) + ",}");  // longer than a
  return join_alts(alts);
}

}  // namespace

std::string int_range_gbnf(std::optional<int64_t> lo, std::optional<int64_t> hi) {
  std::vector<std::string> alts;
  // Negative part: "-" then the magnitudes in [max(1, -hi), -lo].
  if (!lo || *lo < 0) {
    uint64_t mag_lo = (hi && *hi < 0) ? static_cast<uint64_t>(-(*hi + 1)) + 1 : 1;
    std::optional<uint64_t> mag_hi;
    if (lo) mag_hi = static_cast<uint64_t>(-(*lo + 1)) + 1;
    alts.push_back("\"-\" " + nonneg(mag_lo, mag_hi));
  }
  if (!hi || *hi >= 0) {
    uint64_t a = (lo && *lo > 0) ? static_cast<uint64_t>(*lo) : 0;
    std::optional<uint64_t> b;
    if (hi) b = static_cast<uint64_t>(*hi);
    alts.push_back(nonneg(a, b));
  }
  return join_alts(alts);
}

}  // namespace kestrel::grammar
