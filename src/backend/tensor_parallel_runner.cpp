#include "backend/tensor_parallel_runner.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <exception>
#include <mutex>
#include <span>
#include <string>
#include <utility>

#include "backend/rank_threads.h"
#include "core/error.h"
#include "model/forward_batch.h"

namespace kestrel {

namespace {

class TensorParallelRunner final : public ModelRunner {
 public:
  TensorParallelRunner(std::vector<std::unique_ptr<LlamaModel>> shards, std::vector<std::unique_ptr<Communicator>> comms,
                       std::vector<std::unique_ptr<ModelRunner>> ranks, const ModelHparams& hp)
      : size_(static_cast<int>(ranks.size())),
        comms_(std::move(comms)),
        shards_(std::move(shards)),
        ranks_(std::move(ranks)),
        parts_(ranks_.size()),
        n_vocab_(hp.n_vocab),
        kv_lookback_(hp.kv_lookback()),
        threads_(size_) {
    KESTREL_ASSERT(size_ >= 1 && n_vocab_ % size_ == 0, "tensor parallel: ranks and vocabulary");
  }

  std::span<const float> forward(const ForwardBatch& batch) override {
    const int64_t n_rows = static_cast<int64_t>(batch.logits_indices.size());
    const int64_t slice = n_vocab_ / size_;
    if (failed_) throw Error("tensor parallel: a rank failed in an earlier step, and its group was aborted");
    // A bad batch is refused here, before any rank starts: a rank that throws aborts the group.
    validate_forward_batch(batch, n_vocab_, n_kv_blocks(), block_size(), kv_lookback_);
    std::mutex mu;
    std::exception_ptr cause;  // the first rank's failure, not the others' aborted collectives
    try {
      threads_.run([&](int r) {
        try {
          parts_[static_cast<size_t>(r)] = ranks_[static_cast<size_t>(r)]->forward(batch);
        } catch (...) {
          {
            std::lock_guard<std::mutex> lock(mu);
            if (!cause) cause = std::current_exception();
          }
          // The other ranks may be waiting in a collective for this one: end the group for all.
          failed_ = true;
          comms_[static_cast<size_t>(r)]->abort();
          throw;
        }
      });
    } catch (...) {
      if (cause) std::rethrow_exception(cause);
      throw;
    }
    // parts [rank][row, slice] -> logits [row, rank * slice + j]
    logits_.resize(static_cast<size_t>(n_rows * n_vocab_));
    for (int r = 0; r < size_; ++r) {
      const std::span<const float> part = parts_[static_cast<size_t>(r)];
      KESTREL_ASSERT(static_cast<int64_t>(part.size()) == n_rows * slice, "tensor parallel: logits slice size");
      for (int64_t i = 0; i < n_rows; ++i)
        std::memcpy(logits_.data() + i * n_vocab_ + r * slice, part.data() + i * slice,
                    sizeof(float) * static_cast<size_t>(slice));
    }
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
  void swap_out_in(std::span<const BlockSwap> out, std::span<const BlockSwap> in) override {
    for (auto& r : ranks_) r->swap_out_in(out, in);
  }
  void read_kv_blocks(std::span<const int32_t> blocks, std::span<std::byte> out) const override {
    each_rank_part(blocks, out.size(), [&](size_t r, size_t off, size_t n) {
      std::vector<std::byte> part(n * blocks.size());
      ranks_[r]->read_kv_blocks(blocks, part);
      for (size_t i = 0; i < blocks.size(); ++i) std::memcpy(out.data() + i * block_bytes() + off, part.data() + i * n, n);
    });
  }
  void write_kv_blocks(std::span<const int32_t> blocks, std::span<const std::byte> in) override {
    each_rank_part(blocks, in.size(), [&](size_t r, size_t off, size_t n) {
      std::vector<std::byte> part(n * blocks.size());
      for (size_t i = 0; i < blocks.size(); ++i) std::memcpy(part.data() + i * n, in.data() + i * block_bytes() + off, n);
      ranks_[r]->write_kv_blocks(blocks, part);
    });
  }
  HostCopyTotals host_to_device_totals() override {
    HostCopyTotals t;
    for (auto& r : ranks_) {
      const HostCopyTotals x = r->host_to_device_totals();
      t.bytes += x.bytes;
      t.seconds = std::max(t.seconds, x.seconds);  // the ranks copy over their own links at once
    }
    return t;
  }
  double host_link_bytes_per_s() const override { return ranks_[0]->host_link_bytes_per_s(); }
  int32_t n_kv_blocks() const override { return ranks_[0]->n_kv_blocks(); }
  int32_t block_size() const override { return ranks_[0]->block_size(); }
  KvDtype kv_dtype() const override { return ranks_[0]->kv_dtype(); }
  int64_t kv_bytes_per_token() const override {
    int64_t b = 0;
    for (const auto& r : ranks_) b += r->kv_bytes_per_token();
    return b;
  }
  std::string description() const override {
    return "tensor parallel " + std::to_string(size_) + " x " + ranks_[0]->description();
  }

 private:
  size_t block_bytes() const { return static_cast<size_t>(block_size()) * static_cast<size_t>(kv_bytes_per_token()); }
  // fn(rank, offset of the rank's part in a block's record, its bytes) for every rank.
  template <class Fn>
  void each_rank_part(std::span<const int32_t> blocks, size_t total, Fn&& fn) const {
    if (total != blocks.size() * block_bytes()) throw Error("KV transfer: buffer size does not match the blocks");
    size_t off = 0;
    for (size_t r = 0; r < ranks_.size(); ++r) {
      const size_t n = static_cast<size_t>(block_size()) * static_cast<size_t>(ranks_[r]->kv_bytes_per_token());
      fn(r, off, n);
      off += n;
    }
  }

  int size_;
  std::atomic<bool> failed_{false};  // a rank's pass threw: the group is aborted
  // Destroyed in reverse: the threads joined first, then the ranks, then the shards and
  // communicators they use.
  std::vector<std::unique_ptr<Communicator>> comms_;
  std::vector<std::unique_ptr<LlamaModel>> shards_;
  std::vector<std::unique_ptr<ModelRunner>> ranks_;
  std::vector<std::span<const float>> parts_;  // each rank's logits slice of the step
  std::vector<float> logits_;
  int64_t n_vocab_ = 0;
  int64_t kv_lookback_ = 0;
  RankThreads threads_;
};

}  // namespace

std::unique_ptr<ModelRunner> make_tensor_parallel_runner(std::vector<std::unique_ptr<LlamaModel>> shards,
                                                         std::vector<std::unique_ptr<Communicator>> comms,
                                                         std::vector<std::unique_ptr<ModelRunner>> ranks,
                                                         const ModelHparams& hp) {
  if (ranks.empty() || shards.size() != ranks.size() || comms.size() != ranks.size())
    throw Error("tensor parallel: " + std::to_string(ranks.size()) + " ranks, " + std::to_string(shards.size()) +
                " shards, " + std::to_string(comms.size()) + " communicators");
  return std::make_unique<TensorParallelRunner>(std::move(shards), std::move(comms), std::move(ranks), hp);
}

}  // namespace kestrel
