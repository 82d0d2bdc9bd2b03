// Typed fields of a Hugging Face JSON config (config.json, tokenizer_config.json), each error
// naming the file and the field.
#pragma once

#include <cmath>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>

#include "core/error.h"
#include "io/json_text.h"

namespace kestrel {

// Reads and parses a JSON file. Throws kestrel::Error("<path>: ...") when it cannot be opened or
// is not valid JSON.
nlohmann::json read_json_file(const std::string& path);

class HfFields {
 public:
  static constexpr int64_t kMaxDim = int64_t{1} << 30;  // bound for a layer count, head count or width

  HfFields(const nlohmann::json& j, std::string where) : j_(j), where_(std::move(where)) {}

  // null counts as absent (DeepSeek-V2-Lite writes "q_lora_rank": null, Qwen2 "sliding_window": null).
  bool has(const char* key) const { return j_.is_object() && j_.contains(key) && !j_.at(key).is_null(); }
  const nlohmann::json& at(const char* key) const { return j_.at(key); }

  // A required integer in [lo, kMaxDim] (an integral float such as 4096.0 counts).
  int64_t get(const char* key, int64_t lo = 1) const {
    if (!has(key)) fail("missing required field '" + std::string(key) + "'");
    return to_int(key, lo);
  }
  int64_t get_or(const char* key, int64_t fallback, int64_t lo = 1) const {
    return has(key) ? to_int(key, lo) : fallback;
  }
  // A finite number (integer or float).
  double number(const char* key) const {
    if (!has(key)) fail("missing required field '" + std::string(key) + "'");
    const nlohmann::json& v = j_.at(key);
    if (!v.is_number() || !std::isfinite(v.get<double>()))
      fail("field '" + std::string(key) + "' must be a finite number, got " + json_shown(v));
    return v.get<double>();
  }
  double number_or(const char* key, double fallback) const { return has(key) ? number(key) : fallback; }
  bool flag_or(const char* key, bool fallback) const {
    if (!has(key)) return fallback;
    if (!j_.at(key).is_boolean())
      fail("field '" + std::string(key) + "' must be true or false, got " + json_shown(j_.at(key)));
    return j_.at(key).get<bool>();
  }
  std::string string_or(const char* key, std::string fallback) const {
    if (!has(key)) return fallback;
    if (!j_.at(key).is_string())
      fail("field '" + std::string(key) + "' must be a string, got " + json_shown(j_.at(key)));
    return j_.at(key).get<std::string>();
  }
  [[noreturn]] void fail(const std::string& msg) const { throw Error(where_ + ": " + msg); }
  const std::string& where() const { return where_; }

 private:
  int64_t to_int(const char* key, int64_t lo) const {
    const nlohmann::json& v = j_.at(key);
    std::optional<int64_t> x;
    if (v.is_number_integer() && (!v.is_number_unsigned() || v.get<uint64_t>() <= uint64_t{INT64_MAX})) {
      x = v.get<int64_t>();
    } else if (v.is_number_float() && std::isfinite(v.get<double>()) &&
               std::trunc(v.get<double>()) == v.get<double>() && std::fabs(v.get<double>()) < 9e18) {
      x = static_cast<int64_t>(v.get<double>());
    }
    if (!x) fail("field '" + std::string(key) + "' must be an integer, got " + json_shown(v));
    if (*x < lo || *x > kMaxDim)
      fail("field '" + std::string(key) + "' must be in [" + std::to_string(lo) + ", " +
           std::to_string(kMaxDim) + "], got " + std::to_string(*x));
    return *x;
  }

  const nlohmann::json& j_;
  std::string where_;
};

}  // namespace kestrel
