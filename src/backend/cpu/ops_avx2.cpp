// The CPU ops compiled for avx2 (flags set per file by CMakeLists.txt).
#define KESTREL_OPS_NS avx2
#include "backend/cpu/ops_impl.h"

namespace kestrel::cpu {
const OpsTable& ops_avx2() { return avx2::kTable; }
}  // namespace kestrel::cpu
