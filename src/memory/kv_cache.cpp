#include "memory/kv_cache.h"

#include <cstring>

#include "core/error.h"

namespace kestrel {

KvCache::KvCache(int64_t n_layer, int64_t n_head_kv, int64_t head_dim, int32_t block_size,
                 int32_t n_blocks)
    : n_layer_(n_layer), kv_dim_(n_head_kv * head_dim), block_size_(block_size), n_blocks_(n_blocks) {
  if (block_size <= 0) throw Error("block size must be positive, got " + std::to_string(block_size));
  if (n_blocks <= 0) throw Error("number of KV blocks must be positive, got " + std::to_string(n_blocks));
  const size_t n = static_cast<size_t>(n_slots()) * static_cast<size_t>(kv_dim_);
  k_.resize(static_cast<size_t>(n_layer));
  v_.resize(static_cast<size_t>(n_layer));
  for (int64_t l = 0; l < n_layer; ++l) {
    k_[static_cast<size_t>(l)].reset(new float[n]);
    v_[static_cast<size_t>(l)].reset(new float[n]);
  }
}

void KvCache::copy_block(int32_t src, int32_t dst) {
  KESTREL_ASSERT(src >= 0 && src < n_blocks_ && dst >= 0 && dst < n_blocks_, "KV copy outside the cache");
  const size_t n = static_cast<size_t>(block_size_) * static_cast<size_t>(kv_dim_);
  for (size_t l = 0; l < k_.size(); ++l) {
    std::memcpy(k_[l].get() + static_cast<size_t>(dst) * n, k_[l].get() + static_cast<size_t>(src) * n, n * sizeof(float));
    std::memcpy(v_[l].get() + static_cast<size_t>(dst) * n, v_[l].get() + static_cast<size_t>(src) * n, n * sizeof(float));
  }
}

}  // namespace kestrel
