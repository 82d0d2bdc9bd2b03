// The CUDA backend's entry points for code that must not include CUDA headers (the engine's
// callers, the CLI). Built only with KESTREL_CUDA; callers test KESTREL_HAS_CUDA.
#pragma once

#include <memory>

#include "backend/model_runner.h"

namespace kestrel {

// Number of CUDA devices usable now (0 without a driver or a GPU; never throws).
int cuda_device_count();

// The Llama forward pass on CUDA device 0: weights uploaded as bf16 (GGUF quantized weights are
// dequantized on the host first), a bf16 paged KV cache in device memory sized from
// options.n_kv_blocks or, when 0, from options.gpu_memory_utilization of the device's memory.
// Errors: kestrel::Error when no device is present, memory runs out, or the model's shape is one
// the kernels do not cover (head_dim other than 64 or 128), options.tensor_parallel_size other than 1.
std::unique_ptr<ModelRunner> make_cuda_model_runner(const LlamaModel& model, const RunnerOptions& options);

}  // namespace kestrel
