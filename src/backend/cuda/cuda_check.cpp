#include "backend/cuda/cuda_check.h"

#include <cstdlib>
#include <string>

namespace kestrel::cuda {

void cuda_fail(cudaError_t err, const char* expr, const char* file, int line) {
  throw Error(std::string("CUDA error: ") + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ") from " +
              expr + " at " + file + ":" + std::to_string(line));
}

bool pdl_enabled() {
  static const bool on = [] {
    const char* env = std::getenv("KESTREL_PDL");
    return env == nullptr || std::string(env) != "0";
  }();
  return on;
}

}  // namespace kestrel::cuda
