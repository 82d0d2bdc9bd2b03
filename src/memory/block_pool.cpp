#include "memory/block_pool.h"

#include <xxhash.h>

#include <string>

#include "core/error.h"

namespace kestrel {

uint64_t block_hash(uint64_t parent_hash, std::span<const int32_t> tokens) {
  // Seeding with the parent's hash chains the blocks: equal hashes mean equal whole prefixes
  // (up to collisions, which lookup() rules out by comparing tokens and parent).
  const uint64_t h = XXH3_64bits_withSeed(tokens.data(), tokens.size_bytes(), parent_hash);
  return h == 0 ? 1 : h;  // 0 marks "no parent"
}

BlockPool::BlockPool(int32_t n_blocks) {
  if (n_blocks <= 0) throw Error("KV pool needs at least one block, got " + std::to_string(n_blocks));
  const auto n = static_cast<size_t>(n_blocks);
  ref_count_.assign(n, 0);
  keys_.resize(n);
  free_.reserve(n);
  for (int32_t b = n_blocks - 1; b >= 0; --b) free_.push_back(b);  // hands out 0, 1, 2, ...
  lru_prev_.assign(n + 1, n_blocks);
  lru_next_.assign(n + 1, n_blocks);
}

void BlockPool::lru_push_back(int32_t b) {
  const int32_t s = n_blocks();
  const int32_t last = lru_prev_[static_cast<size_t>(s)];
  lru_next_[static_cast<size_t>(last)] = b;
  lru_prev_[static_cast<size_t>(b)] = last;
  lru_next_[static_cast<size_t>(b)] = s;
  lru_prev_[static_cast<size_t>(s)] = b;
  ++n_lru_;
}

void BlockPool::lru_remove(int32_t b) {
  const int32_t p = lru_prev_[static_cast<size_t>(b)], n = lru_next_[static_cast<size_t>(b)];
  lru_next_[static_cast<size_t>(p)] = n;
  lru_prev_[static_cast<size_t>(n)] = p;
  lru_prev_[static_cast<size_t>(b)] = lru_next_[static_cast<size_t>(b)] = -1;
  --n_lru_;
}

int32_t BlockPool::take_one() {
  if (!free_.empty()) {
    const int32_t b = free_.back();
    free_.pop_back();
    ref_count_[static_cast<size_t>(b)] = 1;
    return b;
  }
  KESTREL_ASSERT(n_lru_ > 0, "KV pool: take without a free or evictable block");
  const int32_t b = lru_next_[static_cast<size_t>(n_blocks())];  // least recently released
  lru_remove(b);
  auto& slot = keys_[static_cast<size_t>(b)];
  index_.erase(slot.key.hash);
  if (record_evictions_) evicted_.emplace_back(b, std::move(slot.key));
  slot = Slot{};
  ++n_evictions_;
  ref_count_[static_cast<size_t>(b)] = 1;
  return b;
}

std::vector<int32_t> BlockPool::commit(const PoolChange& change) {
  for (int32_t b : change.ref) {
    KESTREL_ASSERT(b >= 0 && b < n_blocks(), "KV pool: ref of a block outside the pool");
    int32_t& rc = ref_count_[static_cast<size_t>(b)];
    KESTREL_ASSERT(rc > 0 || keys_[static_cast<size_t>(b)].has_value, "KV pool: ref of a free block");
    if (rc == 0) lru_remove(b);
    ++rc;
  }
  KESTREL_ASSERT(change.n_take >= 0 && change.n_take <= n_free(), "KV pool: take more blocks than are free");
  std::vector<int32_t> taken;
  taken.reserve(static_cast<size_t>(change.n_take));
  for (int32_t i = 0; i < change.n_take; ++i) taken.push_back(take_one());
  for (const auto& [b, key] : change.publish) {
    KESTREL_ASSERT(b >= 0 && b < n_blocks() && ref_count_[static_cast<size_t>(b)] > 0,
                   "KV pool: publish of a block nobody holds");
    auto& slot = keys_[static_cast<size_t>(b)];
    if (slot.has_value || index_.count(key.hash)) continue;  // already indexed (this or an equal block)
    slot.has_value = true;
    slot.key = key;
    index_.emplace(key.hash, b);
  }
  for (int32_t b : change.release) {
    KESTREL_ASSERT(b >= 0 && b < n_blocks(), "KV pool: release of a block outside the pool");
    int32_t& rc = ref_count_[static_cast<size_t>(b)];
    KESTREL_ASSERT(rc > 0, "KV pool: release of a block with no reference");
    if (--rc == 0) {
      if (keys_[static_cast<size_t>(b)].has_value) {
        lru_push_back(b);
      } else {
        free_.push_back(b);
      }
    }
  }
  return taken;
}

int32_t BlockPool::lookup(uint64_t hash, uint64_t parent_hash, std::span<const int32_t> tokens) const {
  const auto it = index_.find(hash);
  if (it == index_.end()) return -1;
  const BlockKey& k = keys_[static_cast<size_t>(it->second)].key;
  if (k.parent_hash != parent_hash || k.tokens.size() != tokens.size()) return -1;
  for (size_t i = 0; i < tokens.size(); ++i)
    if (k.tokens[i] != tokens[i]) return -1;
  return it->second;
}

void BlockPool::check_invariants() const {
  const int32_t n = n_blocks();
  std::vector<int> state(static_cast<size_t>(n), 0);  // 1 free, 2 lru
  for (int32_t b : free_) {
    KESTREL_ASSERT(state[static_cast<size_t>(b)] == 0, "KV pool: block twice in the free list");
    KESTREL_ASSERT(ref_count_[static_cast<size_t>(b)] == 0 && !keys_[static_cast<size_t>(b)].has_value,
                   "KV pool: free block is referenced or indexed");
    state[static_cast<size_t>(b)] = 1;
  }
  int32_t n_walk = 0;
  for (int32_t b = lru_next_[static_cast<size_t>(n)]; b != n; b = lru_next_[static_cast<size_t>(b)]) {
    KESTREL_ASSERT(b >= 0 && b < n && state[static_cast<size_t>(b)] == 0, "KV pool: LRU list corrupt");
    KESTREL_ASSERT(ref_count_[static_cast<size_t>(b)] == 0 && keys_[static_cast<size_t>(b)].has_value,
                   "KV pool: LRU block is referenced or unindexed");
    state[static_cast<size_t>(b)] = 2;
    ++n_walk;
  }
  KESTREL_ASSERT(n_walk == n_lru_, "KV pool: LRU count differs from the list");
  int32_t n_indexed = 0;
  for (int32_t b = 0; b < n; ++b) {
    const auto& slot = keys_[static_cast<size_t>(b)];
    if (slot.has_value) {
      ++n_indexed;
      const auto it = index_.find(slot.key.hash);
      KESTREL_ASSERT(it != index_.end() && it->second == b, "KV pool: indexed block missing from the index");
    }
    if (state[static_cast<size_t>(b)] == 0)
      KESTREL_ASSERT(ref_count_[static_cast<size_t>(b)] > 0, "KV pool: block neither free, cached nor in use (leaked)");
  }
  KESTREL_ASSERT(n_indexed == static_cast<int32_t>(index_.size()), "KV pool: index size differs from the keys");
}

}  // namespace kestrel
