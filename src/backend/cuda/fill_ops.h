// Host-side launcher of the generated-weights fill (fill_random.cu), for the weight upload
// (device_memory.cpp) of a model with --load-format dummy weights.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/random_fill.h"

namespace kestrel::cuda {

// out[i] = random_fill_bf16(f, first + i) for i in [0, n): elements [first, first + n) of the
// generated tensor f describes. out: a device pointer to n bf16. Enqueued on `stream`.
// Errors: kestrel::Error when the launch fails.
void fill_random_bf16(__nv_bfloat16* out, int64_t n, uint64_t first, const RandomFill& f, cudaStream_t stream);

}  // namespace kestrel::cuda
