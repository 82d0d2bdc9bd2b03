#include "io/hf_fields.h"

#include "io/mapped_file.h"

namespace kestrel {

nlohmann::json read_json_file(const std::string& path) {
  const std::string text = read_regular_file(path);
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    throw Error(path + ": invalid JSON: " + e.what());
  }
}

}  // namespace kestrel
