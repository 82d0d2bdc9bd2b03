// Pipeline parallelism on CUDA (make_pipeline_parallel_cuda_runner, cuda_runner.h): stage s is a
// CudaModelRunner over LlamaModel::pipeline_stage(s, N) on its device, with its weights, its KV
// cache of its layers, its stream and its decode graphs; the driver (backend/pipeline_parallel_runner.h)
// runs each stage in its own host thread over the micro-batches of the passes in flight. A stage
// before the last copies its output residual stream [n_tokens, n_embd] f32 into the next stage's
// hand-off slot for the micro-batch (cudaMemcpyPeerAsync: over NVLink or PCIe between devices, a plain copy on one
// device) and records an event the next stage's stream waits on before it reads the slot; then it
// synchronizes its stream (its pinned staging buffer serves its next pass), and the driver lets
// the next stage start. So stage s computes micro-batch m + 1 on its GPU while stage s + 1
// computes m on its own.
#include <algorithm>
#include <string>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_model_runner.h"
#include "backend/cuda/cuda_runner.h"
#include "backend/pipeline_parallel_runner.h"
#include "core/error.h"
#include "model/pipeline_parallel.h"

namespace kestrel {

namespace {

using cuda_runner::CudaModelRunner;
using cuda_runner::CudaPlacement;

class CudaPipelineStage final : public PipelineStage {
 public:
  CudaPipelineStage(std::unique_ptr<LlamaModel> model, const RunnerOptions& o, const CudaPlacement& place)
      : model_(std::move(model)), runner_(*model_, o, place), first_(place.role.first) {}
  ~CudaPipelineStage() override {
    cudaSetDevice(runner_.device());
    for (cudaEvent_t e : handed_on_) cudaEventDestroy(e);
  }
  ModelRunner& runner() override { return runner_; }
  const ModelRunner& runner() const override { return runner_; }
  CudaModelRunner& cuda() { return runner_; }

  void reserve_hand_off(size_t n_slots, int64_t n_tokens) override {
    runner_.use_device();
    if (slots_.size() < n_slots) slots_.resize(n_slots), in_ready_.resize(n_slots, nullptr);
    const size_t bytes = static_cast<size_t>(n_tokens * model_->hparams().n_embd) * sizeof(float);
    for (size_t m = 0; m < n_slots; ++m) slots_[m].reserve(bytes);
  }

  std::span<const float> forward_micro_batch(const ForwardBatch& b, size_t m, PipelineStage* next) override {
    runner_.use_device();
    const float* in = nullptr;
    if (!first_) {
      KESTREL_CUDA_CHECK(cudaStreamWaitEvent(runner_.stream(), in_ready_[m], 0));
      in = slots_[m].as<const float>();
    }
    const std::span<const float> logits = runner_.forward_stage(b, in);
    if (next == nullptr) return logits;
    auto* to = static_cast<CudaPipelineStage*>(next);
    while (handed_on_.size() <= m) {
      cudaEvent_t e = nullptr;
      KESTREL_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
      handed_on_.push_back(e);
    }
    const size_t bytes = static_cast<size_t>(b.n_tokens() * model_->hparams().n_embd) * sizeof(float);
    KESTREL_CUDA_CHECK(cudaMemcpyPeerAsync(to->slots_[m].as<void>(), to->runner_.device(), runner_.hidden_out(),
                                           runner_.device(), bytes, runner_.stream()));
    KESTREL_CUDA_CHECK(cudaEventRecord(handed_on_[m], runner_.stream()));
    to->in_ready_[m] = handed_on_[m];  // read by the next stage after the driver's hand-over
    KESTREL_CUDA_CHECK(cudaStreamSynchronize(runner_.stream()));
    return {};
  }

 private:
  std::unique_ptr<LlamaModel> model_;  // the stage's layers (views); before the runner that reads it
  CudaModelRunner runner_;
  bool first_;
  std::vector<cuda::DevMem> slots_;          // [slot] the residual stream handed in, on this device
  std::vector<cudaEvent_t> in_ready_;        // [slot] the stage before's event after its copy
  std::vector<cudaEvent_t> handed_on_;       // [slot] this stage's, after its copy out (its device)
};

}  // namespace

std::unique_ptr<ModelRunner> make_pipeline_parallel_cuda_runner(const LlamaModel& model, const RunnerOptions& o,
                                                                std::span<const int> devices) {
  const int size = o.pipeline_parallel_size;
  validate_pipeline_parallel(model.hparams(), size);
  const std::string flag = "--pipeline-parallel-size " + std::to_string(size);
  if (devices.size() != static_cast<size_t>(size))
    throw Error(flag + ": " + std::to_string(devices.size()) + " devices for " + std::to_string(size) + " stages");
  const int visible = cuda_device_count();
  for (size_t s = 0; s < devices.size(); ++s)
    if (devices[s] < 0 || devices[s] >= visible)
      throw Error(flag + " needs " + std::to_string(size) + " GPUs (stage " + std::to_string(s) + " on device " +
                  std::to_string(devices[s]) + "); " + std::to_string(visible) + " visible");
  // Direct copies between neighbouring stages' devices where the hardware allows (else the driver
  // stages them through host memory).
  for (size_t s = 0; s + 1 < devices.size(); ++s) {
    if (devices[s] == devices[s + 1]) continue;
    int can = 0;
    KESTREL_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, devices[s], devices[s + 1]));
    if (can == 0) continue;
    KESTREL_CUDA_CHECK(cudaSetDevice(devices[s]));
    const cudaError_t err = cudaDeviceEnablePeerAccess(devices[s + 1], 0);
    if (err != cudaSuccess && err != cudaErrorPeerAccessAlreadyEnabled) KESTREL_CUDA_CHECK(err);
    cudaGetLastError();  // clear "already enabled"
  }
  std::vector<std::unique_ptr<PipelineStage>> stages;
  std::vector<CudaModelRunner*> runners;
  for (int s = 0; s < size; ++s) {
    const CudaPlacement place{devices[static_cast<size_t>(s)], PipelineRole{s == 0, s == size - 1}, true};
    auto stage = std::make_unique<CudaPipelineStage>(model.pipeline_stage(s, size), o, place);
    runners.push_back(&stage->cuda());
    stages.push_back(std::move(stage));
  }
  cuda_runner::allocate_kv_blocks_together(o, runners);
  return make_pipeline_parallel_runner(std::move(stages), model.hparams());
}

}  // namespace kestrel
