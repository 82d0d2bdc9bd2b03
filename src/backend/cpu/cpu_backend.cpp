// The CPU backend behind the ModelRunner interface: a thread pool, the host KV cache and the
// CpuModelRunner that computes on them; with RunnerOptions::tensor_parallel_size > 1, one such
// backend per rank over the rank's shard of the model, each driven by its own thread (with
// pipeline_parallel_size > 1, cpu_pipeline_parallel.cpp: one per stage).
#include <algorithm>
#include <memory>
#include <string>
#include <thread>

#include "backend/cpu/cpu_backend.h"
#include "backend/tensor_parallel_runner.h"
#include "model/pipeline_parallel.h"
#include "model/tensor_parallel.h"

namespace kestrel {

namespace {
using cpu::CpuBackend;

// Tensor parallelism on the CPU: rank r's CpuBackend runs the same batch over shard r of the model
// (LlamaModel::tensor_parallel_shard) with its own KV cache (its heads) and thread pool, the ranks'
// row-parallel outputs summed through in-process communicators (backend/tensor_parallel_runner.h).
std::unique_ptr<ModelRunner> make_tensor_parallel_cpu_runner(const LlamaModel& model, const RunnerOptions& o) {
  const int size = o.tensor_parallel_size;
  RunnerOptions ro = o;
  const int total = o.n_threads > 0 ? o.n_threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  ro.n_threads = std::max(1, total / size);
  std::vector<std::unique_ptr<Communicator>> comms = make_in_process_communicators(size);
  std::vector<std::unique_ptr<LlamaModel>> shards;
  std::vector<std::unique_ptr<ModelRunner>> ranks;
  for (int r = 0; r < size; ++r) {
    shards.push_back(model.tensor_parallel_shard(r, size));
    ranks.push_back(std::make_unique<CpuBackend>(*shards.back(), ro, comms[static_cast<size_t>(r)].get()));
  }
  return make_tensor_parallel_runner(std::move(shards), std::move(comms), std::move(ranks), model.hparams());
}
}  // namespace

std::unique_ptr<ModelRunner> make_cpu_model_runner(const LlamaModel& model, const RunnerOptions& options) {
  if (options.n_kv_blocks <= 0)
    throw Error("the CPU backend needs a positive number of KV blocks, got " + std::to_string(options.n_kv_blocks));
  validate_tensor_parallel(model.hparams(), options.tensor_parallel_size);
  validate_pipeline_parallel(model.hparams(), options.pipeline_parallel_size);
  if (options.tensor_parallel_size > 1 && options.pipeline_parallel_size > 1)
    throw Error("--tensor-parallel-size " + std::to_string(options.tensor_parallel_size) + " with --pipeline-parallel-size " +
                std::to_string(options.pipeline_parallel_size) +
                ": the CPU backend splits a model one way at a time (tensor or pipeline parallelism)");
  model.ensure_host_weights();  // the kernels read every weight on the host
  if (options.pipeline_parallel_size > 1) return cpu::make_pipeline_parallel_cpu_runner(model, options);
  if (options.tensor_parallel_size > 1) return make_tensor_parallel_cpu_runner(model, options);
  return std::make_unique<CpuBackend>(model, options);
}

}  // namespace kestrel
