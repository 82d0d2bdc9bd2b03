#include "io/json_text.h"

namespace kestrel {

std::string json_shown(const nlohmann::json& j) {
  if (j.is_array() || j.is_object()) {
    bool flat = true;
    for (const nlohmann::json& e : j) flat = flat && e.is_primitive();
    if (!flat || j.size() > 8)
      return std::string(j.is_array() ? "an array" : "an object") + " of " + std::to_string(j.size()) + " elements";
  }
  std::string s = j.dump(-1, ' ', true, nlohmann::json::error_handler_t::replace);
  return s.size() > 64 ? s.substr(0, 64) + "..." : s;
}

}  // namespace kestrel
