#include "backend/cuda/cuda_check.h"

#include <atomic>
#include <string>

namespace kestrel::cuda {

void cuda_fail(cudaError_t err, const char* expr, const char* file, int line) {
  throw Error(std::string("CUDA error: ") + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ") from " +
              expr + " at " + file + ":" + std::to_string(line));
}

namespace {
std::atomic<bool> g_pdl{true};
}  // namespace

bool pdl_enabled() { return g_pdl.load(std::memory_order_relaxed); }
void set_pdl_enabled(bool on) { g_pdl.store(on, std::memory_order_relaxed); }

}  // namespace kestrel::cuda
