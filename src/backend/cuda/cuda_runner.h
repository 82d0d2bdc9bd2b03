// The CUDA backend's entry points for code that must not include CUDA headers (the engine's
// callers, the CLI). Built only with KESTREL_CUDA; callers test KESTREL_HAS_CUDA.
#pragma once

#include <memory>
#include <span>

#include "backend/model_runner.h"

namespace kestrel {

// Number of CUDA devices usable now (0 without a driver or a GPU; never throws).
int cuda_device_count();

// The Llama forward pass on CUDA device 0: weights uploaded as bf16 (GGUF quantized weights are
// dequantized on the host first), a bf16 paged KV cache in device memory sized from
// options.n_kv_blocks or, when 0, from options.gpu_memory_utilization of the device's memory.
// With options.pipeline_parallel_size N > 1, make_pipeline_parallel_cuda_runner over devices
// 0 .. N - 1; with options.tensor_parallel_size N > 1, make_tensor_parallel_cuda_runner over
// devices 0 .. N - 1 (under the CPU emulation, N ranks on its one device). Errors: kestrel::Error
// when no device is present, memory runs out, or the model's shape is one the kernels do not
// cover (head_dim not a multiple of 8 up to 256); the parallel runners'.
std::unique_ptr<ModelRunner> make_cuda_model_runner(const LlamaModel& model, const RunnerOptions& options);

// Tensor parallelism on CUDA (cuda_tensor_parallel.cpp): options.tensor_parallel_size ranks, rank r
// (LlamaModel::tensor_parallel_shard) on device devices[r], each with its weights, its KV cache of
// its heads (one block count for all ranks: the fewest that fit on every device, unless
// options.n_kv_blocks is set), its stream and graphs, and an NCCL communicator on that stream; the
// host samples. Errors: validate_tensor_parallel's; kestrel::Error naming --tensor-parallel-size
// when devices.size() differs from the rank count, a device is not visible or repeats (NCCL takes
// one rank per GPU), with pipeline parallelism, or without NCCL (a build without its header, or
// libnccl.so.2 not loadable); those of make_cuda_model_runner.
std::unique_ptr<ModelRunner> make_tensor_parallel_cuda_runner(const LlamaModel& model, const RunnerOptions& options,
                                                              std::span<const int> devices);

// Pipeline parallelism on CUDA (cuda_pipeline_parallel.cpp): options.pipeline_parallel_size
// stages, stage s (LlamaModel::pipeline_stage) on device devices[s] (a device may hold several
// stages), each with its weights, its KV cache of its layers (one block count for all stages: the
// fewest that fit on every device, unless options.n_kv_blocks is set), its stream and graphs.
// Errors: validate_pipeline_parallel's; kestrel::Error naming --pipeline-parallel-size when
// devices.size() differs from the stage count or a device is not visible; those of
// make_cuda_model_runner.
std::unique_ptr<ModelRunner> make_pipeline_parallel_cuda_runner(const LlamaModel& model, const RunnerOptions& options,
                                                                std::span<const int> devices);

}  // namespace kestrel
