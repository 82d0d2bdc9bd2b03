// The forward pass of a Llama-family model on the CPU over a flat batch (prefill chunks and
// decode tokens of several sequences mixed), reading and writing K/V through block tables.
#pragma once

#include <span>
#include <vector>

#include "backend/cpu/matmul.h"
#include "core/thread_pool.h"
#include "memory/kv_cache.h"
#include "model/forward_batch.h"
#include "model/llama_weights.h"

namespace kestrel::cpu {

class CpuModelRunner {
 public:
  // The model, the KV cache and the pool must outlive the runner.
  CpuModelRunner(const LlamaModel& model, KvCache& kv, ThreadPool& pool);

  // Runs every layer over the batch, writes each token's K and V into its slot
  // (batch.slot_mapping), and returns the logits of the rows batch.logits_indices:
  // [logits_indices.size(), n_vocab], f32, valid until the next call. Throws kestrel::Error on an
  // inconsistent batch (token id outside the vocabulary, slot outside the cache, ...).
  std::span<const float> forward(const ForwardBatch& batch);

  const LlamaModel& model() const { return model_; }

 private:
  void check(const ForwardBatch& b) const;
  void attention(const ForwardBatch& b, int64_t layer);
  // Stores the batch's K and V rows of `layer` in their slots (converted to the cache's dtype).
  void write_kv(const ForwardBatch& b, int64_t layer);
  // RMSNorm of n rows of n_embd with weight w, split over the pool.
  void rms_norm_rows(const float* x, const float* w, float* y, int64_t n);

  const LlamaModel& model_;
  const ModelHparams& hp_;
  KvCache& kv_;
  ThreadPool& pool_;
  MatmulWorkspace ws_;
  std::vector<float> inv_freq_;  // [rope_dim / 2]
  // Activations, sized for the largest batch seen: x is the residual stream.
  std::vector<float> x_, h_, q_, k_, v_, attn_, gate_, up_, logits_in_, logits_;
  std::vector<int32_t> token_seq_;  // [n_tokens] sequence index of each token
};

}  // namespace kestrel::cpu
