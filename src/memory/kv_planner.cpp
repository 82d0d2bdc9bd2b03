#include "memory/kv_planner.h"

#include <cctype>
#include <cmath>
#include <string>

#include "core/checked_int.h"
#include "core/error.h"

namespace kestrel {

void KvGeometry::validate() const {
  auto positive = [](int64_t v, const char* name) {
    if (v <= 0)
      throw Error(std::string("KV geometry: ") + name + " must be positive, got " + std::to_string(v));
  };
  positive(n_layer, "n_layer");
  if (is_mla()) {
    positive(rope_dim, "rope_dim");
  } else {
    if (kv_lora_rank < 0)
      throw Error("KV geometry: kv_lora_rank must not be negative, got " + std::to_string(kv_lora_rank));
    positive(n_head_kv, "n_head_kv");
    positive(head_dim, "head_dim");
  }
}

int64_t kv_bytes_per_token(const KvGeometry& g, KvDtype dtype) {
  g.validate();
  const std::string what = "KV bytes per token";
  const int64_t elem = kv_dtype_bytes(dtype);
  const int64_t scale = kv_scale_bytes(dtype);
  if (g.is_mla()) {
    const int64_t width = checked_add(g.kv_lora_rank, g.rope_dim, what);
    const int64_t row = checked_add(checked_mul(width, elem, what), 2 * scale, what);
    return checked_mul(g.n_layer, row, what);
  }
  const int64_t row = checked_add(checked_mul(g.head_dim, elem, what), scale, what);
  const int64_t per_layer = checked_mul(g.n_head_kv, row, what);
  return checked_mul(checked_mul(2, g.n_layer, what), per_layer, what);
}

KvPlan plan_kv(const KvPlanRequest& r) {
  if (r.context <= 0) throw Error("context must be positive, got " + std::to_string(r.context));
  if (r.weight_bytes < 0)
    throw Error("weight bytes must not be negative, got " + std::to_string(r.weight_bytes));
  if (r.memory_bytes <= 0) throw Error("memory must be positive, got " + std::to_string(r.memory_bytes));
  if (!std::isfinite(r.bandwidth_bytes_per_s) || !(r.bandwidth_bytes_per_s > 0))
    throw Error("bandwidth must be positive and finite, got " + std::to_string(r.bandwidth_bytes_per_s));
  KvPlan p;
  p.kv_bytes_per_token = kv_bytes_per_token(r.geometry, r.kv_dtype);
  p.kv_bytes_per_seq = checked_mul(r.context, p.kv_bytes_per_token, "KV bytes per sequence");
  p.weights_fit = r.weight_bytes <= r.memory_bytes;
  if (p.weights_fit) {
    p.kv_budget_bytes = r.memory_bytes - r.weight_bytes;
    p.max_tokens = p.kv_budget_bytes / p.kv_bytes_per_token;
    p.max_seqs = p.kv_budget_bytes / p.kv_bytes_per_seq;
  } else {
    p.weight_shortfall_bytes = r.weight_bytes - r.memory_bytes;
  }
  // In double: the sum may pass int64 only for absurd inputs, and the ratio is a rate anyway.
  const double bytes_per_token =
      static_cast<double>(r.weight_bytes) + static_cast<double>(p.kv_bytes_per_seq);
  p.decode_tok_per_s_ceiling = r.bandwidth_bytes_per_s / bytes_per_token;
  return p;
}

}  // namespace kestrel
