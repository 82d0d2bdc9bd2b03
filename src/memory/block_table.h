// A sequence's block table and a free-list allocator of KV blocks.
#pragma once

#include <cstdint>
#include <vector>

#include "core/error.h"

namespace kestrel {

class BlockAllocator {
 public:
  explicit BlockAllocator(int32_t n_blocks) {
    free_.reserve(static_cast<size_t>(n_blocks));
    for (int32_t b = n_blocks - 1; b >= 0; --b) free_.push_back(b);
  }
  int32_t n_free() const { return static_cast<int32_t>(free_.size()); }
  // Throws kestrel::Error when the cache is full.
  int32_t allocate() {
    if (free_.empty()) throw Error("KV cache is full: no free block");
    const int32_t b = free_.back();
    free_.pop_back();
    return b;
  }
  void free(int32_t block) { free_.push_back(block); }

 private:
  std::vector<int32_t> free_;
};

// Logical block i of a sequence (tokens [i*block_size, (i+1)*block_size)) is physical block
// blocks[i]; a token at position p lives in slot blocks[p / block_size] * block_size + p % block_size.
struct BlockTable {
  int32_t block_size = 16;
  std::vector<int32_t> blocks;

  int64_t capacity() const { return static_cast<int64_t>(blocks.size()) * block_size; }
  int64_t slot(int64_t pos) const {
    KESTREL_ASSERT(pos >= 0 && pos < capacity(), "position outside the block table");
    return static_cast<int64_t>(blocks[static_cast<size_t>(pos / block_size)]) * block_size +
           pos % block_size;
  }
  // Grows the table so positions [0, n_tokens) have slots.
  void reserve(int64_t n_tokens, BlockAllocator& alloc) {
    while (capacity() < n_tokens) blocks.push_back(alloc.allocate());
  }
  void release(BlockAllocator& alloc) {
    for (int32_t b : blocks) alloc.free(b);
    blocks.clear();
  }
};

}  // namespace kestrel
