// KV planner: how many tokens of KV cache fit beside the weights, and the bandwidth bound on
// batch-1 decode. Pure arithmetic over numbers read elsewhere (ModelFootprint, the plan command).
#pragma once

#include <cstdint>
#include <string_view>

#include "memory/kv_dtype.h"

namespace kestrel {

// What one token leaves in the KV cache, per layer.
struct KvGeometry {
  int64_t n_layer = 0;
  // Standard attention (MHA / GQA / MQA): K and V, each [n_head_kv, head_dim] per layer.
  int64_t n_head_kv = 0;
  int64_t head_dim = 0;
  // Multi-head latent attention (DeepSeek-V2, arXiv:2405.04434 sec. 2.1) when kv_lora_rank > 0:
  // the cache holds the compressed latent c_KV [kv_lora_rank] and the decoupled RoPE key k_R
  // [rope_dim] per layer, shared by all heads and by K and V; n_head_kv and head_dim are unused.
  int64_t kv_lora_rank = 0;
  int64_t rope_dim = 0;

  bool is_mla() const { return kv_lora_rank > 0; }
  // Throws kestrel::Error naming the first field that is not positive.
  void validate() const;
};

// Bytes of KV cache per token over all layers:
//   standard: 2 x n_layer x n_head_kv x (head_dim x bytes(dtype) + scale)     (K and V)
//   MLA:      n_layer x ((kv_lora_rank + rope_dim) x bytes(dtype) + 2 scale)  (one latent, no factor 2)
// where scale = kv_scale_bytes(dtype) (4 for fp8 / int8 rows, 0 for float types).
// LLaMA-2-70B (80, 8, 128) in f16: 327,680; in fp8: 163,840 + 5,120 of scales.
// Throws kestrel::Error on invalid geometry or overflow.
int64_t kv_bytes_per_token(const KvGeometry& g, KvDtype dtype);

struct KvPlanRequest {
  KvGeometry geometry;
  KvDtype kv_dtype = KvDtype::F16;
  int64_t context = 0;               // tokens per sequence, > 0
  int64_t weight_bytes = 0;          // >= 0
  int64_t memory_bytes = 0;          // device memory for weights + KV, > 0
  double bandwidth_bytes_per_s = 0;  // memory bandwidth, > 0
};

struct KvPlan {
  int64_t kv_bytes_per_token = 0;
  int64_t kv_bytes_per_seq = 0;        // context x kv_bytes_per_token
  bool weights_fit = false;            // weight_bytes <= memory_bytes
  int64_t kv_budget_bytes = 0;         // memory_bytes - weight_bytes; 0 when the weights do not fit
  int64_t weight_shortfall_bytes = 0;  // weight_bytes - memory_bytes when they do not fit, else 0
  int64_t max_tokens = 0;              // whole tokens of KV in the budget
  int64_t max_seqs = 0;                // whole sequences of `context` tokens in the budget
  // Batch-1 decode upper bound, tokens/s: every weight byte and the whole KV of one sequence at
  // the context are read once per token, so bandwidth / (weight_bytes + kv_bytes_per_seq).
  // Ignores compute, activations, and caches; real decode is slower.
  double decode_tok_per_s_ceiling = 0;
};

// Throws kestrel::Error naming the field when a request value is out of range, or on overflow.
KvPlan plan_kv(const KvPlanRequest& r);

}  // namespace kestrel
