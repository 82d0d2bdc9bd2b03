// KV cache storage: keys and values of every layer in fixed-size blocks (PagedAttention,
// Kwon et al. 2023, "Efficient Memory Management for LLM Serving with PagedAttention").
//
// A slot is block_id * block_size + offset. Within a layer, K (and V) is laid out
// [n_blocks, n_head_kv, block_size, head_dim]: the keys of one KV head in one block are
// contiguous, so attention over a sequence streams whole runs of memory per block. Which blocks a
// sequence owns is the business of its block table and of the KvManager, not of this class.
// Multi-head latent attention (KvGeometry::is_mla) caches one row [kv_lora_rank + rope_dim] per
// token and layer (the latent c_KV, then the RoPE key): the K storage with one head of that width,
// and no V storage.
//
// INT8 storage (--kv-cache-dtype int8) keeps the same code layout and gives every cached row (one
// token's K or V of one KV head; MLA: one token's latent c_KV and, separately, its RoPE key) its
// own f32 scale, value = code x scale with scale = amax(row) / 127: rows are written once, token by
// token, so a scale fixed per row never needs rewriting, and an outlier in one token or head does
// not coarsen any other row. The scales sit beside the codes, [n_blocks, n_head_kv, block_size]
// per layer: the scale of the row at element offset(slot, head) is at offset(slot, head) / head_dim.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "memory/kv_dtype.h"
#include "memory/kv_planner.h"

namespace kestrel {

class KvCache {
 public:
  // dtype: f32 (exact attention), f16 (half the memory and the bytes attention reads; llama.cpp's
  // default) or int8 (codes plus a per-row f32 scale: about a quarter of f32's bytes). Errors:
  // kestrel::Error when block_size or n_blocks is not positive, dtype is another type, or the pool
  // does not fit in memory. populate: zero the whole pool now, so every page is
  // resident from the start (a server: memory runs short at start, not as an out-of-memory kill
  // once the cache fills, and its RSS stays flat while it serves); otherwise pages are touched
  // only when a block is first written.
  KvCache(const KvGeometry& geometry, int32_t block_size, int32_t n_blocks, KvDtype dtype = KvDtype::F32,
          bool populate = false);
  // Standard attention's geometry.
  KvCache(int64_t n_layer, int64_t n_head_kv, int64_t head_dim, int32_t block_size, int32_t n_blocks,
          KvDtype dtype = KvDtype::F32, bool populate = false);

  int32_t block_size() const { return block_size_; }
  int32_t n_blocks() const { return n_blocks_; }
  int64_t n_head_kv() const { return n_head_kv_; }
  int64_t head_dim() const { return head_dim_; }
  int64_t kv_dim() const { return n_head_kv_ * head_dim_; }
  int64_t n_slots() const { return static_cast<int64_t>(n_blocks_) * block_size_; }
  KvDtype dtype() const { return dtype_; }
  bool has_v() const { return !v_.empty(); }  // false for MLA
  // Bytes of one token across all layers, the scales of a quantized cache included:
  // kv_bytes_per_token() of the geometry (the planner's).
  int64_t bytes_per_token() const;
  // Bytes of the whole pool: n_slots() x bytes_per_token().
  int64_t bytes_total() const { return n_slots() * bytes_per_token(); }
  // Element offset of (slot, kv head) in a layer's K or V storage; head_dim elements follow.
  int64_t offset(int64_t slot, int64_t head) const {
    return ((slot / block_size_ * n_head_kv_ + head) * block_size_ + slot % block_size_) * head_dim_;
  }

  // A layer's storage, [n_blocks, n_head_kv, block_size, head_dim] of dtype().
  void* k(int64_t layer) { return k_[static_cast<size_t>(layer)]; }
  void* v(int64_t layer) { return has_v() ? v_[static_cast<size_t>(layer)] : nullptr; }
  const void* k(int64_t layer) const { return k_[static_cast<size_t>(layer)]; }
  const void* v(int64_t layer) const { return has_v() ? v_[static_cast<size_t>(layer)] : nullptr; }
  // INT8 only (nullptr otherwise): a layer's row scales, [n_blocks, n_head_kv, block_size] f32,
  // the scale of the row at element offset o of k() / v() being at o / head_dim(). For MLA,
  // k_scale() holds the latent c_KV's scale (the first kv_lora_rank elements of the row) and
  // rope_scale() the RoPE key's (the rest); v_scale() is nullptr. rope_scale() is nullptr for
  // standard attention.
  float* k_scale(int64_t layer) { return scale_of(k_scale_, layer); }
  float* v_scale(int64_t layer) { return scale_of(v_scale_, layer); }
  float* rope_scale(int64_t layer) { return scale_of(rope_scale_, layer); }
  const float* k_scale(int64_t layer) const { return scale_of(k_scale_, layer); }
  const float* v_scale(int64_t layer) const { return scale_of(v_scale_, layer); }
  const float* rope_scale(int64_t layer) const { return scale_of(rope_scale_, layer); }
  // Copies the K and V of every layer (and their scales) from block src to block dst
  // (copy-on-write).
  void copy_block(int32_t src, int32_t dst) { copy_block(*this, src, *this, dst); }
  // Copies block src of `from` to block dst of `to` (swapping between a pool and its host swap
  // pool). KESTREL_ASSERT unless both caches have the same geometry, block size and dtype.
  static void copy_block(const KvCache& from, int32_t src, KvCache& to, int32_t dst);
  // A block's bytes as one flat record (disaggregated prefill moves them between processes):
  // for each layer, K [n_head_kv, block_size, head_dim] of dtype(), then V (none for MLA), then
  // INT8 only the f32 scales [n_head_kv, block_size] of K, V (MLA: of the latent, then of the
  // RoPE key). block_size x bytes_per_token() bytes. KESTREL_ASSERT when block is outside the pool
  // or the span's size differs.
  void read_block(int32_t block, std::span<std::byte> out) const;
  void write_block(int32_t block, std::span<const std::byte> in);
  int64_t bytes_per_block() const { return static_cast<int64_t>(block_size_) * bytes_per_token(); }

 private:
  int64_t n_layer_;
  int64_t n_head_kv_;
  int64_t head_dim_;
  int32_t block_size_;
  int32_t n_blocks_;
  KvDtype dtype_;
  struct FreeStorage {
    void operator()(std::byte* p) const;
  };
  // One allocation for every layer's K, V and scales, on 2 MiB pages where the kernel gives them
  // (kv_cache.cpp). Left uninitialised unless populated: the pages are only touched when a block
  // is written, so a large pool costs no time or resident memory until it is used; a slot is
  // always written before it is read.
  std::unique_ptr<std::byte, FreeStorage> storage_;
  std::vector<std::byte*> k_, v_;  // per layer, into storage_
  // INT8: per layer [n_blocks, n_head_kv, block_size] f32; empty for the float types (rope_scale_
  // also for standard attention, v_scale_ for MLA).
  std::vector<float*> k_scale_, v_scale_, rope_scale_;

  static float* scale_of(const std::vector<float*>& s, int64_t layer) {
    return s.empty() ? nullptr : s[static_cast<size_t>(layer)];
  }
};

}  // namespace kestrel
