// The CPU ops compiled for avx512 (flags set per file by CMakeLists.txt).
#define KESTREL_OPS_NS avx512
#include "backend/cpu/ops_impl.h"

namespace kestrel::cpu {
const OpsTable& ops_avx512() { return avx512::kTable; }
}  // namespace kestrel::cpu
