// Host-side launchers of the CUDA kernels (issue 4): one op per .cu/.cuh pair under this folder,
// each tested against a CPU reference in tests/backend/. Only src/backend/cuda includes CUDA
// headers. All pointers are device pointers; every launcher enqueues on `stream` and never
// synchronises. bf16 tensors are stored as __nv_bfloat16; accumulation is in f32.
//
// Layouts shared with the CPU backend:
// - activations are row-major [n_tokens, width];
// - the paged KV cache of one layer is [n_blocks, n_head_kv, block_size, head_dim], bf16 (the CPU
//   KvCache's layout), a token's slot is block_id * block_size + offset (slot_mapping);
// - a flat batch is ForwardBatch's: query_start [n_seqs + 1], context_lens [n_seqs] (tokens in
//   the cache after this step, including this step's), block_tables [n_seqs, max_blocks_per_seq],
//   positions [n_tokens].
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace kestrel::cuda {

using bf16 = __nv_bfloat16;

// out[t, :] = table[ids[t], :]. table [n_vocab, n_embd] bf16; out [n_tokens, n_embd] f32 (the
// residual stream is kept in f32).
void embedding(const bf16* table, const int32_t* ids, int64_t n_tokens, int64_t n_embd, float* out,
               cudaStream_t stream);

// Fused residual add and RMSNorm (Zhang & Sennrich 2019): if add != nullptr, residual += add
// (f32 += bf16); then out = residual / sqrt(mean(residual^2) + eps) * weight.
// residual [n_tokens, dim] f32 (in/out); add [n_tokens, dim] bf16 or null; weight [dim] bf16;
// out [n_tokens, dim] bf16.
void add_rms_norm(float* residual, const bf16* add, const bf16* weight, bf16* out, int64_t n_tokens,
                  int64_t dim, float eps, cudaStream_t stream);

// RoPE on q and k (in place), then K and V written into the paged cache at slot_mapping.
// q [n_tokens, n_head, head_dim] bf16; k, v [n_tokens, n_head_kv, head_dim] bf16;
// inv_freq [rope_dim / 2] f32 (theta^(-2i/rope_dim) / freq_factor[i]), positions scaled by
// 1 / position_scale; rotate_half: pair x[i] with x[i + rope_dim/2] (HF), else x[2i], x[2i+1].
// k_cache, v_cache: one layer, [n_blocks, n_head_kv, block_size, head_dim] bf16.
// Angles are computed in f32 from (position * inv_freq) with sincosf.
void rope_write_kv(bf16* q, bf16* k, const bf16* v, const int32_t* positions, const int64_t* slot_mapping,
                   const float* inv_freq, float position_scale, int64_t n_tokens, int64_t n_head,
                   int64_t n_head_kv, int64_t head_dim, int64_t rope_dim, bool rotate_half, bf16* k_cache,
                   bf16* v_cache, int32_t block_size, cudaStream_t stream);

// out[t, i] = silu(gate_up[t, i]) * gate_up[t, n_ff + i]  (SwiGLU; gate and up side by side as
// one fused GEMM writes them). gate_up [n_tokens, 2 * n_ff] bf16; out [n_tokens, n_ff] bf16.
void silu_mul(const bf16* gate_up, bf16* out, int64_t n_tokens, int64_t n_ff, cudaStream_t stream);

// Causal paged attention over a flat batch of prefill chunks and decode tokens (FlashAttention-
// style: tiled over keys with online softmax, no n x n matrix; GQA: n_head / n_head_kv query heads
// share a KV head). Token t of sequence s at position p attends keys [0, p] of s's cache.
// q [n_tokens, n_head, head_dim] bf16; out [n_tokens, n_head, head_dim] bf16.
// token_seq [n_tokens] (sequence index of each token), positions [n_tokens].
// workspace: scratch for split-KV decode, at least attention_workspace_bytes(...) bytes.
struct AttentionParams {
  const bf16* q;
  const bf16* k_cache;
  const bf16* v_cache;
  const int32_t* block_tables;
  const int32_t* context_lens;
  const int32_t* query_start;
  const int32_t* token_seq;
  const int32_t* positions;
  bf16* out;
  int64_t n_tokens;
  int64_t n_seqs;
  int32_t max_blocks_per_seq;
  int32_t max_context;  // max over context_lens (host-known), sizes the split-KV grid
  int32_t n_head;
  int32_t n_head_kv;
  int32_t head_dim;     // 64 and 128 at least
  int32_t block_size;
  float scale;          // 1 / sqrt(head_dim)
  void* workspace;
  size_t workspace_bytes;
};
size_t attention_workspace_bytes(int64_t n_tokens, int32_t n_head, int32_t head_dim, int32_t max_context);
void paged_attention(const AttentionParams& p, cudaStream_t stream);

// Copies K and V of whole blocks (copy-on-write): for each i, block dst[i] = block src[i], in
// every layer. caches: n_layer pointers each to K then V... (see the runner); block_bytes per block.
void copy_blocks(void* const* layer_caches, int32_t n_caches, const int32_t* src, const int32_t* dst,
                 int32_t n_copies, int64_t block_bytes, cudaStream_t stream);

}  // namespace kestrel::cuda
