// Host-side launchers of the multi-head latent attention kernels (DeepSeek-V2, arXiv:2405.04434
// sec. 2.1), run absorbed: W_UK folded into each head's query, W_UV applied to each head's latent
// output, so that every head attends over the one cached latent row per token (MQA with the key
// [c_KV | k_R] and the value c_KV). Each launcher is tested against a float64 reference in
// tests/backend/test_cuda_mla.cpp. Conventions as in cuda_ops.h: device pointers, enqueued on
// `stream`, never synchronising, bf16 storage with f32 arithmetic.
//
// Names: r = kv_lora_rank, R = qk_rope (rope_dim), H = n_head, nope = qk_nope, v = v_head_dim.
// The latent cache of one layer is [n_blocks, block_size, r + R] bf16 (the KvCache layout with one
// KV head of width r + R): per token the RMS-normalised latent c_KV, then the rotated RoPE key k_R.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace kestrel::cuda {

using bf16 = __nv_bfloat16;

// The cache row of each token, and the normalised low-rank query when the model has one:
// c = RMSNorm(kv[t, 0:r]) * kv_norm, k_R = RoPE(kv[t, r:r+R]) at positions[t], written as one row
// [c | k_R] at the token's slot (slot_mapping; negative: nothing written). With qa != null also
// qa_out[t, :] = RMSNorm(qa[t, 0:q_lora_rank]) * qa_norm. RMSNorm: x / sqrt(mean(x^2) + eps)
// (Zhang & Sennrich 2019) in f32. RoPE: angles (position / position_scale) * inv_freq[i] in
// double, rounded once to f32 (rope_cos_sin, as rope_write_kv); rotate_half pairs x[i] with
// x[i + R/2], else x[2i] with x[2i+1] (DeepSeek). Errors: kestrel::Error when R is odd or not
// positive, r not positive, or block_size not positive.
struct MlaKvWriteArgs {
  const bf16* kv = nullptr;       // [n_tokens, *] rows kv_stride elements apart (the KvA projection)
  int64_t kv_stride = 0;
  const bf16* kv_norm = nullptr;  // [r]
  const bf16* qa = nullptr;       // [n_tokens, *] rows qa_stride apart (the QA projection), or null
  int64_t qa_stride = 0;
  const bf16* qa_norm = nullptr;  // [q_lora_rank]
  bf16* qa_out = nullptr;         // [n_tokens, q_lora_rank]
  int32_t q_lora_rank = 0;
  const int32_t* positions = nullptr;     // [n_tokens]
  const int64_t* slot_mapping = nullptr;  // [n_tokens]
  const float* inv_freq = nullptr;        // [R / 2]
  float position_scale = 1.0f;
  bool rotate_half = false;
  int64_t n_tokens = 0;
  int32_t kv_lora_rank = 0;
  int32_t rope_dim = 0;
  float eps = 1e-6f;
  bf16* cache = nullptr;  // one layer, [n_blocks, block_size, r + R]
  int32_t block_size = 0;
};
void mla_kv_write(const MlaKvWriteArgs& a, cudaStream_t stream);

// The absorbed form's per-head weights from kv_b_proj kv_b [H (nope + v), r] bf16 (per head nope
// rows of W_UK, then v rows of W_UV): uk_t [H, r, nope] (each head's W_UK transposed, the
// [n_out, n_in] matrices of the query's absorption) and uv [H, v, r] (W_UV). Exact copies.
// Errors: kestrel::Error for a non-positive size.
void mla_split_kv_b(const bf16* kv_b, int64_t n_head, int64_t nope, int64_t v, int64_t r, bf16* uk_t, bf16* uv,
                    cudaStream_t stream);

// One small GEMM per head (a batched, block-diagonal projection): for every head h and token t,
// y_h[t, o] = sum_i x_h[t, i] * w[h, o, i], with x_h[t, :] at x + t x_stride + h x_head_stride and
// y_h[t, :] at y + t y_stride + h y_head_stride. bf16 operands on the tensor cores (mma.sync), f32
// accumulation, one bf16 rounding of y. MLA uses it twice: the absorbed query q_lat_h = W_UK_h^T
// q_nope_h (w = W_UK^T [H, r, nope]) and the output out_h = W_UV_h o_lat_h (w = W_UV [H, v, r]).
// With rope_dim > 0 it also writes the query's RoPE part beside the absorbed one:
// y_h[t, n_out + j] = RoPE(x_h[t, n_in .. n_in + rope_dim))[j] at positions[t] (as mla_kv_write).
// Requirements: n_in and n_out multiples of 8, strides and head strides multiples of 8, x, w and y
// 16-byte aligned. Errors: kestrel::Error otherwise, or for a grid beyond the launch limits.
struct MlaHeadGemmArgs {
  const bf16* x = nullptr;
  int64_t x_stride = 0, x_head_stride = 0;
  const bf16* w = nullptr;  // [n_head, n_out, n_in]
  bf16* y = nullptr;
  int64_t y_stride = 0, y_head_stride = 0;
  int64_t n_tokens = 0;
  int32_t n_head = 0, n_in = 0, n_out = 0;
  int32_t rope_dim = 0;  // 0: no RoPE part
  const int32_t* positions = nullptr;
  const float* inv_freq = nullptr;
  float position_scale = 1.0f;
  bool rotate_half = false;
};
void mla_head_gemm(const MlaHeadGemmArgs& a, cudaStream_t stream);

// Causal paged attention of every head over the latent cache (all heads share one KV row per
// token): token t of sequence s at position p attends keys [0, p] of s's cache; head h's scores
// are q[t, h, :] . row_j (width r + R) times `scale`, its output the softmax-weighted sum of the
// rows' first r elements (the latent): out [n_tokens, H, r] bf16. FlashAttention-style (tiled
// over keys with online softmax in f32, weights rounded to bf16 for the tensor cores).
// Decode sequences (one query token) run one block per (sequence, 16-head chunk, split), the
// heads along the tile's rows so each latent row is read once per sequence and head chunk
// (FlashMLA's arrangement); long contexts split over several blocks (split-KV) whose partial
// results a second kernel combines. Sequences with 2+ query tokens (prefill chunks) run blocks of
// 16 (token, head) rows from a tile list built on the device. The grid comes from n_tokens,
// n_seqs and max_context only (CUDA-graph capturable; a smaller max_context stays correct: the
// last split takes the rest of the context).
// Supported (r, R): mla_attention_supports. Errors: kestrel::Error for unsupported dims, a
// non-positive block size, a workspace that is too small or misaligned, or a grid beyond limits.
struct MlaAttentionParams {
  const bf16* q = nullptr;        // [n_tokens, H, r + R]: per head [W_UK_h^T q_nope | RoPE(q_rope)]
  const bf16* cache = nullptr;    // one layer, [n_blocks, block_size, r + R]
  const int32_t* block_tables = nullptr;  // [n_seqs, max_blocks_per_seq]
  const int32_t* query_start = nullptr;   // [n_seqs + 1]
  const int32_t* positions = nullptr;     // [n_tokens]
  bf16* out = nullptr;            // [n_tokens, H, r]
  int64_t n_tokens = 0;
  int64_t n_seqs = 0;
  int32_t max_blocks_per_seq = 0;
  int32_t max_context = 0;   // max over the sequences' context lengths (host-known; sizes the split grid)
  int32_t max_query_len = 0; // max tokens of one sequence in this call; 0 = unknown (1 skips prefill launches)
  int32_t n_head = 0;
  int32_t kv_lora_rank = 0;
  int32_t rope_dim = 0;
  int32_t block_size = 0;
  float scale = 0.0f;        // softmax scale (ModelHparams::softmax_scale)
  void* workspace = nullptr; // 16-byte aligned, mla_attention_workspace_bytes(*this) bytes at least
  size_t workspace_bytes = 0;
  int32_t n_splits = 0;      // decode split count; 0 = chosen from the batch (tests force one)
};
// The (kv_lora_rank, rope_dim) pairs with a kernel: (512, 64) (DeepSeek-V2, V2-Lite, V3) and
// (32, 8) (the hf-tiny test models).
bool mla_attention_supports(int32_t kv_lora_rank, int32_t rope_dim);
// Workspace bytes for these parameters (workspace fields ignored): the prefill tile list and the
// split-KV partial results. Errors: as mla_attention's for the dims.
size_t mla_attention_workspace_bytes(const MlaAttentionParams& p);
// The most workspace any call with at most n_tokens tokens (and so at most n_tokens sequences), any
// max_context and a chosen split count can need, for a buffer sized once per batch size.
size_t mla_attention_workspace_bound(int64_t n_tokens, int32_t n_head, int32_t kv_lora_rank, int32_t rope_dim);
void mla_attention(const MlaAttentionParams& p, cudaStream_t stream);

}  // namespace kestrel::cuda
