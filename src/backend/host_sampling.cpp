// ModelRunner::forward_sample for backends that do not sample on the device: forward(), then each
// row drawn on the host by Sampler::sample_with_uniform (the reference of cuda::sample_tokens) from
// its settings and uniform alone, after grammar::apply_token_bitmask where the row is masked. Gives
// the CUDA sampler's tokens for the same logits, so the engine's device path can be tested on the
// CPU backend.
#include <string>
#include <utility>

#include "backend/model_runner.h"
#include "core/error.h"
#include "sampling/candidate_list.h"
#include "sampling/grammar/matcher.h"
#include "sampling/sampler.h"

namespace kestrel {

void ModelRunner::submit(const ForwardBatch& batch) {
  if (has_submitted_) throw Error("the " + description() + " backend runs one pass at a time: collect() the pass in flight first");
  submitted_ = forward(batch);
  has_submitted_ = true;
}
std::span<const float> ModelRunner::collect() {
  if (!has_submitted_) throw Error("collect(): no pass in flight");
  has_submitted_ = false;
  return std::exchange(submitted_, {});
}
void ModelRunner::allocate_swap_space(int32_t) {
  throw Error("the " + description() + " backend has no host swap space");
}
void ModelRunner::swap_out(std::span<const BlockSwap>) {
  throw Error("the " + description() + " backend has no host swap space");
}
void ModelRunner::swap_in(std::span<const BlockSwap>) {
  throw Error("the " + description() + " backend has no host swap space");
}
void ModelRunner::swap_out_in(std::span<const BlockSwap> out, std::span<const BlockSwap> in) {
  if (!out.empty()) swap_out(out);
  if (!in.empty()) swap_in(in);
}
void ModelRunner::read_kv_blocks(std::span<const int32_t>, std::span<std::byte>) const {
  throw Error("the " + description() + " backend cannot export KV blocks (KV transfer)");
}
void ModelRunner::write_kv_blocks(std::span<const int32_t>, std::span<const std::byte>) {
  throw Error("the " + description() + " backend cannot import KV blocks (KV transfer)");
}
KvIpcMemory ModelRunner::export_kv_ipc() const {
  throw Error("the " + description() + " backend has no CUDA IPC (KV transfer)");
}
void ModelRunner::open_kv_ipc(const KvIpcMemory&) const {
  throw Error("the " + description() + " backend has no CUDA IPC (KV transfer)");
}
void ModelRunner::copy_kv_blocks_ipc(const KvIpcMemory&, std::span<const int32_t>, std::span<const int32_t>) {
  throw Error("the " + description() + " backend has no CUDA IPC (KV transfer)");
}

std::span<const int32_t> ModelRunner::forward_sample(const ForwardBatch& batch, std::span<const RowSampling> rows,
                                                     const TokenMaskFill& fill_masks) {
  if (rows.size() != batch.logits_indices.size())
    throw Error("forward_sample: " + std::to_string(rows.size()) + " sampling rows for " +
                std::to_string(batch.logits_indices.size()) + " logits rows");
  return sample_on_host(forward(batch), rows, fill_masks);
}

std::span<const int32_t> ModelRunner::sample_on_host(std::span<const float> logits, std::span<const RowSampling> rows,
                                                     const TokenMaskFill& fill_masks) {
  sampled_.clear();
  if (rows.empty()) return sampled_;
  KESTREL_ASSERT(logits.size() % rows.size() == 0, "forward_sample: logits are not whole rows");
  const size_t n_vocab = logits.size() / rows.size();
  const size_t words = grammar::bitmask_words(static_cast<int32_t>(n_vocab));
  bool any_masked = false;
  for (const RowSampling& r : rows) any_masked |= r.masked != 0;
  if (any_masked) {
    if (!fill_masks) throw Error("forward_sample: a masked sampling row without token masks");
    host_masks_.assign(rows.size() * words, ~0u);
    fill_masks(host_masks_);
  }
  for (size_t i = 0; i < rows.size(); ++i) {
    const RowSampling& r = rows[i];
    std::span<const float> row = logits.subspan(i * n_vocab, n_vocab);
    if (r.masked != 0) {
      masked_row_.assign(row.begin(), row.end());
      grammar::apply_token_bitmask(masked_row_, std::span<const uint32_t>(host_masks_).subspan(i * words, words));
      row = masked_row_;
    }
    SamplingParams p;
    p.temperature = r.temperature;
    p.top_k = r.top_k;
    p.top_p = r.top_p;
    p.min_p = r.min_p;
    Sampler s(p, static_cast<int32_t>(n_vocab));
    int32_t token = -1;
    try {
      token = s.sample_with_uniform(row, r.uniform);
    } catch (const NonFiniteLogitsError&) {
      token = -1;  // the device sampler's mark for a row without a distribution
    }
    sampled_.push_back(token);
  }
  return sampled_;
}

}  // namespace kestrel
