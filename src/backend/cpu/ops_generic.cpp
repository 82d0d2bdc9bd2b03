// The CPU ops compiled for generic (flags set per file by CMakeLists.txt).
#define KESTREL_OPS_NS generic
#include "backend/cpu/ops_impl.h"

namespace kestrel::cpu {
const OpsTable& ops_generic() { return generic::kTable; }
}  // namespace kestrel::cpu
