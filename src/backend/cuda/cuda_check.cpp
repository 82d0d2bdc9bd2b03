#include "backend/cuda/cuda_check.h"

#include <string>

namespace kestrel::cuda {

void cuda_fail(cudaError_t err, const char* expr, const char* file, int line) {
  throw Error(std::string("CUDA error: ") + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ") from " +
              expr + " at " + file + ":" + std::to_string(line));
}

}  // namespace kestrel::cuda
