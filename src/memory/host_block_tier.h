// The host tier of the prefix cache (--cpu-offload-kv-gb; vLLM's CPU KV offloading, LMCache's
// local CPU backend): full KV blocks that the device pool evicted, kept in host memory under the
// same hash-chain key (BlockKey), so a later prefix hit copies them back instead of recomputing.
//
// The tier only does the bookkeeping; the bytes live in the backend's host block pool
// (ModelRunner::allocate_swap_space), whose ids [first_id, first_id + n_blocks) are the tier's
// (the swap pool has the ids below). Each host block is free or holds one key; held blocks form
// an LRU list, and insert() drops the least recently used one when none is free. A block that a
// pending host -> device copy reads is pinned (pin()) until the caller has issued that copy
// (unpin_all()), so no device -> host copy of the same step overwrites it first.
#pragma once

#include <cstdint>
#include <list>
#include <span>
#include <unordered_map>
#include <vector>

#include "memory/block_pool.h"

namespace kestrel {

class HostBlockTier {
 public:
  // n_blocks >= 0 host blocks with ids first_id, first_id + 1, ...; 0 = no tier.
  // Errors: kestrel::Error when n_blocks or first_id is negative.
  HostBlockTier(int32_t n_blocks, int32_t first_id);

  // The host block holding the key (hash, parent, tokens), or -1. Like BlockPool::lookup, a hash
  // collision is a miss, never a wrong hit.
  int32_t lookup(uint64_t hash, uint64_t parent_hash, std::span<const int32_t> tokens) const;
  // Marks a held block most recently used and pinned: insert() will not drop it until unpin_all().
  void pin(int32_t host);
  void unpin_all();
  // Stores `key`, for the caller to copy the device block's K/V into the returned host block.
  // Returns -1 when nothing needs copying: the key is already held (then it becomes most recently
  // used), its hash is held under another key (a collision: the newer block is not kept), or
  // every block is pinned.
  int32_t insert(const BlockKey& key);
  // insert() of each key, in order (keys[0] evicted first), with two differences: when the keys
  // needing a block outnumber the blocks that can be had, the first ones are left out (the last
  // evicted are kept); and the host ids handed out ascend with `device` (the device block each
  // key leaves, [keys.size()]), so that the copies out, and the copies back into a table taken in
  // ascending order, run over consecutive blocks on both sides (one copy per run and tensor).
  // Returns each key's block or -1.
  std::vector<int32_t> insert_all(std::span<const BlockKey> keys, std::span<const int32_t> device);

  int32_t n_blocks() const { return n_blocks_; }
  int32_t n_held() const { return static_cast<int32_t>(index_.size()); }
  int64_t n_dropped() const { return n_dropped_; }  // held blocks given up to make room
  // Recounts the free list, the LRU list and the index; KESTREL_ASSERT on any inconsistency (tests).
  void check_invariants() const;

 private:
  struct Slot {
    bool held = false;
    bool pinned = false;
    BlockKey key;
    std::list<int32_t>::iterator lru;  // position in lru_ while held
  };
  Slot& slot(int32_t host) { return slots_[static_cast<size_t>(host - first_id_)]; }
  const Slot& slot(int32_t host) const { return slots_[static_cast<size_t>(host - first_id_)]; }

  int32_t n_blocks_;
  int32_t first_id_;
  std::vector<Slot> slots_;                      // [n_blocks]
  std::vector<int32_t> free_;                    // stack of free host ids
  std::list<int32_t> lru_;                       // held host ids, least recently used first
  std::unordered_map<uint64_t, int32_t> index_;  // hash -> host id
  std::vector<int32_t> pinned_;  // each pinned block once
  int64_t n_dropped_ = 0;
  // A free block, else the least recently used unpinned one (dropped); -1 when all are pinned.
  int32_t take_block();
};

}  // namespace kestrel
