#include "memory/kv_cache.h"

#include <cstring>
#include <new>

#include "core/error.h"

namespace kestrel {

KvCache::KvCache(int64_t n_layer, int64_t n_head_kv, int64_t head_dim, int32_t block_size, int32_t n_blocks,
                 KvDtype dtype, bool populate)
    : n_layer_(n_layer),
      n_head_kv_(n_head_kv),
      head_dim_(head_dim),
      block_size_(block_size),
      n_blocks_(n_blocks),
      dtype_(dtype) {
  if (block_size <= 0) throw Error("block size must be positive, got " + std::to_string(block_size));
  if (n_blocks <= 0) throw Error("number of KV blocks must be positive, got " + std::to_string(n_blocks));
  if (dtype != KvDtype::F32 && dtype != KvDtype::F16)
    throw Error("KV cache dtype " + std::string(kv_dtype_name(dtype)) + " is not supported by the CPU backend (use f16 or f32)");
  const size_t n = static_cast<size_t>(n_slots()) * static_cast<size_t>(kv_dim()) *
                   static_cast<size_t>(kv_dtype_bytes(dtype));
  k_.resize(static_cast<size_t>(n_layer));
  v_.resize(static_cast<size_t>(n_layer));
  try {
    for (int64_t l = 0; l < n_layer; ++l) {
      k_[static_cast<size_t>(l)].reset(new std::byte[n]);
      v_[static_cast<size_t>(l)].reset(new std::byte[n]);
    }
  } catch (const std::bad_alloc&) {
    throw Error("KV cache of " + std::to_string(n_blocks) + " blocks (" +
                std::to_string(2 * n * static_cast<size_t>(n_layer) >> 20) + " MiB) does not fit in memory");
  }
  if (populate)
    for (int64_t l = 0; l < n_layer; ++l) {
      std::memset(k_[static_cast<size_t>(l)].get(), 0, n);
      std::memset(v_[static_cast<size_t>(l)].get(), 0, n);
    }
}

void KvCache::copy_block(int32_t src, int32_t dst) {
  KESTREL_ASSERT(src >= 0 && src < n_blocks_ && dst >= 0 && dst < n_blocks_, "KV copy outside the cache");
  const size_t n = static_cast<size_t>(block_size_) * static_cast<size_t>(kv_dim()) *
                   static_cast<size_t>(kv_dtype_bytes(dtype_));
  for (size_t l = 0; l < k_.size(); ++l) {
    std::memcpy(k_[l].get() + static_cast<size_t>(dst) * n, k_[l].get() + static_cast<size_t>(src) * n, n);
    std::memcpy(v_[l].get() + static_cast<size_t>(dst) * n, v_[l].get() + static_cast<size_t>(src) * n, n);
  }
}

}  // namespace kestrel
