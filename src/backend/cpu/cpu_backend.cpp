// The CPU backend behind the ModelRunner interface: a thread pool, the host KV cache and the
// CpuModelRunner that computes on them; with RunnerOptions::tensor_parallel_size > 1, one such
// backend per rank over the rank's shard of the model, each driven by its own thread.
#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "backend/communicator.h"
#include "backend/cpu/cpu_model_runner.h"
#include "backend/kv_geometry.h"
#include "backend/model_runner.h"
#include "core/cpu_features.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "memory/kv_cache.h"
#include "model/tensor_parallel.h"

namespace kestrel {

namespace {
class CpuBackend final : public ModelRunner {
 public:
  CpuBackend(const LlamaModel& model, const RunnerOptions& o, Communicator* comm = nullptr)
      : pool_(o.n_threads),
        geometry_(kv_geometry(model.hparams())),
        kv_(geometry_, o.block_size, o.n_kv_blocks, o.kv_dtype, o.populate_kv),
        runner_(model, kv_, pool_, comm) {}

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

// One thread per rank beyond the caller's (rank 0): run(fn) calls fn(r) for every rank at once and
// returns when all are done, rethrowing the lowest rank's exception.
class RankThreads {
 public:
  explicit RankThreads(int n) : errors_(static_cast<size_t>(n)) {
    for (int r = 1; r < n; ++r) threads_.emplace_back([this, r] { loop(r); });
  }
  ~RankThreads() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    start_.notify_all();
    for (std::thread& t : threads_) t.join();
  }
  void run(const std::function<void(int)>& fn) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      fn_ = &fn;
      pending_ = static_cast<int>(threads_.size());
      ++generation_;
    }
    start_.notify_all();
    call(0, fn);
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [&] { return pending_ == 0; });
    for (std::exception_ptr& e : errors_)
      if (e) std::rethrow_exception(std::exchange(e, nullptr));
  }

 private:
  void call(int r, const std::function<void(int)>& fn) {
    try {
      fn(r);
    } catch (...) {
      errors_[static_cast<size_t>(r)] = std::current_exception();
    }
  }
  void loop(int r) {
    uint64_t seen = 0;
    for (;;) {
      const std::function<void(int)>* fn;
      {
        std::unique_lock<std::mutex> lock(mu_);
        start_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
        fn = fn_;
      }
      call(r, *fn);
      std::lock_guard<std::mutex> lock(mu_);
      if (--pending_ == 0) done_.notify_one();
    }
  }
  std::mutex mu_;
  std::condition_variable start_, done_;
  const std::function<void(int)>* fn_ = nullptr;
  uint64_t generation_ = 0;
  int pending_ = 0;
  bool stop_ = false;
  std::vector<std::exception_ptr> errors_;
  std::vector<std::thread> threads_;
};

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
  model.ensure_host_weights();  // the kernels read every weight on the host
  if (options.tensor_parallel_size > 1) return std::make_unique<TensorParallelCpuBackend>(model, options);
  return std::make_unique<CpuBackend>(model, options);
}

}  // namespace kestrel
