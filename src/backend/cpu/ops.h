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

struct AttentionArgs {
  const float* q;              // [group, head_dim]: the query heads that share one KV head
  // The layer's K and V storage, [n_blocks, n_head_kv, block_size, head_dim] of kv_dtype
  // (KvCache's layout).
  const void* k_cache;
  const void* v_cache;
  KvDtype kv_dtype;            // f32, f16 or int8
  // INT8: the layer's row scales, [n_blocks, n_head_kv, block_size] f32 (KvCache::k_scale): the
  // row at element offset o of k_cache holds codes whose values are code x k_scale[o / head_dim].
  // Scores are dot(q, codes) x scale and the output sums p x v_scale x codes, in f32. MLA: k_scale
  // is the latent's scale (elements [0, v_dim) of the key row), k_rope_scale the RoPE key's
  // (elements [v_dim, head_dim)), v_scale == k_scale. Unused for the float types.
  const float* k_scale;
  const float* v_scale;
  const float* k_rope_scale;   // nullptr: one scale for the whole key row
  int64_t block_stride;        // elements per block: n_head_kv * block_size * head_dim
  int64_t head_offset;         // kv_head * block_size * head_dim
  const int32_t* block_table;  // [>= ceil(n_ctx / block_size)] block ids of the sequence
  int32_t block_size;
  int64_t n_ctx;               // keys at positions [kv_begin, n_ctx) are attended (causal bound applied)
  int64_t kv_begin;            // first key position attended: 0, or past a sliding window's start
  int64_t head_dim;
  // Values are the first v_dim elements of each row of v_cache (row stride head_dim); 0 = head_dim.
  // MLA attends over its latent rows: v_cache == k_cache, v_dim = kv_lora_rank.
  int64_t v_dim;
  int64_t group;               // query heads per KV head (1 = MHA, n_head = MQA)
  float scale;                 // softmax scale, 1/sqrt(head_dim)
  float* out;                  // [group, v_dim]
};

struct OpsTable {
  // y[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w, for n_rows rows of dim floats (RMSNorm,
  // Zhang & Sennrich 2019).
  void (*rms_norm)(const float* x, const float* w, float* y, int64_t n_rows, int64_t dim, float eps);
  // out[i] = silu(gate[i]) * up[i] (SwiGLU, Shazeer 2020).
  void (*silu_mul)(const float* gate, const float* up, float* out, int64_t n);
  // x[i] += y[i]
  void (*add)(float* x, const float* y, int64_t n);
  // Exact causal attention of `group` query heads over one KV head through the block table,
  // tiled by KV block with online softmax (Milakov & Gimelshein 2018; FlashAttention, Dao 2022):
  // O(head_dim) extra memory, no n x n score matrix.
  void (*attention)(const AttentionArgs& a);
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

// RoPE on n_tokens rows of n_heads heads ([n_tokens, n_heads * head_dim]), rotating the first
// rope_dim dimensions of each head. inv_freq[i] = theta^(-2i/rope_dim) / freq_factor[i], precomputed
// by the caller. adjacent_pairs: rotate (x[2i], x[2i+1]) (GGUF llama layout); otherwise rotate
// (x[i], x[i + rope_dim/2]) (rotate-half, HF / NeoX layout). Angles are computed in double so
// long positions do not lose precision. Source: Su et al. 2021, RoFormer.
void rope(float* x, const int32_t* positions, int64_t n_tokens, int64_t n_heads, int64_t head_dim,
          int64_t rope_dim, const float* inv_freq, float position_scale, bool adjacent_pairs);

}  // namespace kestrel::cpu
