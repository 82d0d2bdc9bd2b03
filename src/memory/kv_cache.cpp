#include "memory/kv_cache.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <new>

#include "core/error.h"

namespace kestrel {

namespace {

constexpr size_t kHugePage = size_t{2} << 20;

// A pool of at least a huge page is allocated on 2 MiB boundaries and marked for transparent huge
// pages (advice: ignored where THP is off): decode attention reads every block of a sequence once
// a step from anywhere in the pool, and on 4 KiB pages each block's keys, values and scales cost a
// TLB miss of their own. Smaller pools: 64-byte aligned. Throws std::bad_alloc.
std::byte* allocate_storage(size_t bytes) {
  const size_t align = bytes >= kHugePage ? kHugePage : 64;
  const size_t size = (std::max<size_t>(bytes, 1) + align - 1) / align * align;
  void* p = std::aligned_alloc(align, size);
  if (p == nullptr) throw std::bad_alloc();
#if defined(MADV_HUGEPAGE)
  if (align == kHugePage) madvise(p, size, MADV_HUGEPAGE);
#endif
  return static_cast<std::byte*>(p);
}

size_t align64(size_t n) { return (n + 63) / 64 * 64; }

KvGeometry standard(int64_t n_layer, int64_t n_head_kv, int64_t head_dim) {
  KvGeometry g;
  g.n_layer = n_layer;
  g.n_head_kv = n_head_kv;
  g.head_dim = head_dim;
  return g;
}
}  // namespace

KvCache::KvCache(int64_t n_layer, int64_t n_head_kv, int64_t head_dim, int32_t block_size, int32_t n_blocks,
                 KvDtype dtype, bool populate)
    : KvCache(standard(n_layer, n_head_kv, head_dim), block_size, n_blocks, dtype, populate) {}

KvCache::KvCache(const KvGeometry& g, int32_t block_size, int32_t n_blocks, KvDtype dtype, bool populate)
    : n_layer_(g.n_layer),
      n_head_kv_(g.is_mla() ? 1 : g.n_head_kv),
      head_dim_(g.is_mla() ? g.kv_lora_rank + g.rope_dim : g.head_dim),
      block_size_(block_size),
      n_blocks_(n_blocks),
      dtype_(dtype) {
  g.validate();
  const int64_t n_layer = g.n_layer;
  const bool with_v = !g.is_mla();
  if (block_size <= 0) throw Error("block size must be positive, got " + std::to_string(block_size));
  if (n_blocks <= 0) throw Error("number of KV blocks must be positive, got " + std::to_string(n_blocks));
  if (dtype != KvDtype::F32 && dtype != KvDtype::F16 && dtype != KvDtype::INT8)
    throw Error("KV cache dtype " + std::string(kv_dtype_name(dtype)) +
                " is not supported by the CPU backend (use f16, f32 or int8)");
  const size_t n = static_cast<size_t>(n_slots()) * static_cast<size_t>(kv_dim()) *
                   static_cast<size_t>(kv_dtype_bytes(dtype));
  const bool scaled = dtype == KvDtype::INT8;
  const size_t n_scales = static_cast<size_t>(n_slots()) * static_cast<size_t>(n_head_kv_);
  // Layer by layer: K, V, then the scales, each 64-byte aligned.
  const size_t code_bytes = align64(n), scale_bytes = align64(n_scales * sizeof(float));
  const size_t per_layer = (with_v ? 2 : 1) * code_bytes + (scaled ? 2 * scale_bytes : 0);
  try {
    storage_.reset(allocate_storage(static_cast<size_t>(n_layer) * per_layer));
  } catch (const std::bad_alloc&) {
    throw Error("KV cache of " + std::to_string(n_blocks) + " blocks (" +
                std::to_string(static_cast<size_t>(n_slots()) * static_cast<size_t>(bytes_per_token()) >> 20) +
                " MiB) does not fit in memory");
  }
  for (int64_t l = 0; l < n_layer; ++l) {
    std::byte* at = storage_.get() + static_cast<size_t>(l) * per_layer;
    k_.push_back(at);
    at += code_bytes;
    if (with_v) v_.push_back(at), at += code_bytes;
    if (scaled) {
      k_scale_.push_back(reinterpret_cast<float*>(at));
      (with_v ? v_scale_ : rope_scale_).push_back(reinterpret_cast<float*>(at + scale_bytes));
    }
  }
  if (populate) std::memset(storage_.get(), 0, static_cast<size_t>(n_layer) * per_layer);
}

void KvCache::FreeStorage::operator()(std::byte* p) const { std::free(p); }

int64_t KvCache::bytes_per_token() const {
  // Per layer: one row per KV head of K (and V), each with its scale; MLA adds the RoPE key's scale.
  const int64_t row = head_dim_ * kv_dtype_bytes(dtype_) + kv_scale_bytes(dtype_);
  const int64_t per_layer = (has_v() ? 2 : 1) * n_head_kv_ * row + (has_v() ? 0 : kv_scale_bytes(dtype_));
  return n_layer_ * per_layer;
}

void KvCache::copy_block(const KvCache& from, int32_t src, KvCache& to, int32_t dst) {
  KESTREL_ASSERT(from.n_layer_ == to.n_layer_ && from.n_head_kv_ == to.n_head_kv_ && from.head_dim_ == to.head_dim_ &&
                     from.block_size_ == to.block_size_ && from.dtype_ == to.dtype_ && from.has_v() == to.has_v() &&
                     from.rope_scale_.size() == to.rope_scale_.size(),
                 "KV copy between caches of different geometry");
  KESTREL_ASSERT(src >= 0 && src < from.n_blocks_ && dst >= 0 && dst < to.n_blocks_, "KV copy outside the cache");
  const size_t n = static_cast<size_t>(from.block_size_) * static_cast<size_t>(from.kv_dim()) *
                   static_cast<size_t>(kv_dtype_bytes(from.dtype_));
  const auto copy = [&](const auto& a, auto& b, size_t bytes) {
    for (size_t l = 0; l < a.size(); ++l)
      std::memcpy(reinterpret_cast<std::byte*>(b[l]) + static_cast<size_t>(dst) * bytes,
                  reinterpret_cast<const std::byte*>(a[l]) + static_cast<size_t>(src) * bytes, bytes);
  };
  copy(from.k_, to.k_, n);
  copy(from.v_, to.v_, n);
  const size_t n_scales = static_cast<size_t>(from.block_size_) * static_cast<size_t>(from.n_head_kv_) * sizeof(float);
  copy(from.k_scale_, to.k_scale_, n_scales);
  copy(from.v_scale_, to.v_scale_, n_scales);
  copy(from.rope_scale_, to.rope_scale_, n_scales);
}

void KvCache::read_block(int32_t block, std::span<std::byte> out) const {
  KESTREL_ASSERT(block >= 0 && block < n_blocks_, "KV block read outside the cache");
  KESTREL_ASSERT(static_cast<int64_t>(out.size()) == bytes_per_block(), "KV block read: wrong buffer size");
  const size_t code = static_cast<size_t>(block_size_) * static_cast<size_t>(kv_dim()) *
                      static_cast<size_t>(kv_dtype_bytes(dtype_));
  const size_t scale = static_cast<size_t>(block_size_) * static_cast<size_t>(n_head_kv_) * sizeof(float);
  std::byte* dst = out.data();
  // Layer-major (every part of layer l before layer l + 1), the order write_block reads.
  const std::vector<float*>* parts[3] = {&k_scale_, &v_scale_, &rope_scale_};
  for (size_t l = 0; l < k_.size(); ++l) {
    const auto put = [&](const void* base, size_t n) {
      std::memcpy(dst, static_cast<const std::byte*>(base) + static_cast<size_t>(block) * n, n);
      dst += n;
    };
    put(k_[l], code);
    if (has_v()) put(v_[l], code);
    for (const auto* p : parts)
      if (!p->empty()) put((*p)[l], scale);
  }
}

void KvCache::write_block(int32_t block, std::span<const std::byte> in) {
  KESTREL_ASSERT(block >= 0 && block < n_blocks_, "KV block write outside the cache");
  KESTREL_ASSERT(static_cast<int64_t>(in.size()) == bytes_per_block(), "KV block write: wrong buffer size");
  const size_t code = static_cast<size_t>(block_size_) * static_cast<size_t>(kv_dim()) *
                      static_cast<size_t>(kv_dtype_bytes(dtype_));
  const size_t scale = static_cast<size_t>(block_size_) * static_cast<size_t>(n_head_kv_) * sizeof(float);
  const std::byte* src = in.data();
  const std::vector<float*>* parts[3] = {&k_scale_, &v_scale_, &rope_scale_};
  for (size_t l = 0; l < k_.size(); ++l) {
    const auto get = [&](void* base, size_t n) {
      std::memcpy(static_cast<std::byte*>(base) + static_cast<size_t>(block) * n, src, n);
      src += n;
    };
    get(k_[l], code);
    if (has_v()) get(v_[l], code);
    for (const auto* p : parts)
      if (!p->empty()) get((*p)[l], scale);
  }
}

}  // namespace kestrel
