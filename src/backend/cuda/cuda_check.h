// Error checks for CUDA runtime calls and kernel launches: a failure throws kestrel::Error naming
// the call, the file and line, and cudaGetErrorString's text.
#pragma once

#include <cuda_runtime.h>

#include "core/error.h"

namespace kestrel::cuda {

[[noreturn]] void cuda_fail(cudaError_t err, const char* expr, const char* file, int line);

// Whether kernels are launched with programmatic dependent launch (PDL, sm_90: the next kernel of
// the stream may start while this one drains; device_common.cuh). On unless set_pdl_enabled(false)
// (CudaTuning::pdl, set by the runner before its first launch).
bool pdl_enabled();
void set_pdl_enabled(bool on);

}  // namespace kestrel::cuda

#define KESTREL_CUDA_CHECK(expr)                                                          \
  do {                                                                                    \
    const cudaError_t kestrel_cuda_err_ = (expr);                                         \
    if (kestrel_cuda_err_ != cudaSuccess)                                                 \
      ::kestrel::cuda::cuda_fail(kestrel_cuda_err_, #expr, __FILE__, __LINE__);           \
  } while (0)

// After every launch: catches bad launch configurations (the kernel's own faults surface at the
// next synchronising call). The emulation (emulate.h) has no launch errors to check.
#if defined(KESTREL_CUDA_EMULATE)
#define KESTREL_CUDA_CHECK_LAUNCH() \
  do {                              \
  } while (0)
#else
#define KESTREL_CUDA_CHECK_LAUNCH() KESTREL_CUDA_CHECK(cudaGetLastError())
#endif
