// Element-wise and attention kernels of the CPU forward pass (everything but the matmuls).
//
// Each op is written once (ops_impl.h) with GCC vector extensions and compiled three times, for
// AVX-512, AVX2 and baseline x86-64 (ops_avx512.cpp, ops_avx2.cpp, ops_generic.cpp); ops() picks
// the table that matches simd_level() at run time. For a given table the result of an op on one
// row never depends on what else is in the batch.
#pragma once

#include <cstdint>

#include "memory/kv_dtype.h"

namespace kestrel::cpu {

// Attention of the query rows of one sequence's tokens for one KV head: n_tokens tokens x `group`
// query heads (the heads that share the KV head), rows ordered token-major.
struct AttentionArgs {
  const float* q;              // row (token i, head g) at q + i * q_stride + g * head_dim
  int64_t q_stride;            // elements from one token's query heads to the next (unused for one token)
  int64_t n_tokens = 1;        // query tokens of the sequence in this call
  // Per token: keys at positions [kv_begin[i], n_ctx[i]) are attended (n_ctx = position + 1 for
  // causal attention; kv_begin past a sliding window's start, else 0).
  const int64_t* n_ctx;
  const int64_t* kv_begin;
  // The layer's K and V storage, [n_blocks, n_head_kv, block_size, head_dim] of kv_dtype
  // (KvCache's layout).
  const void* k_cache;
  const void* v_cache;
  KvDtype kv_dtype;            // f32, f16 or int8
  // INT8: the layer's row scales, [n_blocks, n_head_kv, block_size] f32 (KvCache::k_scale): the
  // row at element offset o of k_cache holds codes whose values are code x k_scale[o / head_dim].
  // Scores are dot(q, codes) x scale and the output sums p x v_scale x codes, in f32. MLA: k_scale
  // is the latent's scale (elements [0, v_dim) of the key row), k_rope_scale the RoPE key's
  // (elements [v_dim, head_dim)), v_scale == k_scale. With one scale per key row (not MLA) the
  // query rows are rounded to 16 bits first (quantize_query_q16). Unused for the float types.
  const float* k_scale;
  const float* v_scale;
  const float* k_rope_scale;   // nullptr: one scale for the whole key row
  int64_t block_stride;        // elements per block: n_head_kv * block_size * head_dim
  int64_t head_offset;         // kv_head * block_size * head_dim
  const int32_t* block_table;  // [>= ceil(max n_ctx / block_size)] block ids of the sequence
  int32_t block_size;
  int64_t head_dim;
  // Values are the first v_dim elements of each row of v_cache (row stride head_dim); 0 = head_dim.
  // MLA attends over its latent rows: v_cache == k_cache, v_dim = kv_lora_rank.
  int64_t v_dim;
  int64_t group;               // query heads per KV head (1 = MHA, n_head = MQA)
  float scale;                 // softmax scale, 1/sqrt(head_dim)
  float* out;                  // row (token i, head g) at out + i * out_stride + g * v_dim
  int64_t out_stride;          // elements from one token's output heads to the next (unused for one token)
};

// Keys are visited in tiles cut at fixed positions (block boundaries, every 16 keys from a block's
// start, multiples of kAttentionChunk; a tile's lane j holds the key j places after its cut), and
// in chunks of kAttentionChunk positions (from multiples of it), each with its own online-softmax
// state (max, sum, unnormalized output) merged into the row's state in key order. The tiles, lanes
// and chunks a row visits depend only on its own key range, so its bits do not depend on which rows
// share the call, and a chunk's state is the same whether it is computed in the loop of attention()
// or apart by attention_chunks() on another thread (split-KV, FlashDecoding, Dao et al. 2023) and
// then merged by attention_merge().
constexpr int64_t kAttentionChunk = 128;

// The union of the call's rows' key ranges, [begin, end) (begin == end when empty).
inline void attention_key_range(const AttentionArgs& a, int64_t& begin, int64_t& end) {
  begin = INT64_MAX, end = 0;
  for (int64_t i = 0; i < a.n_tokens; ++i)
    if (a.kv_begin[i] < a.n_ctx[i]) begin = begin < a.kv_begin[i] ? begin : a.kv_begin[i], end = end > a.n_ctx[i] ? end : a.n_ctx[i];
  if (begin >= end) begin = end = 0;
}
// Chunks of that range: chunk c covers positions [(begin / C + c) x C, + C) of it, C = kAttentionChunk.
inline int64_t attention_chunk_count(const AttentionArgs& a) {
  int64_t begin, end;
  attention_key_range(a, begin, end);
  return begin == end ? 0 : (end - 1) / kAttentionChunk - begin / kAttentionChunk + 1;
}
// Floats of one chunk's state for the call's rows: rows x (2 + v_dim), each row [max, sum, output].
inline int64_t attention_state_floats(const AttentionArgs& a) {
  return a.n_tokens * a.group * (2 + (a.v_dim > 0 ? a.v_dim : a.head_dim));
}

struct OpsTable {
  // y[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w, for n_rows rows of dim floats (RMSNorm,
  // Zhang & Sennrich 2019).
  void (*rms_norm)(const float* x, const float* w, float* y, int64_t n_rows, int64_t dim, float eps);
  // out[i] = silu(gate[i]) * up[i] (SwiGLU, Shazeer 2020).
  void (*silu_mul)(const float* gate, const float* up, float* out, int64_t n);
  // x[i] += y[i]
  void (*add)(float* x, const float* y, int64_t n);
  // Exact attention of the call's query rows over one KV head through the block table, with online
  // softmax in f32 (Milakov & Gimelshein 2018; FlashAttention-2, Dao 2023): each key tile is
  // converted once (keys transposed, so a vector holds one dimension of 16 keys) and used by every
  // row, no n x n score matrix (INT8 on AVX-512 VNNI: integer scores, each 128-key chunk's softmax
  // in two passes; attention_int8_impl.h). Writes the normalized output rows (zeros for a row
  // without keys).
  void (*attention)(const AttentionArgs& a);
  // Split-KV: the states of chunks [chunk_begin, chunk_end) of attention_chunk_count(a), one after
  // the other, attention_state_floats(a) floats each; a row without keys in a chunk has max -inf.
  void (*attention_chunks)(const AttentionArgs& a, int64_t chunk_begin, int64_t chunk_end, float* states);
  // Merges the states of all n_chunks chunks in order and writes the output rows as attention() does.
  void (*attention_merge)(const AttentionArgs& a, int64_t n_chunks, const float* states);
  // y[i] = x[i] rounded to IEEE half precision, nearest even (bit-identical on every ISA).
  void (*f32_to_f16)(const float* x, uint16_t* y, int64_t n);
  // out[i] = gelu(gate[i]) * up[i] with GELU's tanh approximation,
  // 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))) (GeGLU, Shazeer 2020; Hendrycks & Gimpel 2016).
  void (*gelu_mul)(const float* gate, const float* up, float* out, int64_t n);
};

const OpsTable& ops();
const OpsTable& ops_generic();
const OpsTable& ops_avx2();
const OpsTable& ops_avx512();

// One INT8 KV row (KvCache's INT8 storage): scale = amax(|x|) / 127 and codes[i] =
// round-to-nearest-even(x[i] / scale), clamped to [-127, 127], so |x[i] - codes[i] x scale| <=
// scale / 2. Returns the scale: 0 for an all-zero row (codes 0, read back as exact zeros; no
// division by zero), NaN when x holds an inf or NaN (codes 0), so attention over the row yields NaN
// as an f32 cache carrying the value would, instead of a silently finite result.
float quantize_row_int8(const float* x, int8_t* codes, int64_t n);

// The query rounding of attention over an INT8 KV cache (each query row on its own): dq = max|q| /
// 32385 and Q[i] = round-to-nearest-even(q[i] x f32(32385 / max|q|)) (f32 products), so |Q| <=
// 32385 and |Q x dq - q[i]| <= dq / 2 (x 1.01): the 16 bits of the matmuls' activations (matmul.h),
// ~250x finer than the int8 codes' own rounding, which lets AVX-512 VNNI take the dot products with
// the codes in integers. Q is returned as two int8 planes Q = 255 q1 + q2 (q1 = round(Q / 255),
// |q1|, |q2| <= 127). Returns dq: 0 for a row of zeros or of values too small to scale (planes 0),
// NaN when q holds an inf or NaN (planes 0), so the row's attention output is NaN as it would be
// without the rounding. Every ISA's kernels round the query exactly so.
float quantize_query_q16(const float* q, int64_t n, int8_t* q1, int8_t* q2);

// RoPE on n_tokens rows of n_heads heads ([n_tokens, n_heads * head_dim]), rotating the first
// rope_dim dimensions of each head. inv_freq[i] = theta^(-2i/rope_dim) / freq_factor[i], precomputed
// by the caller. adjacent_pairs: rotate (x[2i], x[2i+1]) (GGUF llama layout); otherwise rotate
// (x[i], x[i + rope_dim/2]) (rotate-half, HF / NeoX layout). Angles are computed in double so
// long positions do not lose precision. Source: Su et al. 2021, RoFormer.
void rope(float* x, const int32_t* positions, int64_t n_tokens, int64_t n_heads, int64_t head_dim,
          int64_t rope_dim, const float* inv_freq, float position_scale, bool adjacent_pairs);

}  // namespace kestrel::cpu
