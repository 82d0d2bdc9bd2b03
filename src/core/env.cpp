#include "core/env.h"

#include <cstdlib>

namespace kestrel {

const char* env_var_name(EnvVar v) {
  switch (v) {
    case EnvVar::Model: return "KESTREL_MODEL";
    case EnvVar::ModelDir: return "KESTREL_MODEL_DIR";
    case EnvVar::DataDir: return "KESTREL_DATA_DIR";
    case EnvVar::JinjaFuzzIters: return "KESTREL_JINJA_FUZZ_ITERS";
    case EnvVar::JinjaDumpCases: return "KESTREL_JINJA_DUMP_CASES";
  }
  return "";
}

std::optional<std::string> env_var(EnvVar v) {
  const char* value = std::getenv(env_var_name(v));
  if (value == nullptr || *value == '\0') return std::nullopt;
  return std::string(value);
}

}  // namespace kestrel
