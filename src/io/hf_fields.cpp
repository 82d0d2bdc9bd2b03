#include "io/hf_fields.h"

#include <cerrno>
#include <cstring>
#include <fstream>

namespace kestrel {

nlohmann::json read_json_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(path + ": cannot open: " + std::strerror(errno));
  try {
    return nlohmann::json::parse(in);
  } catch (const nlohmann::json::parse_error& e) {
    throw Error(path + ": invalid JSON: " + e.what());
  }
}

}  // namespace kestrel
