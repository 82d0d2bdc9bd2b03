// The CPU backend behind the ModelRunner interface: a thread pool, the host KV cache and the
// CpuModelRunner that computes on them.
#include <memory>
#include <string>

#include "backend/cpu/cpu_model_runner.h"
#include "backend/model_runner.h"
#include "core/cpu_features.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "memory/kv_cache.h"
#include "backend/kv_geometry.h"

namespace kestrel {

namespace {
class CpuBackend final : public ModelRunner {
 public:
  CpuBackend(const LlamaModel& model, const RunnerOptions& o)
      : pool_(o.n_threads),
        geometry_(kv_geometry(model.hparams())),
        kv_(geometry_, o.block_size, o.n_kv_blocks, o.kv_dtype, o.populate_kv),
        runner_(model, kv_, pool_) {}

  std::span<const float> forward(const ForwardBatch& batch) override { return runner_.forward(batch); }
  void copy_blocks(std::span<const BlockCopy> copies) override {
    for (const BlockCopy& c : copies) kv_.copy_block(c.src, c.dst);
  }
  // The swap pool is a second host KvCache; a swap is a block copy between the two.
  void allocate_swap_space(int32_t n_blocks) override {
    KESTREL_ASSERT(!swap_, "CPU backend: swap space allocated twice");
    swap_ = std::make_unique<KvCache>(geometry_, kv_.block_size(), n_blocks, kv_.dtype());
  }
  void swap_out(std::span<const BlockSwap> swaps) override {
    if (!swap_) ModelRunner::swap_out(swaps);
    for (const BlockSwap& s : swaps) KvCache::copy_block(kv_, s.device, *swap_, s.host);
  }
  void swap_in(std::span<const BlockSwap> swaps) override {
    if (!swap_) ModelRunner::swap_in(swaps);
    for (const BlockSwap& s : swaps) KvCache::copy_block(*swap_, s.host, kv_, s.device);
  }
  // One thread's memcpy within host memory: a round figure for a current x86 server core (the
  // choice only weighs it against the measured prefill time per token).
  double host_link_bytes_per_s() const override { return 10e9; }
  int32_t n_kv_blocks() const override { return kv_.n_blocks(); }
  int32_t block_size() const override { return kv_.block_size(); }
  KvDtype kv_dtype() const override { return kv_.dtype(); }
  int64_t kv_bytes_per_token() const override { return kv_.bytes_per_token(); }
  std::vector<uint64_t> expert_token_counts() const override { return runner_.expert_token_counts(); }
  std::string description() const override {
    return "cpu (" + std::to_string(pool_.size()) + " threads, " + simd_level_name(simd_level()) + ", KV " +
           std::string(kv_dtype_name(kv_.dtype())) + ")";
  }

 private:
  ThreadPool pool_;
  KvGeometry geometry_;
  KvCache kv_;
  std::unique_ptr<KvCache> swap_;  // host swap pool; null until allocate_swap_space
  cpu::CpuModelRunner runner_;
};
}  // namespace

std::unique_ptr<ModelRunner> make_cpu_model_runner(const LlamaModel& model, const RunnerOptions& options) {
  if (options.n_kv_blocks <= 0)
    throw Error("the CPU backend needs a positive number of KV blocks, got " + std::to_string(options.n_kv_blocks));
  model.ensure_host_weights();  // the kernels read every weight on the host
  return std::make_unique<CpuBackend>(model, options);
}

}  // namespace kestrel
