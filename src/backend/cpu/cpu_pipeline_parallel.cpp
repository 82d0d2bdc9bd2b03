// Pipeline parallelism on the CPU (RunnerOptions::pipeline_parallel_size, model/pipeline_parallel.h):
// stage s's CpuBackend runs layers [l0, l1) of the model (LlamaModel::pipeline_stage) with its own
// KV cache (those layers' K/V of every block) and thread pool; the driver
// (backend/pipeline_parallel_runner.h) runs the stages in their threads over micro-batches. The
// residual stream [n_tokens, n_embd] f32 is handed on in host memory, one buffer per micro-batch.
#include <algorithm>
#include <string>
#include <thread>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/pipeline_parallel_runner.h"
#include "model/pipeline_parallel.h"

namespace kestrel::cpu {

namespace {

class CpuPipelineStage final : public PipelineStage {
 public:
  CpuPipelineStage(std::unique_ptr<LlamaModel> model, const RunnerOptions& o, PipelineRole role)
      : model_(std::move(model)), backend_(*model_, o, nullptr, role) {}
  ModelRunner& runner() override { return backend_; }
  const ModelRunner& runner() const override { return backend_; }
  void reserve_hand_off(size_t n_slots, int64_t) override { in_.resize(n_slots); }
  std::span<const float> forward_micro_batch(const ForwardBatch& b, size_t m, PipelineStage* next) override {
    const std::span<const float> out = backend_.forward_stage(b, m < in_.size() ? in_[m] : std::span<const float>{});
    if (next == nullptr) return out;
    static_cast<CpuPipelineStage*>(next)->in_[m].assign(out.begin(), out.end());
    return {};
  }

 private:
  std::unique_ptr<LlamaModel> model_;  // the stage's layers (views); before the backend that reads it
  CpuBackend backend_;
  std::vector<std::vector<float>> in_;  // [slot] the residual stream handed in
};

}  // namespace

std::unique_ptr<ModelRunner> make_pipeline_parallel_cpu_runner(const LlamaModel& model, const RunnerOptions& o) {
  const int size = o.pipeline_parallel_size;
  validate_pipeline_parallel(model.hparams(), size);
  RunnerOptions ro = o;
  const int total = o.n_threads > 0 ? o.n_threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  ro.n_threads = std::max(1, total / size);
  std::vector<std::unique_ptr<PipelineStage>> stages;
  for (int s = 0; s < size; ++s)
    stages.push_back(std::make_unique<CpuPipelineStage>(model.pipeline_stage(s, size), ro,
                                                        PipelineRole{s == 0, s == size - 1}));
  return make_pipeline_parallel_runner(std::move(stages), model.hparams());
}

}  // namespace kestrel::cpu
