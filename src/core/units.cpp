#include "core/units.h"

#include <array>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>

#include "core/error.h"

namespace kestrel {
namespace {

struct Unit {
  std::string_view name;  // lower case
  int64_t scale;
};
constexpr int64_t kKi = 1024;
constexpr std::array<Unit, 11> kUnits = {{
    {"b", 1},
    {"kb", 1000},
    {"mb", 1000 * 1000},
    {"gb", 1000LL * 1000 * 1000},
    {"tb", 1000LL * 1000 * 1000 * 1000},
    {"pb", 1000LL * 1000 * 1000 * 1000 * 1000},
    {"kib", kKi},
    {"mib", kKi* kKi},
    {"gib", kKi* kKi* kKi},
    {"tib", kKi* kKi* kKi* kKi},
    {"pib", kKi* kKi* kKi* kKi* kKi},
}};

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

// "4.8 TB" -> number "4.8", value 4.8, scale 1e12. scale is 1 without a unit and 0 when the text
// is not a number followed by a known unit.
struct Quantity {
  std::string_view number;
  double value = 0;
  int64_t scale = 0;
};

Quantity split_quantity(std::string_view text) {
  Quantity q;
  const char* first = text.data();
  const char* last = text.data() + text.size();
  const auto [end, ec] = std::from_chars(first, last, q.value);
  if (ec != std::errc() || end == first) return q;
  q.number = std::string_view(first, static_cast<size_t>(end - first));
  const std::string unit = lower(trim(std::string_view(end, static_cast<size_t>(last - end))));
  if (unit.empty()) {
    q.scale = 1;
    return q;
  }
  for (const Unit& u : kUnits)
    if (unit == u.name) q.scale = u.scale;
  return q;
}

// Appended piece by piece: "'" + std::string(s) trips a GCC 12 -Wrestrict false positive.
std::string quoted(std::string_view s) {
  std::string out;
  out.reserve(s.size() + 2);
  out += '\'';
  out += s;
  out += '\'';
  return out;
}

}  // namespace

int64_t parse_byte_size(std::string_view text, std::string_view what) {
  const std::string w(what);
  const Quantity q = split_quantity(trim(text));
  if (q.scale == 0 || !std::isfinite(q.value))
    throw Error(w + ": cannot read " + quoted(text) +
                " as a size (bytes, or a number with a unit: KB/MB/GB/TB = 1e3.., KiB/MiB/GiB/TiB = 1024..)");
  // Whole numbers times a unit are computed exactly; only fractions go through double.
  int64_t mantissa = 0;
  const auto [end, ec] = std::from_chars(q.number.data(), q.number.data() + q.number.size(), mantissa);
  if (ec == std::errc() && end == q.number.data() + q.number.size()) {
    int64_t bytes = 0;
    if (__builtin_mul_overflow(mantissa, q.scale, &bytes))
      throw Error(w + ": " + quoted(text) + " is too large");
    if (bytes < 1) throw Error(w + ": must be at least 1 byte, got " + quoted(text));
    return bytes;
  }
  const long double bytes = std::floor(static_cast<long double>(q.value) * q.scale);
  if (bytes >= 9.2e18L) throw Error(w + ": " + quoted(text) + " is too large");
  if (!(bytes >= 1)) throw Error(w + ": must be at least 1 byte, got " + quoted(text));
  return static_cast<int64_t>(bytes);
}

double parse_bandwidth(std::string_view text, std::string_view what) {
  std::string_view t = trim(text);
  if (t.size() >= 2 && t[t.size() - 2] == '/' && (t.back() == 's' || t.back() == 'S')) t.remove_suffix(2);
  const Quantity q = split_quantity(trim(t));
  if (q.scale == 0)
    throw Error(std::string(what) + ": cannot read " + quoted(text) +
                " as a bandwidth (bytes/s, or e.g. 4.8TB/s, 900GB/s, 2TiB/s)");
  const double bps = q.value * static_cast<double>(q.scale);
  if (!std::isfinite(bps) || !(bps > 0))
    throw Error(std::string(what) + ": must be a positive, finite bandwidth, got " + quoted(text));
  return bps;
}

std::string format_bytes_binary(double bytes) {
  static constexpr std::array<const char*, 5> kNames = {"KiB", "MiB", "GiB", "TiB", "PiB"};
  if (std::fabs(bytes) < 1024) return std::to_string(static_cast<int64_t>(bytes)) + " B";
  double v = bytes / 1024;
  size_t i = 0;
  while (std::fabs(v) >= 1024 && i + 1 < kNames.size()) {
    v /= 1024;
    ++i;
  }
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.2f %s", v, kNames[i]);
  return buf;
}

std::string format_bandwidth(double bytes_per_s) {
  static constexpr std::array<const char*, 5> kNames = {"B/s", "KB/s", "MB/s", "GB/s", "TB/s"};
  double v = bytes_per_s;
  size_t i = 0;
  while (std::fabs(v) >= 1000 && i + 1 < kNames.size()) {
    v /= 1000;
    ++i;
  }
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.2f %s", v, kNames[i]);
  return buf;
}

std::string format_thousands(int64_t n) {
  const uint64_t magnitude = n < 0 ? 0 - static_cast<uint64_t>(n) : static_cast<uint64_t>(n);
  const std::string digits = std::to_string(magnitude);
  std::string out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return n < 0 ? "-" + out : out;
}

}  // namespace kestrel
