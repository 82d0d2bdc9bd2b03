#include "memory/host_block_tier.h"

#include <algorithm>
#include <string>

#include "core/error.h"

namespace kestrel {

HostBlockTier::HostBlockTier(int32_t n_blocks, int32_t first_id) : n_blocks_(n_blocks), first_id_(first_id) {
  if (n_blocks < 0 || first_id < 0)
    throw Error("host KV tier needs n_blocks >= 0 and first_id >= 0, got " + std::to_string(n_blocks) + " and " +
                std::to_string(first_id));
  slots_.resize(static_cast<size_t>(n_blocks));
  free_.reserve(static_cast<size_t>(n_blocks));
  for (int32_t i = n_blocks - 1; i >= 0; --i) free_.push_back(first_id + i);  // hands out first_id first
}

int32_t HostBlockTier::lookup(uint64_t hash, uint64_t parent_hash, std::span<const int32_t> tokens) const {
  const auto it = index_.find(hash);
  if (it == index_.end()) return -1;
  const BlockKey& k = slot(it->second).key;
  if (k.parent_hash != parent_hash || !std::equal(k.tokens.begin(), k.tokens.end(), tokens.begin(), tokens.end()))
    return -1;
  return it->second;
}

void HostBlockTier::pin(int32_t host) {
  KESTREL_ASSERT(host >= first_id_ && host < first_id_ + n_blocks_ && slot(host).held,
                 "host KV tier: pin of a block it does not hold");
  Slot& s = slot(host);
  lru_.splice(lru_.end(), lru_, s.lru);
  if (!s.pinned) pinned_.push_back(host);
  s.pinned = true;
}

void HostBlockTier::unpin_all() {
  for (int32_t h : pinned_) slot(h).pinned = false;
  pinned_.clear();
}

int32_t HostBlockTier::insert(const BlockKey& key) {
  if (n_blocks_ == 0) return -1;
  const auto it = index_.find(key.hash);
  if (it != index_.end()) {
    if (lookup(key.hash, key.parent_hash, key.tokens) >= 0) lru_.splice(lru_.end(), lru_, slot(it->second).lru);
    return -1;
  }
  int32_t h = -1;
  if (!free_.empty()) {
    h = free_.back();
    free_.pop_back();
  } else {
    // The least recently used block that no pending copy reads.
    const auto victim = std::find_if(lru_.begin(), lru_.end(), [&](int32_t b) { return !slot(b).pinned; });
    if (victim == lru_.end()) return -1;
    h = *victim;
    lru_.erase(victim);
    index_.erase(slot(h).key.hash);
    ++n_dropped_;
  }
  Slot& s = slot(h);
  s.held = true;
  s.pinned = false;
  s.key = key;
  s.lru = lru_.insert(lru_.end(), h);
  index_.emplace(key.hash, h);
  return h;
}

void HostBlockTier::check_invariants() const {
  std::vector<int> seen(static_cast<size_t>(n_blocks_), 0);
  for (int32_t h : free_) {
    KESTREL_ASSERT(h >= first_id_ && h < first_id_ + n_blocks_ && !slot(h).held, "host KV tier: bad free block");
    ++seen[static_cast<size_t>(h - first_id_)];
  }
  for (int32_t h : lru_) {
    KESTREL_ASSERT(h >= first_id_ && h < first_id_ + n_blocks_ && slot(h).held, "host KV tier: bad LRU block");
    const auto it = index_.find(slot(h).key.hash);
    KESTREL_ASSERT(it != index_.end() && it->second == h, "host KV tier: held block missing from the index");
    ++seen[static_cast<size_t>(h - first_id_)];
  }
  for (int32_t i = 0; i < n_blocks_; ++i)
    KESTREL_ASSERT(seen[static_cast<size_t>(i)] == 1, "host KV tier: block " + std::to_string(first_id_ + i) +
                                                          " is in " + std::to_string(seen[static_cast<size_t>(i)]) +
                                                          " places (free list and LRU list)");
  KESTREL_ASSERT(index_.size() == lru_.size(), "host KV tier: index size differs from the LRU list");
  for (int32_t h : pinned_) KESTREL_ASSERT(slot(h).pinned && slot(h).held, "host KV tier: pinned block not held");
}

}  // namespace kestrel
