// Pipeline parallelism's driver (pipeline_parallel_runner.h): the micro-batch split, the stage
// threads and the ModelRunner over the stages, which keeps up to one pass per stage in flight.
#include "backend/pipeline_parallel_runner.h"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

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

// A submitted pass: its own copy of the batch's arrays (the caller's may change once submit
// returns), its micro-batches over them, and its logits as the last stage writes them.
struct Pass {
  std::vector<int32_t> token_ids, positions, query_start, context_lens, block_tables, logits_indices;
  std::vector<int64_t> slot_mapping;
  ForwardBatch batch;
  std::vector<MicroBatch> micro;
  std::vector<float> logits;
  size_t first_unit = 0;  // the number of micro-batches submitted before this pass's first

  explicit Pass(const ForwardBatch& b)
      : token_ids(b.token_ids.begin(), b.token_ids.end()),
        positions(b.positions.begin(), b.positions.end()),
        query_start(b.query_start.begin(), b.query_start.end()),
        context_lens(b.context_lens.begin(), b.context_lens.end()),
        block_tables(b.block_tables.begin(), b.block_tables.end()),
        logits_indices(b.logits_indices.begin(), b.logits_indices.end()),
        slot_mapping(b.slot_mapping.begin(), b.slot_mapping.end()) {
    batch = b;
    batch.token_ids = token_ids, batch.positions = positions, batch.query_start = query_start;
    batch.context_lens = context_lens, batch.block_tables = block_tables, batch.logits_indices = logits_indices;
    batch.slot_mapping = slot_mapping;
  }
};

class PipelineParallelRunner final : public ModelRunner {
 public:
  PipelineParallelRunner(std::vector<std::unique_ptr<PipelineStage>> stages, const ModelHparams& hp)
      : stages_(std::move(stages)),
        n_vocab_(hp.n_vocab),
        kv_lookback_(hp.kv_lookback()),
        n_slots_(std::max<size_t>(2, stages_.size())),
        done_(stages_.size(), 0) {
    KESTREL_ASSERT(!stages_.empty(), "pipeline parallel: no stage");
    for (const auto& s : stages_)
      KESTREL_ASSERT(s->runner().n_kv_blocks() == n_kv_blocks() && s->runner().block_size() == block_size(),
                     "pipeline parallel: the stages' KV pools differ");
    for (size_t s = 0; s < stages_.size(); ++s) threads_.emplace_back([this, s] { stage_loop(s); });
  }
  ~PipelineParallelRunner() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (std::thread& t : threads_) t.join();
  }

  std::span<const float> forward(const ForwardBatch& batch) override {
    KESTREL_ASSERT(passes_.empty(), "pipeline parallel: forward() with passes in flight");
    submit(batch);
    return collect();
  }
  // One pass per stage: with as many in flight, each stage works on one of them.
  int max_passes_in_flight() const override { return static_cast<int>(stages_.size()); }
  // A pass into an empty pipeline is split into micro-batches that fill it (GPipe); one behind
  // passes in flight is one micro-batch, since those already keep the stages busy.
  void submit(const ForwardBatch& batch) override {
    validate_forward_batch(batch, n_vocab_, n_kv_blocks(), block_size(), kv_lookback_);
    auto pass = std::make_unique<Pass>(batch);
    std::unique_lock<std::mutex> lock(mu_);
    KESTREL_ASSERT(passes_.size() < stages_.size(), "pipeline parallel: more passes in flight than stages");
    split_micro_batches(pass->batch, passes_.empty() ? static_cast<int>(stages_.size()) : 1, pass->micro);
    int64_t max_tokens = 0;
    for (const MicroBatch& mb : pass->micro) max_tokens = std::max(max_tokens, mb.t1 - mb.t0);
    if (max_tokens > hand_off_tokens_) {
      // Larger hand-off slots: only with no micro-batch in any stage (they are the stages' memory).
      idle_.wait(lock, [&] { return done_.back() == n_units_; });
      for (size_t s = 1; s < stages_.size(); ++s) stages_[s]->reserve_hand_off(n_slots_, max_tokens);
      hand_off_tokens_ = max_tokens;
    }
    pass->logits.resize(batch.logits_indices.size() * static_cast<size_t>(n_vocab_));
    pass->first_unit = n_units_;
    for (size_t m = 0; m < pass->micro.size(); ++m) units_.push_back({pass.get(), m});
    n_units_ += pass->micro.size();
    passes_.push_back(std::move(pass));
    lock.unlock();
    cv_.notify_all();
  }
  std::span<const float> collect() override {
    std::unique_lock<std::mutex> lock(mu_);
    if (passes_.empty()) throw Error("collect(): no pass in flight");
    Pass& p = *passes_.front();
    const size_t end = p.first_unit + p.micro.size();
    idle_.wait(lock, [&] { return done_.back() >= end; });
    collected_ = std::move(passes_.front());
    passes_.pop_front();
    while (!units_.empty() && units_.front().pass == collected_.get()) units_.pop_front(), ++units_base_;
    if (collected_->first_unit < poison_end_) {
      // A stage failed while this pass was submitted: it ran in part, or not at all.
      std::exception_ptr error = error_ ? error_ : std::make_exception_ptr(Error("pipeline parallel: a stage failed"));
      if (end >= poison_end_) error_ = nullptr;  // the last such pass: the ones after it ran whole
      std::rethrow_exception(error);
    }
    return collected_->logits;
  }
  void copy_blocks(std::span<const BlockCopy> copies) override {
    assert_idle();
    for (auto& s : stages_) s->runner().copy_blocks(copies);
  }
  // Each stage swaps its own layers of the same blocks.
  void allocate_swap_space(int32_t n_blocks) override {
    assert_idle();
    for (auto& s : stages_) s->runner().allocate_swap_space(n_blocks);
  }
  void swap_out(std::span<const BlockSwap> swaps) override {
    assert_idle();
    for (auto& s : stages_) s->runner().swap_out(swaps);
  }
  void swap_in(std::span<const BlockSwap> swaps) override {
    assert_idle();
    for (auto& s : stages_) s->runner().swap_in(swaps);
  }
  void swap_out_in(std::span<const BlockSwap> out, std::span<const BlockSwap> in) override {
    assert_idle();
    for (auto& s : stages_) s->runner().swap_out_in(out, in);
  }
  // A block's record is each stage's record of its layers, in stage order.
  void read_kv_blocks(std::span<const int32_t> blocks, std::span<std::byte> out) const override {
    assert_idle();
    each_stage_part(blocks, out.size(), [&](size_t s, size_t off, size_t n) {
      std::vector<std::byte> part(n * blocks.size());
      stages_[s]->runner().read_kv_blocks(blocks, part);
      for (size_t i = 0; i < blocks.size(); ++i) std::memcpy(out.data() + i * block_bytes() + off, part.data() + i * n, n);
    });
  }
  void write_kv_blocks(std::span<const int32_t> blocks, std::span<const std::byte> in) override {
    assert_idle();
    each_stage_part(blocks, in.size(), [&](size_t s, size_t off, size_t n) {
      std::vector<std::byte> part(n * blocks.size());
      for (size_t i = 0; i < blocks.size(); ++i) std::memcpy(part.data() + i * n, in.data() + i * block_bytes() + off, n);
      stages_[s]->runner().write_kv_blocks(blocks, part);
    });
  }
  HostCopyTotals host_to_device_totals() override {
    assert_idle();
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
  struct Unit {
    Pass* pass;
    size_t m;  // its micro-batch
  };

  // Stage s's thread: the submitted micro-batches ("units", numbered in submission order across
  // passes) one after another, unit u once the stage before has handed it on and the stage after
  // has finished unit u - n_slots_, whose hand-off slot (u mod n_slots_) u's output takes. After
  // a stage fails, every stage passes over the units submitted by then (the collect() of each of
  // their passes reports the error); later passes run as usual.
  void stage_loop(size_t s) {
    const bool last = s + 1 == stages_.size();
    for (;;) {
      Unit unit;
      size_t u;
      bool skip;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] {
          if (stop_) return true;
          const size_t v = done_[s];
          return v < n_units_ && (s == 0 || done_[s - 1] > v) && (last || done_[s + 1] + n_slots_ > v);
        });
        if (stop_) return;
        u = done_[s];
        unit = units_[u - units_base_];
        skip = u < poison_end_;
      }
      if (!skip) {
        try {
          const MicroBatch& mb = unit.pass->micro[unit.m];
          const std::span<const float> out =
              stages_[s]->forward_micro_batch(mb.batch, u % n_slots_, last ? nullptr : stages_[s + 1].get());
          if (last) {
            const size_t v = static_cast<size_t>(n_vocab_);
            KESTREL_ASSERT(out.size() == mb.logits_rows.size() * v, "pipeline parallel: logits rows");
            for (size_t i = 0; i < mb.logits_rows.size(); ++i)
              std::memcpy(unit.pass->logits.data() + mb.logits_rows[i] * v, out.data() + i * v, sizeof(float) * v);
          }
        } catch (...) {
          std::lock_guard<std::mutex> lock(mu_);
          if (!error_) error_ = std::current_exception();
          poison_end_ = n_units_;
        }
      }
      {
        std::lock_guard<std::mutex> lock(mu_);
        ++done_[s];
      }
      cv_.notify_all();
      if (last) idle_.notify_all();
    }
  }
  void assert_idle() const {
    std::lock_guard<std::mutex> lock(mu_);
    KESTREL_ASSERT(passes_.empty(), "pipeline parallel: a block operation with passes in flight");
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
  const size_t n_slots_;          // hand-off slots per stage after the first
  int64_t hand_off_tokens_ = 0;   // rows each slot holds
  mutable std::mutex mu_;
  std::condition_variable cv_;    // stages: a unit to run; stop
  std::condition_variable idle_;  // the last stage finished a unit
  std::deque<std::unique_ptr<Pass>> passes_;  // submitted, not collected, oldest first
  std::unique_ptr<Pass> collected_;           // the last collected (its logits are returned)
  std::deque<Unit> units_;                    // units of passes_ in order; units_[0] is unit units_base_
  size_t units_base_ = 0;
  size_t n_units_ = 0;            // units submitted
  std::vector<size_t> done_;      // units each stage has finished (or passed over)
  std::exception_ptr error_;      // the first failure not yet reported by every pass it spoiled
  size_t poison_end_ = 0;         // units before this are passed over: submitted when a stage failed
  bool stop_ = false;
  std::vector<std::thread> threads_;  // last: joined before the stages they drive are destroyed
};

}  // namespace

std::unique_ptr<ModelRunner> make_pipeline_parallel_runner(std::vector<std::unique_ptr<PipelineStage>> stages,
                                                           const ModelHparams& hp) {
  return std::make_unique<PipelineParallelRunner>(std::move(stages), hp);
}

}  // namespace kestrel
