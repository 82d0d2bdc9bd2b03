// The CPU backend behind the ModelRunner interface: a thread pool, the host KV cache and the
// CpuModelRunner that computes on them; with RunnerOptions::tensor_parallel_size > 1, one such
// backend per rank over the rank's shard of the model, each driven by its own thread (with
// pipeline_parallel_size > 1, cpu_pipeline_parallel.cpp: one per stage).
#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <thread>

#include "backend/cpu/cpu_backend.h"
#include "model/pipeline_parallel.h"
#include "model/tensor_parallel.h"

namespace kestrel {

namespace {
using cpu::CpuBackend;

// Tensor parallelism on the CPU: rank r's CpuBackend runs the same batch over shard r of the model
// (LlamaModel::tensor_parallel_shard) with its own KV cache (its heads), the ranks' row-parallel
// outputs summed through in-process communicators, and the vocabulary slices of the logits
// all-gathered into [n_rows, n_vocab].
class TensorParallelCpuBackend final : public ModelRunner {
 public:
  TensorParallelCpuBackend(const LlamaModel& model, const RunnerOptions& o)
      : size_(o.tensor_parallel_size), comms_(make_in_process_communicators(size_)), threads_(size_) {
    RunnerOptions ro = o;
    const int total = o.n_threads > 0 ? o.n_threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    ro.n_threads = std::max(1, total / size_);
    for (int r = 0; r < size_; ++r) {
      shards_.push_back(model.tensor_parallel_shard(r, size_));
      ranks_.push_back(std::make_unique<CpuBackend>(*shards_.back(), ro, comms_[static_cast<size_t>(r)].get()));
    }
    gathered_.resize(static_cast<size_t>(size_));
    n_vocab_ = model.hparams().n_vocab;
  }

  std::span<const float> forward(const ForwardBatch& batch) override {
    const int64_t n_rows = static_cast<int64_t>(batch.logits_indices.size());
    const int64_t slice = n_vocab_ / size_;
    threads_.run([&](int r) {
      const std::span<const float> part = ranks_[static_cast<size_t>(r)]->forward(batch);
      KESTREL_ASSERT(static_cast<int64_t>(part.size()) == n_rows * slice, "tensor parallel: logits slice size");
      std::vector<float>& g = gathered_[static_cast<size_t>(r)];
      if (static_cast<int64_t>(g.size()) < size_ * n_rows * slice) g.resize(static_cast<size_t>(size_ * n_rows * slice));
      comms_[static_cast<size_t>(r)]->all_gather(part.data(), n_rows * slice, g.data());
    });
    // gathered [rank, row, slice] -> logits [row, rank * slice + j]
    logits_.resize(static_cast<size_t>(n_rows * n_vocab_));
    const std::vector<float>& g = gathered_[0];
    for (int r = 0; r < size_; ++r)
      for (int64_t i = 0; i < n_rows; ++i)
        std::memcpy(logits_.data() + i * n_vocab_ + r * slice, g.data() + (r * n_rows + i) * slice,
                    sizeof(float) * static_cast<size_t>(slice));
    return logits_;
  }
  void copy_blocks(std::span<const BlockCopy> copies) override {
    for (auto& r : ranks_) r->copy_blocks(copies);
  }
  // Each rank swaps its own heads of the same blocks.
  void allocate_swap_space(int32_t n_blocks) override {
    for (auto& r : ranks_) r->allocate_swap_space(n_blocks);
  }
  void swap_out(std::span<const BlockSwap> swaps) override {
    for (auto& r : ranks_) r->swap_out(swaps);
  }
  void swap_in(std::span<const BlockSwap> swaps) override {
    for (auto& r : ranks_) r->swap_in(swaps);
  }
  // A block's record is each rank's record of its heads, in rank order.
  void read_kv_blocks(std::span<const int32_t> blocks, std::span<std::byte> out) const override {
    each_rank_part(blocks, out.size(), [&](size_t r, std::span<const int32_t> b, size_t off, size_t n) {
      std::vector<std::byte> part(n * blocks.size());
      ranks_[r]->read_kv_blocks(b, part);
      for (size_t i = 0; i < blocks.size(); ++i) std::memcpy(out.data() + i * block_bytes() + off, part.data() + i * n, n);
    });
  }
  void write_kv_blocks(std::span<const int32_t> blocks, std::span<const std::byte> in) override {
    each_rank_part(blocks, in.size(), [&](size_t r, std::span<const int32_t> b, size_t off, size_t n) {
      std::vector<std::byte> part(n * blocks.size());
      for (size_t i = 0; i < blocks.size(); ++i) std::memcpy(part.data() + i * n, in.data() + i * block_bytes() + off, n);
      ranks_[r]->write_kv_blocks(b, part);
    });
  }
  HostCopyTotals host_to_device_totals() override {
    HostCopyTotals t;
    for (auto& r : ranks_) t.bytes += r->host_to_device_totals().bytes;
    return t;
  }
  double host_link_bytes_per_s() const override { return ranks_[0]->host_link_bytes_per_s(); }
  int32_t n_kv_blocks() const override { return ranks_[0]->n_kv_blocks(); }
  int32_t block_size() const override { return ranks_[0]->block_size(); }
  KvDtype kv_dtype() const override { return ranks_[0]->kv_dtype(); }
  // All ranks' caches together (replicated KV heads counted on every rank that holds them).
  int64_t kv_bytes_per_token() const override {
    int64_t b = 0;
    for (const auto& r : ranks_) b += r->kv_bytes_per_token();
    return b;
  }
  size_t block_bytes() const { return static_cast<size_t>(block_size()) * static_cast<size_t>(kv_bytes_per_token()); }
  // fn(rank, blocks, offset of the rank's part in a block's record, its bytes) for every rank.
  template <class Fn>
  void each_rank_part(std::span<const int32_t> blocks, size_t total, Fn&& fn) const {
    if (total != blocks.size() * block_bytes()) throw Error("KV transfer: buffer size does not match the blocks");
    size_t off = 0;
    for (size_t r = 0; r < ranks_.size(); ++r) {
      const size_t n = static_cast<size_t>(block_size()) * static_cast<size_t>(ranks_[r]->kv_bytes_per_token());
      fn(r, blocks, off, n);
      off += n;
    }
  }
  std::string description() const override {
    return "tensor parallel " + std::to_string(size_) + " x " + ranks_[0]->description();
  }

 private:
  int size_;
  std::vector<std::unique_ptr<Communicator>> comms_;
  std::vector<std::unique_ptr<LlamaModel>> shards_;
  std::vector<std::unique_ptr<ModelRunner>> ranks_;
  std::vector<std::vector<float>> gathered_;  // each rank's all_gather output [size, n_rows, slice]
  std::vector<float> logits_;
  int64_t n_vocab_ = 0;
  RankThreads threads_;  // last: joined before the ranks they drive are destroyed
};
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
  if (options.tensor_parallel_size > 1) return std::make_unique<TensorParallelCpuBackend>(model, options);
  return std::make_unique<CpuBackend>(model, options);
}

}  // namespace kestrel
