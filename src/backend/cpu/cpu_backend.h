// The CPU backend's runner classes, shared by the plain backend, its tensor-parallel form
// (cpu_backend.cpp) and its pipeline-parallel form (cpu_pipeline_parallel.cpp). Internal to
// src/backend/cpu: the engine reaches them through make_cpu_model_runner (backend/model_runner.h).
#pragma once

#include <condition_variable>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "backend/communicator.h"
#include "backend/cpu/cpu_model_runner.h"
#include "backend/kv_geometry.h"
#include "backend/model_runner.h"
#include "backend/rank_threads.h"
#include "core/cpu_features.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "memory/kv_cache.h"

namespace kestrel::cpu {

// A thread pool, the host KV cache and the CpuModelRunner that computes on them.
class CpuBackend final : public ModelRunner {
 public:
  // `comm`: a tensor-parallel rank's communicator; `role`: a pipeline stage's place
  // (CpuModelRunner's).
  CpuBackend(const LlamaModel& model, const RunnerOptions& o, Communicator* comm = nullptr, PipelineRole role = {})
      : pool_(o.n_threads),
        geometry_(kv_geometry(model.hparams())),
        kv_(geometry_, o.block_size, o.n_kv_blocks, o.kv_dtype, o.populate_kv),
        runner_(model, kv_, pool_, comm, role) {}

  std::span<const float> forward(const ForwardBatch& batch) override { return runner_.forward(batch); }
  // A pipeline stage's pass (CpuModelRunner::forward with hidden_in).
  std::span<const float> forward_stage(const ForwardBatch& batch, std::span<const float> hidden_in) {
    return runner_.forward(batch, hidden_in);
  }
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
    h2d_bytes_ += static_cast<int64_t>(swaps.size()) * kv_.bytes_per_token() * kv_.block_size();
  }
  void read_kv_blocks(std::span<const int32_t> blocks, std::span<std::byte> out) const override {
    const size_t n = static_cast<size_t>(kv_.bytes_per_block());
    if (out.size() != blocks.size() * n) throw Error("read_kv_blocks: buffer size does not match the blocks");
    for (size_t i = 0; i < blocks.size(); ++i) kv_.read_block(checked_block(blocks[i]), out.subspan(i * n, n));
  }
  void write_kv_blocks(std::span<const int32_t> blocks, std::span<const std::byte> in) override {
    const size_t n = static_cast<size_t>(kv_.bytes_per_block());
    if (in.size() != blocks.size() * n) throw Error("write_kv_blocks: buffer size does not match the blocks");
    for (size_t i = 0; i < blocks.size(); ++i) kv_.write_block(checked_block(blocks[i]), in.subspan(i * n, n));
  }
  // Bytes only: a host memcpy here, not a link worth timing.
  HostCopyTotals host_to_device_totals() override { return {h2d_bytes_, 0}; }
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
  int32_t checked_block(int32_t b) const {
    if (b < 0 || b >= kv_.n_blocks()) throw Error("KV transfer: block " + std::to_string(b) + " is outside the pool");
    return b;
  }
  int64_t h2d_bytes_ = 0;          // swap_in copies so far
  cpu::CpuModelRunner runner_;
};

// Pipeline parallelism on the CPU (cpu_pipeline_parallel.cpp): options.pipeline_parallel_size
// stages (validate_pipeline_parallel must hold), each a CpuBackend over LlamaModel::pipeline_stage
// in its own thread.
std::unique_ptr<ModelRunner> make_pipeline_parallel_cpu_runner(const LlamaModel& model, const RunnerOptions& options);

}  // namespace kestrel::cpu
