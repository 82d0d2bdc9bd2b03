// Pipeline parallelism's driver (pipeline_parallel_runner.h): the micro-batch split, the stage
// threads and the ModelRunner over the stages.
#include "backend/pipeline_parallel_runner.h"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <string>
#include <utility>

#include "backend/rank_threads.h"
#include "core/error.h"

namespace kestrel {

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

namespace {

class PipelineParallelRunner final : public ModelRunner {
 public:
  PipelineParallelRunner(std::vector<std::unique_ptr<PipelineStage>> stages, const ModelHparams& hp)
      : stages_(std::move(stages)),
        n_vocab_(hp.n_vocab),
        kv_lookback_(hp.kv_lookback()),
        done_(stages_.size()),
        threads_(static_cast<int>(stages_.size())) {
    KESTREL_ASSERT(!stages_.empty(), "pipeline parallel: no stage");
    for (const auto& s : stages_)
      KESTREL_ASSERT(s->runner().n_kv_blocks() == n_kv_blocks() && s->runner().block_size() == block_size(),
                     "pipeline parallel: the stages' KV pools differ");
  }

  std::span<const float> forward(const ForwardBatch& batch) override {
    validate_forward_batch(batch, n_vocab_, n_kv_blocks(), block_size(), kv_lookback_);
    split_micro_batches(batch, static_cast<int>(stages_.size()), micro_);
    int64_t max_tokens = 0;
    for (const MicroBatch& mb : micro_) max_tokens = std::max(max_tokens, mb.t1 - mb.t0);
    for (size_t s = 1; s < stages_.size(); ++s) stages_[s]->reserve_hand_off(micro_.size(), max_tokens);
    logits_.resize(batch.logits_indices.size() * static_cast<size_t>(n_vocab_));
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
    for (auto& s : stages_) s->runner().copy_blocks(copies);
  }
  // Each stage swaps its own layers of the same blocks.
  void allocate_swap_space(int32_t n_blocks) override {
    for (auto& s : stages_) s->runner().allocate_swap_space(n_blocks);
  }
  void swap_out(std::span<const BlockSwap> swaps) override {
    for (auto& s : stages_) s->runner().swap_out(swaps);
  }
  void swap_in(std::span<const BlockSwap> swaps) override {
    for (auto& s : stages_) s->runner().swap_in(swaps);
  }
  void swap_out_in(std::span<const BlockSwap> out, std::span<const BlockSwap> in) override {
    for (auto& s : stages_) s->runner().swap_out_in(out, in);
  }
  // A block's record is each stage's record of its layers, in stage order.
  void read_kv_blocks(std::span<const int32_t> blocks, std::span<std::byte> out) const override {
    each_stage_part(blocks, out.size(), [&](size_t s, size_t off, size_t n) {
      std::vector<std::byte> part(n * blocks.size());
      stages_[s]->runner().read_kv_blocks(blocks, part);
      for (size_t i = 0; i < blocks.size(); ++i) std::memcpy(out.data() + i * block_bytes() + off, part.data() + i * n, n);
    });
  }
  void write_kv_blocks(std::span<const int32_t> blocks, std::span<const std::byte> in) override {
    each_stage_part(blocks, in.size(), [&](size_t s, size_t off, size_t n) {
      std::vector<std::byte> part(n * blocks.size());
      for (size_t i = 0; i < blocks.size(); ++i) std::memcpy(part.data() + i * n, in.data() + i * block_bytes() + off, n);
      stages_[s]->runner().write_kv_blocks(blocks, part);
    });
  }
  HostCopyTotals host_to_device_totals() override {
    HostCopyTotals t;
    for (auto& s : stages_) {
      const HostCopyTotals st = s->runner().host_to_device_totals();
      t.bytes += st.bytes;
      t.seconds = std::max(t.seconds, st.seconds);  // the stages' links copy at once
    }
    return t;
  }
  double host_link_bytes_per_s() const override { return stages_[0]->runner().host_link_bytes_per_s(); }
  int32_t n_kv_blocks() const override { return stages_[0]->runner().n_kv_blocks(); }
  int32_t block_size() const override { return stages_[0]->runner().block_size(); }
  KvDtype kv_dtype() const override { return stages_[0]->runner().kv_dtype(); }
  // All stages' caches together: the whole model's layers.
  int64_t kv_bytes_per_token() const override {
    int64_t b = 0;
    for (const auto& s : stages_) b += s->runner().kv_bytes_per_token();
    return b;
  }
  std::string description() const override {
    return "pipeline parallel " + std::to_string(stages_.size()) + " x " + stages_[0]->runner().description();
  }

 private:
  // Stage s's part of the step: every micro-batch in order, each once the stage before has handed
  // it on. A failed stage wakes the waiting ones, which stop.
  void run_stage(size_t s) {
    const bool last = s + 1 == stages_.size();
    for (size_t m = 0; m < micro_.size(); ++m) {
      if (s > 0) {
        std::unique_lock<std::mutex> lock(mu_);
        ready_.wait(lock, [&] { return failed_ || done_[s - 1] > m; });
        if (failed_) return;
      }
      const MicroBatch& mb = micro_[m];
      const std::span<const float> out =
          stages_[s]->forward_micro_batch(mb.batch, m, last ? nullptr : stages_[s + 1].get());
      if (last) {
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
      const size_t n = static_cast<size_t>(block_size()) * static_cast<size_t>(stages_[s]->runner().kv_bytes_per_token());
      fn(s, off, n);
      off += n;
    }
  }

  std::vector<std::unique_ptr<PipelineStage>> stages_;
  int64_t n_vocab_, kv_lookback_;
  std::vector<MicroBatch> micro_;
  std::vector<size_t> done_;  // micro-batches each stage has finished this step
  bool failed_ = false;
  std::mutex mu_;
  std::condition_variable ready_;
  std::vector<float> logits_;
  RankThreads threads_;  // last: joined before the stages they drive are destroyed
};

}  // namespace

std::unique_ptr<ModelRunner> make_pipeline_parallel_runner(std::vector<std::unique_ptr<PipelineStage>> stages,
                                                           const ModelHparams& hp) {
  return std::make_unique<PipelineParallelRunner>(std::move(stages), hp);
}

}  // namespace kestrel
