// KV cache storage: keys and values of every layer in fixed-size blocks (PagedAttention,
// Kwon et al. 2023, "Efficient Memory Management for LLM Serving with PagedAttention").
//
// A slot is block_id * block_size + offset; the K row of a token in layer l lives at
// k(l) + slot * kv_dim. Which blocks a sequence owns is the business of its block table and of
// the block allocator, not of this class.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace kestrel {

class KvCache {
 public:
  // Layout per layer: K and V each [n_blocks, block_size, n_head_kv, head_dim], f32.
  KvCache(int64_t n_layer, int64_t n_head_kv, int64_t head_dim, int32_t block_size, int32_t n_blocks);

  int32_t block_size() const { return block_size_; }
  int32_t n_blocks() const { return n_blocks_; }
  int64_t kv_dim() const { return kv_dim_; }
  int64_t n_slots() const { return static_cast<int64_t>(n_blocks_) * block_size_; }
  // Bytes of K and V for one token across all layers (2 x layers x kv_heads x head_dim x 4).
  int64_t bytes_per_token() const { return 2 * n_layer_ * kv_dim_ * static_cast<int64_t>(sizeof(float)); }

  float* k(int64_t layer) { return k_[static_cast<size_t>(layer)].get(); }
  float* v(int64_t layer) { return v_[static_cast<size_t>(layer)].get(); }
  const float* k(int64_t layer) const { return k_[static_cast<size_t>(layer)].get(); }
  const float* v(int64_t layer) const { return v_[static_cast<size_t>(layer)].get(); }
  // Copies the K and V of every layer from block src to block dst (copy-on-write).
  void copy_block(int32_t src, int32_t dst);

 private:
  int64_t n_layer_;
  int64_t kv_dim_;
  int32_t block_size_;
  int32_t n_blocks_;
  // Left uninitialised: the pages are only touched when a block is written, so a large pool
  // costs no time or resident memory until it is used; a slot is always written before it is read.
  std::vector<std::unique_ptr<float[]>> k_, v_;
};

}  // namespace kestrel
