// A test instrument for programmatic dependent launch: a copy that lets the next kernel launch at
// once, then sleeps before it copies, so that a kernel launched after it that read the
// destination before its griddepcontrol.wait would read the old bytes (tests/backend/
// test_cuda_pdl_inputs.cpp). Not used by the runner.
#pragma once

#include "backend/cuda/device_common.cuh"

namespace kestrel::cuda {

// src, dst: n16 x 16 bytes, 16-byte aligned. grid-stride over the 16-byte items; every thread
// sleeps delay_ns (in 1 us naps) first.
__global__ void delayed_copy_kernel(const uint4* __restrict__ src, uint4* __restrict__ dst, int64_t n16,
                                    unsigned delay_ns) {
  KESTREL_PDL_ENTRY();
#if !defined(KESTREL_CUDA_EMULATE)
  for (unsigned slept = 0; slept < delay_ns; slept += 1000) __nanosleep(1000);
#else
  (void)delay_ns;
#endif
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n16; i += stride)
    dst[i] = src[i];
}

}  // namespace kestrel::cuda
