// The CPU backend's forward pass over a flat batch (prefill chunks and decode tokens of several
// sequences mixed), reading and writing K/V through block tables: the architecture's builder
// (model/forward_ops.h) run over this class's ForwardOps, in f32 activations.
#pragma once

#include <span>
#include <vector>

#include "backend/communicator.h"
#include "backend/cpu/matmul.h"
#include "backend/cpu/paged_attention.h"
#include "core/thread_pool.h"
#include "memory/kv_cache.h"
#include "model/forward_batch.h"
#include "model/forward_ops.h"
#include "model/llama_weights.h"
#include "model/pipeline_parallel.h"

namespace kestrel::cpu {

class CpuModelRunner final : private ForwardOps {
 public:
  // The model, the KV cache, the pool and the communicator must outlive the runner. `comm`: this
  // rank's communicator when `model` is one rank's shard of a tensor-parallel group
  // (LlamaModel::tensor_parallel_shard), over which all_reduce and the vocabulary-parallel embed
  // sum; null for the whole model. `role`: the stage's place when `model` is a pipeline stage.
  CpuModelRunner(const LlamaModel& model, KvCache& kv, ThreadPool& pool, Communicator* comm = nullptr,
                 PipelineRole role = {});

  // Runs every layer over the batch, writes each token's K and V into its slot
  // (batch.slot_mapping), and returns the logits of the rows batch.logits_indices:
  // [logits_indices.size(), n_vocab], f32, valid until the next call (n_vocab: the LM head's rows,
  // this rank's vocabulary slice in a tensor-parallel shard). A pipeline stage that is not the
  // first reads its input residual stream from `hidden_in` [n_tokens, n_embd] f32 (instead of the
  // token embeddings); one that is not the last returns its output residual stream [n_tokens,
  // n_embd] f32 instead of logits. Throws kestrel::Error on an inconsistent batch (token id outside
  // the vocabulary, slot outside the cache, ..., hidden_in of the wrong size).
  std::span<const float> forward(const ForwardBatch& batch, std::span<const float> hidden_in = {});

  const LlamaModel& model() const { return model_; }
  // Tokens each routed expert has run since construction, [n_layer * n_expert] (layer-major;
  // dense layers stay 0); empty for a dense model.
  const std::vector<uint64_t>& expert_token_counts() const { return expert_tokens_; }

 private:
  // ForwardOps over the pass's batch (batch_). Act::Qkv is q_, k_ and v_ (three arrays: the
  // matmul writes each projection's rows contiguously); Act::GateUp is gate_ and up_.
  void embed() override;
  void add_norm_linear(Act add, WeightId norm, WeightId proj, Act out) override;
  void rope_write_kv(int32_t layer, Act qkv) override;
  void attention(int32_t layer, Act qkv, Act out) override;
  void linear(Act in, WeightId proj, Act out) override;
  void swiglu_linear(Act in, WeightId proj, Act out) override;
  void final_norm_logits(Act add, WeightId norm, WeightId head) override;
  void add_norm(Act add, WeightId norm, Act out) override;
  void moe_ffn(int32_t layer, Act in, Act out) override;  // cpu_moe.cpp
  void mla_attention(int32_t layer, Act in, Act out) override;  // cpu_mla.cpp
  void qk_norm(int32_t layer, Act qkv) override;
  void norm(Act a, WeightId w) override;
  void geglu_linear(Act in, WeightId proj, Act out) override;
  void all_reduce(Act a) override;
  // (silu or gelu_tanh)(gate) * up -> gate, then out = gate . w(proj)^T.
  void glu_linear(bool gelu, WeightId proj, Act out);
  void prepare_mla();  // the absorbed per-head matrices of every layer, from KvB
  float* act(Act a);  // the [n, d] arrays: AttnOut, Down, Attn, Normed
  // The arrays of an activation, one per stored part of the projection that writes it (Qkv: q_,
  // k_, v_; GateUp: gate_, up_; else act(a)); returns their count.
  size_t act_parts(Act a, float** ys);
  void add_to_residual(Act add);
  // ys[i] = x . w(part i of proj)^T (+ its bias) for the stored parts of proj (parts()), n rows.
  void project(WeightId proj, const float* x, int64_t n, float* const* ys);

  // Resizes v to hold at least n elements (activation arrays only grow).
  template <typename T>
  static void grow(std::vector<T>& v, int64_t n) {
    if (static_cast<int64_t>(v.size()) < n) v.resize(static_cast<size_t>(n));
  }
  void check(const ForwardBatch& b) const;
  // Stores the batch's K and V rows of `layer` in their slots (converted to the cache's dtype).
  void write_kv(const ForwardBatch& b, int64_t layer);
  // attn_n_ctx_ / attn_kv_begin_ for the batch's tokens: causal, from a window of `window` keys (0: all).
  void set_key_ranges(const ForwardBatch& b, int64_t window);
  // The batch's sequences and those key ranges, for paged_attention.
  AttentionBatch attention_batch(const ForwardBatch& b, const float* q, int64_t q_stride, float* out, int64_t out_stride,
                                 int64_t n_head_kv, int64_t head_stride) const;
  // RMSNorm of n rows of n_embd with weight w, split over the pool.
  void rms_norm_rows(const float* x, const float* w, float* y, int64_t n);

  const LlamaModel& model_;
  const ModelHparams& hp_;
  KvCache& kv_;
  ThreadPool& pool_;
  Communicator* comm_;
  PipelineRole role_;
  std::span<const float> hidden_in_;  // the pass's input residual stream (a stage after the first)
  MatmulWorkspace ws_;
  const Architecture& arch_;
  std::vector<float> inv_freq_;      // [rope_dim / 2]
  std::vector<float> inv_freq_swa_;  // [rope_dim / 2] for windowed layers with their own RoPE base
  const ForwardBatch* batch_ = nullptr;  // the pass in progress
  // Activations, sized for the largest batch seen: x is the residual stream, h the normed rows,
  // o and down the block outputs not yet added to x.
  std::vector<float> x_, h_, q_, k_, v_, attn_, o_, down_, gate_, up_, logits_in_, logits_;
  int64_t logits_width_ = 0;  // the LM head's rows: n_vocab, or a shard's slice of it
  std::vector<int32_t> token_seq_;  // [n_tokens] sequence index of each token
  std::vector<int64_t> attn_n_ctx_, attn_kv_begin_;  // [n_tokens] each token's keys [kv_begin, n_ctx)
  std::vector<float> attn_states_;  // split-KV chunk states
  // MoE scratch (cpu_moe.cpp): router logits, each (token, slot)'s expert and weight, the rows
  // grouped by expert, and the shared expert's activations.
  std::vector<float> router_logits_, moe_weights_, moe_x_, moe_gate_, moe_up_, moe_y_, shared_gate_, shared_up_,
      shared_y_, shared_scale_;
  std::vector<int32_t> moe_ids_, moe_offsets_, moe_rows_;
  std::vector<uint64_t> expert_tokens_;
  // MLA (cpu_mla.cpp): per layer W_UK_h^T [H, r, qk_nope] and W_UV_h [H, v_head_dim, r] in f32;
  // scratch for the low-rank query, the cached rows, the absorbed queries and latent outputs.
  std::vector<std::vector<float>> mla_uk_t_, mla_uv_;
  std::vector<float> mla_qa_, mla_kv_, mla_q_, mla_o_;
};

}  // namespace kestrel::cpu
