// Pipeline parallelism on the CPU (RunnerOptions::pipeline_parallel_size, model/pipeline_parallel.h):
// stage s's CpuBackend runs layers [l0, l1) of the model (LlamaModel::pipeline_stage) with its own
// KV cache (those layers' K/V of every block) and thread pool, in its own thread. A step's batch is
// split into micro-batches (GPipe, Huang et al. 2019) that go through the stages in order: stage s
// works on micro-batch m while stage s + 1 works on m - 1, each stage handing its residual stream
// [n_tokens, n_embd] f32 to the next through a buffer per (stage, micro-batch).
#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "model/pipeline_parallel.h"

namespace kestrel::cpu {

namespace {

// One micro-batch: the step's tokens [t0, t1) with their sequences' rows of the step's arrays; a
// sequence split between micro-batches (one sequence's prefill) has in each the context its
// earlier tokens leave in the cache.
struct MicroBatch {
  int64_t t0 = 0, t1 = 0;
  std::vector<int32_t> query_start, context_lens, logits_indices;
  std::vector<size_t> logits_rows;  // each logits row's index in the step's logits_indices
  ForwardBatch batch;
};

// The micro-batches of `b` for `n_stages` stages: min(n_stages, n_seqs) groups of whole sequences
// with about equal token counts, or, for one sequence, min(n_stages, n_tokens) token ranges of it.
void split_micro_batches(const ForwardBatch& b, int n_stages, std::vector<MicroBatch>& out) {
  const int64_t n = b.n_tokens(), n_seqs = b.n_seqs();
  std::vector<int64_t> cuts = {0};  // token offsets
  if (n_seqs == 1) {
    const int64_t m = std::max<int64_t>(1, std::min<int64_t>(n_stages, n));
    for (int64_t k = 1; k < m; ++k) cuts.push_back(n * k / m);
  } else {
    const int64_t m = std::max<int64_t>(1, std::min<int64_t>(n_stages, n_seqs));
    int64_t s = 0;
    for (int64_t k = 1; k < m; ++k) {
      // The first sequence starting at or after the k-th share of the tokens, leaving every later
      // group at least one sequence.
      ++s;
      while (s < n_seqs - (m - k) && b.query_start[s] < n * k / m) ++s;
      cuts.push_back(b.query_start[s]);
    }
  }
  cuts.push_back(n);
  out.clear();
  for (size_t k = 0; k + 1 < cuts.size(); ++k) {
    if (cuts[k] == cuts[k + 1]) continue;
    MicroBatch& mb = out.emplace_back();
    mb.t0 = cuts[k], mb.t1 = cuts[k + 1];
  }
  for (MicroBatch& mb : out) {
    // Sequences [sa, sb) overlap the token range.
    int64_t sa = 0;
    while (b.query_start[sa + 1] <= mb.t0) ++sa;
    int64_t sb = sa;
    while (sb < n_seqs && b.query_start[sb] < mb.t1) ++sb;
    mb.query_start.clear(), mb.context_lens.clear(), mb.logits_indices.clear(), mb.logits_rows.clear();
    for (int64_t s = sa; s < sb; ++s) {
      const int64_t q0 = std::max<int64_t>(b.query_start[s], mb.t0), q1 = std::min<int64_t>(b.query_start[s + 1], mb.t1);
      mb.query_start.push_back(static_cast<int32_t>(q0 - mb.t0));
      // The sequence's tokens after this micro-batch are not in the cache yet.
      mb.context_lens.push_back(static_cast<int32_t>(b.context_lens[s] - (b.query_start[s + 1] - q1)));
    }
    mb.query_start.push_back(static_cast<int32_t>(mb.t1 - mb.t0));
    for (size_t i = 0; i < b.logits_indices.size(); ++i)
      if (b.logits_indices[i] >= mb.t0 && b.logits_indices[i] < mb.t1) {
        mb.logits_indices.push_back(static_cast<int32_t>(b.logits_indices[i] - mb.t0));
        mb.logits_rows.push_back(i);
      }
    const size_t t0 = static_cast<size_t>(mb.t0), len = static_cast<size_t>(mb.t1 - mb.t0);
    const size_t w = static_cast<size_t>(b.max_blocks_per_seq);
    mb.batch.token_ids = b.token_ids.subspan(t0, len);
    mb.batch.positions = b.positions.subspan(t0, len);
    mb.batch.slot_mapping = b.slot_mapping.subspan(t0, len);
    mb.batch.query_start = mb.query_start;
    mb.batch.context_lens = mb.context_lens;
    mb.batch.block_tables = b.block_tables.subspan(static_cast<size_t>(sa) * w, static_cast<size_t>(sb - sa) * w);
    mb.batch.max_blocks_per_seq = b.max_blocks_per_seq;
    mb.batch.logits_indices = mb.logits_indices;
  }
}

class PipelineParallelCpuBackend final : public ModelRunner {
 public:
  PipelineParallelCpuBackend(const LlamaModel& model, const RunnerOptions& o)
      : size_(o.pipeline_parallel_size), n_vocab_(model.hparams().n_vocab), threads_(size_) {
    RunnerOptions ro = o;
    const int total = o.n_threads > 0 ? o.n_threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    ro.n_threads = std::max(1, total / size_);
    for (int s = 0; s < size_; ++s) {
      models_.push_back(model.pipeline_stage(s, size_));
      stages_.push_back(std::make_unique<CpuBackend>(*models_.back(), ro, nullptr, PipelineRole{s == 0, s == size_ - 1}));
    }
    hidden_.resize(static_cast<size_t>(size_ - 1));
    done_.resize(static_cast<size_t>(size_));
  }

  // Errors: the stages' (the lowest stage's first); validate_forward_batch's before any stage runs.
  std::span<const float> forward(const ForwardBatch& batch) override {
    validate_forward_batch(batch, n_vocab_, n_kv_blocks(), block_size(), models_[0]->hparams().kv_lookback());
    split_micro_batches(batch, size_, micro_);
    const size_t n_micro = micro_.size();
    logits_.resize(batch.logits_indices.size() * static_cast<size_t>(n_vocab_));
    for (auto& h : hidden_) h.resize(n_micro);
    std::fill(done_.begin(), done_.end(), size_t{0});
    failed_ = false;
    threads_.run([&](int s) {
      try {
        run_stage(static_cast<size_t>(s));
      } catch (...) {
        {
          std::lock_guard<std::mutex> lock(mu_);
          failed_ = true;
        }
        ready_.notify_all();
        throw;
      }
    });
    return logits_;
  }
  void copy_blocks(std::span<const BlockCopy> copies) override {
    for (auto& s : stages_) s->copy_blocks(copies);
  }
  // Each stage swaps its own layers of the same blocks.
  void allocate_swap_space(int32_t n_blocks) override {
    for (auto& s : stages_) s->allocate_swap_space(n_blocks);
  }
  void swap_out(std::span<const BlockSwap> swaps) override {
    for (auto& s : stages_) s->swap_out(swaps);
  }
  void swap_in(std::span<const BlockSwap> swaps) override {
    for (auto& s : stages_) s->swap_in(swaps);
  }
  // A block's record is each stage's record of its layers, in stage order.
  void read_kv_blocks(std::span<const int32_t> blocks, std::span<std::byte> out) const override {
    each_stage_part(blocks, out.size(), [&](size_t s, size_t off, size_t n) {
      std::vector<std::byte> part(n * blocks.size());
      stages_[s]->read_kv_blocks(blocks, part);
      for (size_t i = 0; i < blocks.size(); ++i) std::memcpy(out.data() + i * block_bytes() + off, part.data() + i * n, n);
    });
  }
  void write_kv_blocks(std::span<const int32_t> blocks, std::span<const std::byte> in) override {
    each_stage_part(blocks, in.size(), [&](size_t s, size_t off, size_t n) {
      std::vector<std::byte> part(n * blocks.size());
      for (size_t i = 0; i < blocks.size(); ++i) std::memcpy(part.data() + i * n, in.data() + i * block_bytes() + off, n);
      stages_[s]->write_kv_blocks(blocks, part);
    });
  }
  HostCopyTotals host_to_device_totals() override {
    HostCopyTotals t;
    for (auto& s : stages_) t.bytes += s->host_to_device_totals().bytes;
    return t;
  }
  double host_link_bytes_per_s() const override { return stages_[0]->host_link_bytes_per_s(); }
  int32_t n_kv_blocks() const override { return stages_[0]->n_kv_blocks(); }
  int32_t block_size() const override { return stages_[0]->block_size(); }
  KvDtype kv_dtype() const override { return stages_[0]->kv_dtype(); }
  // All stages' caches together: the whole model's layers.
  int64_t kv_bytes_per_token() const override {
    int64_t b = 0;
    for (const auto& s : stages_) b += s->kv_bytes_per_token();
    return b;
  }
  std::string description() const override {
    return "pipeline parallel " + std::to_string(size_) + " x " + stages_[0]->description();
  }

 private:
  // Stage s's part of the step: every micro-batch in order, each once the stage before has handed
  // it on. A failed stage wakes the waiting ones, which stop.
  void run_stage(size_t s) {
    const bool last = s + 1 == stages_.size();
    for (size_t m = 0; m < micro_.size(); ++m) {
      std::span<const float> in;
      if (s > 0) {
        std::unique_lock<std::mutex> lock(mu_);
        ready_.wait(lock, [&] { return failed_ || done_[s - 1] > m; });
        if (failed_) return;
        in = hidden_[s - 1][m];
      }
      const MicroBatch& mb = micro_[m];
      const std::span<const float> out = stages_[s]->forward_stage(mb.batch, in);
      if (!last) {
        hidden_[s][m].assign(out.begin(), out.end());
      } else {
        const size_t v = static_cast<size_t>(n_vocab_);
        KESTREL_ASSERT(out.size() == mb.logits_rows.size() * v, "pipeline parallel: logits rows");
        for (size_t i = 0; i < mb.logits_rows.size(); ++i)
          std::memcpy(logits_.data() + mb.logits_rows[i] * v, out.data() + i * v, sizeof(float) * v);
      }
      {
        std::lock_guard<std::mutex> lock(mu_);
        ++done_[s];
      }
      ready_.notify_all();
    }
  }
  size_t block_bytes() const { return static_cast<size_t>(block_size()) * static_cast<size_t>(kv_bytes_per_token()); }
  // fn(stage, offset of the stage's part in a block's record, its bytes) for every stage.
  template <class Fn>
  void each_stage_part(std::span<const int32_t> blocks, size_t total, Fn&& fn) const {
    if (total != blocks.size() * block_bytes()) throw Error("KV transfer: buffer size does not match the blocks");
    size_t off = 0;
    for (size_t s = 0; s < stages_.size(); ++s) {
      const size_t n = static_cast<size_t>(block_size()) * static_cast<size_t>(stages_[s]->kv_bytes_per_token());
      fn(s, off, n);
      off += n;
    }
  }

  int size_;
  int64_t n_vocab_;
  std::vector<std::unique_ptr<LlamaModel>> models_;
  std::vector<std::unique_ptr<CpuBackend>> stages_;
  std::vector<MicroBatch> micro_;
  std::vector<std::vector<std::vector<float>>> hidden_;  // [stage < size - 1][micro-batch] residual stream handed on
  std::vector<size_t> done_;                              // micro-batches each stage has finished this step
  bool failed_ = false;
  std::mutex mu_;
  std::condition_variable ready_;
  std::vector<float> logits_;
  RankThreads threads_;  // last: joined before the stages they drive are destroyed
};

}  // namespace

std::unique_ptr<ModelRunner> make_pipeline_parallel_cpu_runner(const LlamaModel& model, const RunnerOptions& options) {
  validate_pipeline_parallel(model.hparams(), options.pipeline_parallel_size);
  return std::make_unique<PipelineParallelCpuBackend>(model, options);
}

}  // namespace kestrel::cpu
