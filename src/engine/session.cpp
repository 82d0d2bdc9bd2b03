#include "engine/session.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace kestrel {

namespace {
using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}
int64_t context_for(const LlamaModel& m, const SessionOptions& o) {
  if (o.n_ctx <= 0) throw Error("context size must be positive, got " + std::to_string(o.n_ctx));
  return std::min(o.n_ctx, m.hparams().n_ctx_train);
}
}  // namespace

Session::Session(const LlamaModel& model, const SessionOptions& opts, std::unique_ptr<ModelRunner> runner)
    : model_(model), opts_(opts), n_ctx_(context_for(model, opts)), runner_(std::move(runner)) {
  if (opts.block_size <= 0) throw Error("block size must be positive, got " + std::to_string(opts.block_size));
  const int64_t n_blocks = (n_ctx_ + opts.block_size - 1) / opts.block_size;
  if (runner_ == nullptr) {
    RunnerOptions ro;
    ro.block_size = opts.block_size;
    ro.n_kv_blocks = static_cast<int32_t>(n_blocks);
    ro.kv_dtype = opts.kv_dtype;
    ro.n_threads = opts.n_threads;
    runner_ = make_cpu_model_runner(model, ro);
  }
  if (runner_->block_size() != opts.block_size || runner_->n_kv_blocks() < n_blocks)
    throw Error("session: the backend's KV pool (" + std::to_string(runner_->n_kv_blocks()) + " blocks of " +
                std::to_string(runner_->block_size()) + ") cannot hold the context of " + std::to_string(n_ctx_));
  allocator_ = BlockAllocator(static_cast<int32_t>(n_blocks));
  table_.block_size = opts.block_size;
  if (opts.prefill_chunk <= 0) throw Error("prefill chunk must be positive");
}

void Session::reset() {
  table_.release(allocator_);
  tokens_.clear();
  n_cached_ = 0;
}

void Session::truncate(int64_t n) {
  if (n < 0 || n > n_past()) throw Error("truncate: position " + std::to_string(n) + " outside the sequence");
  tokens_.resize(static_cast<size_t>(n));
  n_cached_ = std::min(n_cached_, n);
}

ForwardBatch Session::make_batch(int64_t begin, int64_t end, bool all_rows) {
  const int64_t n = end - begin;
  table_.reserve(end, allocator_);
  positions_.resize(static_cast<size_t>(n));
  slots_.resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    positions_[static_cast<size_t>(i)] = static_cast<int32_t>(begin + i);
    slots_[static_cast<size_t>(i)] = table_.slot(begin + i);
  }
  logits_rows_.clear();
  if (all_rows) {
    for (int64_t i = 0; i < n; ++i) logits_rows_.push_back(static_cast<int32_t>(i));
  } else {
    logits_rows_.push_back(static_cast<int32_t>(n - 1));
  }
  query_start_ = {0, static_cast<int32_t>(n)};
  context_lens_ = {static_cast<int32_t>(end)};
  ForwardBatch b;
  b.token_ids = std::span<const int32_t>(tokens_).subspan(static_cast<size_t>(begin), static_cast<size_t>(n));
  b.positions = positions_;
  b.slot_mapping = slots_;
  b.query_start = query_start_;
  b.context_lens = context_lens_;
  b.block_tables = table_.blocks;
  b.max_blocks_per_seq = static_cast<int32_t>(table_.blocks.size());
  b.logits_indices = logits_rows_;
  return b;
}

std::span<const float> Session::run(int64_t begin, int64_t end, bool all_rows) {
  return runner_->forward(make_batch(begin, end, all_rows));
}

std::vector<float> Session::all_logits(std::span<const int32_t> tokens) {
  if (static_cast<int64_t>(tokens.size()) > n_ctx_)
    throw Error("prompt of " + std::to_string(tokens.size()) + " tokens exceeds the context of " +
                std::to_string(n_ctx_));
  reset();
  tokens_.assign(tokens.begin(), tokens.end());
  std::vector<float> out;
  const int64_t n = static_cast<int64_t>(tokens.size());
  for (int64_t b = 0; b < n; b += opts_.prefill_chunk) {
    const int64_t e = std::min(n, b + opts_.prefill_chunk);
    auto logits = run(b, e, true);
    out.insert(out.end(), logits.begin(), logits.end());
  }
  n_cached_ = n;
  return out;
}

GenerateStats Session::generate(std::span<const int32_t> tokens, const GenerateOptions& opts,
                                const std::function<bool(int32_t)>& on_token) {
  opts.sampling.validate();
  const int64_t n_vocab = model_.hparams().n_vocab;
  for (int32_t t : tokens)
    if (t < 0 || t >= n_vocab)
      throw Error("token id " + std::to_string(t) + " outside the vocabulary of " + std::to_string(n_vocab));
  const int64_t n_total = n_past() + static_cast<int64_t>(tokens.size());
  if (n_total > n_ctx_)
    throw Error("prompt of " + std::to_string(n_total) + " tokens exceeds the context of " +
                std::to_string(n_ctx_) + " tokens");
  if (n_total == 0) throw Error("empty prompt: nothing to condition on");

  GenerateStats st;
  st.n_prompt = n_total - n_cached_;
  Sampler sampler(opts.sampling, static_cast<int32_t>(n_vocab));
  const auto t0 = Clock::now();
  tokens_.insert(tokens_.end(), tokens.begin(), tokens.end());
  if (n_cached_ == n_past()) --n_cached_;  // nothing new: recompute the last position's logits
  // Every prefill chunk but the last; the decode loop's first pass runs the last one and samples.
  while (n_past() - n_cached_ > opts_.prefill_chunk) {
    run(n_cached_, n_cached_ + opts_.prefill_chunk, false);
    n_cached_ += opts_.prefill_chunk;
  }
  // A backend that samples on the device (CUDA) keeps the logits there when the sampler needs
  // nothing but top_k/top_p/min_p/temperature; the token is the one sample() would pick.
  const bool on_device = runner_->samples_on_device() && sampler.device_compatible();
  auto forward_and_sample = [&]() -> int32_t {
    const int64_t begin = n_cached_;
    n_cached_ = n_past();
    if (on_device) {
      const SamplingParams& p = sampler.params();
      const RowSampling row{p.temperature, p.top_k, p.top_p, p.min_p, sampler.take_uniform()};
      const std::span<const int32_t> t = runner_->forward_sample(make_batch(begin, n_past(), false), {&row, 1});
      if (t[0] < 0)
        throw Error("the model produced NaN logits at position " + std::to_string(n_past() - 1) +
                    ": its weights are probably corrupt");
      return t[0];
    }
    const std::span<const float> logits = run(begin, n_past(), false);
    for (float v : logits)
      if (std::isnan(v))
        throw Error("the model produced NaN logits at position " + std::to_string(n_past() - 1) +
                    ": its weights are probably corrupt");
    return sampler.sample(logits, tokens_);
  };

  auto t_decode = Clock::now();
  st.finish_reason = "length";
  const int64_t max_new = opts.max_tokens < 0 ? n_ctx_ : opts.max_tokens;
  while (st.n_generated < max_new && n_past() < n_ctx_) {
    const int32_t id = forward_and_sample();
    ++st.n_generated;
    if (st.n_generated == 1) {
      st.prefill_seconds = seconds_since(t0);
      t_decode = Clock::now();
    }
    tokens_.push_back(id);  // its KV is computed by the next run (or the next generate call)
    const bool is_stop = std::find(opts.stop_ids.begin(), opts.stop_ids.end(), id) != opts.stop_ids.end();
    if (!on_token(id)) {
      st.finish_reason = "abort";
      break;
    }
    if (is_stop) {
      st.finish_reason = "stop";
      break;
    }
  }
  if (n_cached_ < n_past() && st.n_generated == 0) {  // nothing generated: still cache the prompt
    run(n_cached_, n_past(), false);
    n_cached_ = n_past();
  }
  if (st.n_generated == 0) st.prefill_seconds = seconds_since(t0);
  st.decode_seconds = st.n_generated > 1 ? seconds_since(t_decode) : 0;
  return st;
}

}  // namespace kestrel
