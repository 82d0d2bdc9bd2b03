// The environment variables kestrel reads, all of them. Configuration is command-line flags; the
// environment only locates files and feeds the test harness. Every read goes through env_var()
// (src/core/env.cpp is the one file that reads the environment; scripts/check_tree.sh fails CI otherwise).
//
//   KESTREL_MODEL             default model path when -m is not given (kestrel CLI)
//   KESTREL_API_KEY           default of `kestrel serve --api-key` (read by CLI11's envname)
//   KESTREL_MODEL_DIR         tests: the folder holding the default model (default: models/)
//   KESTREL_DATA_DIR          tests: the test material folder (default: ../shared/data)
//   KESTREL_JINJA_FUZZ_ITERS  tests: iterations of the Jinja fuzz test (default in the test)
//   KESTREL_JINJA_DUMP_CASES  tests: a file to write the Jinja golden cases to (golden regeneration)
#pragma once

#include <optional>
#include <string>

namespace kestrel {

enum class EnvVar { Model, ModelDir, DataDir, JinjaFuzzIters, JinjaDumpCases };

// The variable's name, e.g. "KESTREL_MODEL".
const char* env_var_name(EnvVar v);
// Its value when set and not empty; std::nullopt otherwise.
std::optional<std::string> env_var(EnvVar v);

}  // namespace kestrel
