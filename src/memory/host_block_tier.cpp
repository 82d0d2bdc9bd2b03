#include "memory/host_block_tier.h"

#include <algorithm>
#include <cstddef>
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

int32_t HostBlockTier::take_block() {
  if (!free_.empty()) {
    const int32_t h = free_.back();
    free_.pop_back();
    return h;
  }
  const auto victim = std::find_if(lru_.begin(), lru_.end(), [&](int32_t b) { return !slot(b).pinned; });
  if (victim == lru_.end()) return -1;
  const int32_t h = *victim;
  lru_.erase(victim);
  index_.erase(slot(h).key.hash);
  slot(h).held = false;
  ++n_dropped_;
  return h;
}

int32_t HostBlockTier::insert(const BlockKey& key) {
  const int32_t device = 0;
  return insert_all(std::span<const BlockKey>(&key, 1), std::span<const int32_t>(&device, 1))[0];
}

std::vector<int32_t> HostBlockTier::insert_all(std::span<const BlockKey> keys, std::span<const int32_t> device) {
  KESTREL_ASSERT(device.size() == keys.size(), "host KV tier: a device block per key");
  std::vector<int32_t> out(keys.size(), -1);
  if (n_blocks_ == 0) return out;
  std::vector<size_t> todo;  // keys to store, in order
  std::unordered_map<uint64_t, size_t> batch;  // hash -> its key among todo (two equal blocks evicted at once)
  for (size_t i = 0; i < keys.size(); ++i) {
    const BlockKey& k = keys[i];
    const auto it = index_.find(k.hash);
    if (it != index_.end()) {
      if (lookup(k.hash, k.parent_hash, k.tokens) >= 0) lru_.splice(lru_.end(), lru_, slot(it->second).lru);
      continue;
    }
    if (batch.emplace(k.hash, i).second) todo.push_back(i);
  }
  const size_t n_avail = free_.size() + lru_.size() - pinned_.size();
  if (todo.size() > n_avail) todo.erase(todo.begin(), todo.begin() + static_cast<std::ptrdiff_t>(todo.size() - n_avail));
  std::vector<int32_t> ids;
  for (size_t k = 0; k < todo.size(); ++k) ids.push_back(take_block());
  std::sort(ids.begin(), ids.end());
  // LRU order stays eviction order; the ids follow the device ids.
  std::vector<size_t> by_device(todo.size());
  for (size_t k = 0; k < todo.size(); ++k) by_device[k] = k;
  std::stable_sort(by_device.begin(), by_device.end(),
                   [&](size_t a, size_t b) { return device[todo[a]] < device[todo[b]]; });
  std::vector<int32_t> id_of(todo.size());
  for (size_t r = 0; r < todo.size(); ++r) id_of[by_device[r]] = ids[r];
  for (size_t k = 0; k < todo.size(); ++k) {
    const int32_t h = id_of[k];
    KESTREL_ASSERT(h >= 0, "host KV tier: fewer blocks than counted");
    Slot& s = slot(h);
    s.held = true;
    s.pinned = false;
    s.key = keys[todo[k]];
    s.lru = lru_.insert(lru_.end(), h);
    index_.emplace(s.key.hash, h);
    out[todo[k]] = h;
  }
  return out;
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
