// Tensor parallelism on CUDA (make_tensor_parallel_cuda_runner, cuda_runner.h): rank r is a
// CudaModelRunner over LlamaModel::tensor_parallel_shard(r, N) on devices[r], with its weights, its
// KV cache of its heads, its stream and its decode graphs, and an NCCL communicator set to that
// stream: the all-reduces after the output and down projections and after the vocabulary-parallel
// embedding are enqueued between the rank's kernels and captured in its graphs. The driver
// (backend/tensor_parallel_runner.h) runs every rank's pass in its own host thread, so the ranks'
// collectives meet, and lays the ranks' logits slices side by side on the host.
//
// Under the CPU emulation (KESTREL_CUDA_EMULATE) every rank is on the one emulated device and the
// ranks' communicators are the in-process ones: emulated device memory is host memory and a kernel
// has finished when its launch returns, so a host-side sum between two launches sees what the
// kernels wrote.
#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_model_runner.h"
#include "backend/cuda/cuda_runner.h"
#include "backend/tensor_parallel_runner.h"
#include "core/error.h"
#include "model/tensor_parallel.h"
#if !defined(KESTREL_CUDA_EMULATE) && defined(KESTREL_HAS_NCCL)
#include "backend/cuda/nccl_communicator.h"
#endif

namespace kestrel {

std::unique_ptr<ModelRunner> make_tensor_parallel_cuda_runner(const LlamaModel& model, const RunnerOptions& o,
                                                              std::span<const int> devices) {
  const int size = o.tensor_parallel_size;
  validate_tensor_parallel(model.hparams(), size);
  const std::string flag = "--tensor-parallel-size " + std::to_string(size);
  if (o.pipeline_parallel_size > 1)
    throw Error(flag + " with --pipeline-parallel-size " + std::to_string(o.pipeline_parallel_size) +
                ": a model is split one way at a time (tensor or pipeline parallelism)");
  if (devices.size() != static_cast<size_t>(size))
    throw Error(flag + ": " + std::to_string(devices.size()) + " devices for " + std::to_string(size) + " ranks");
  const int visible = cuda_device_count();
  for (size_t r = 0; r < devices.size(); ++r)
    if (devices[r] < 0 || devices[r] >= visible)
      throw Error(flag + " needs " + std::to_string(size) + " GPUs (rank " + std::to_string(r) + " on device " +
                  std::to_string(devices[r]) + "); " + std::to_string(visible) + " visible");
  std::vector<std::unique_ptr<Communicator>> comms;
#if defined(KESTREL_CUDA_EMULATE)
  comms = make_in_process_communicators(size);
#elif defined(KESTREL_HAS_NCCL)
  if (std::set<int>(devices.begin(), devices.end()).size() != devices.size())
    throw Error(flag + ": one rank per GPU (NCCL), and a device repeats in the placement");
  std::vector<std::unique_ptr<cuda::NcclCommunicator>> nccl = cuda::make_nccl_communicators(devices);
  std::vector<cuda::NcclCommunicator*> streams_of;
  for (auto& c : nccl) {
    streams_of.push_back(c.get());
    comms.push_back(std::move(c));
  }
#else
  throw Error(flag + ": this build has no NCCL (tensor parallelism on GPUs communicates through it)");
#endif
  std::vector<std::unique_ptr<LlamaModel>> shards;
  std::vector<std::unique_ptr<ModelRunner>> ranks;
  std::vector<cuda_runner::CudaModelRunner*> runners;
  for (int r = 0; r < size; ++r) {
    shards.push_back(model.tensor_parallel_shard(r, size));
    const cuda_runner::CudaPlacement place{devices[static_cast<size_t>(r)], PipelineRole{}, true,
                                           comms[static_cast<size_t>(r)].get()};
    auto runner = std::make_unique<cuda_runner::CudaModelRunner>(*shards.back(), o, place);
#if !defined(KESTREL_CUDA_EMULATE) && defined(KESTREL_HAS_NCCL)
    streams_of[static_cast<size_t>(r)]->set_stream(runner->stream());
#endif
    runners.push_back(runner.get());
    ranks.push_back(std::move(runner));
  }
  cuda_runner::allocate_kv_blocks_together(o, runners);
  return make_tensor_parallel_runner(std::move(shards), std::move(comms), std::move(ranks), model.hparams());
}

}  // namespace kestrel
