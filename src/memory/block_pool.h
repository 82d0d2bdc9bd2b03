// The physical KV blocks: reference counts, the free list, and the prefix-cache index of full
// blocks (automatic prefix caching as in vLLM: a full block is keyed by a hash chain over its
// parent's key and its token ids, so equal prefixes map to equal keys).
//
// A block is in exactly one of three states:
//   in use     ref_count > 0 (held by one or more sequences' block tables);
//   cached     ref_count == 0, indexed by its key, evictable (least recently released first);
//   free       ref_count == 0, not indexed.
// n_free() counts free and cached blocks: a cached block is evicted when a fresh one is needed.
//
// BlockPool::commit() is the only method that changes the pool. KvManager plans a change with the
// read-only queries, checks it fits, and commits it whole, so a failed request changes nothing.
#pragma once

#include <cstdint>
#include <span>
#include <unordered_map>
#include <vector>

namespace kestrel {

// Key of a full block: a hash of (parent key, the block's token ids), XXH3-64. Lookups also
// compare the stored tokens and parent key, so a hash collision can cost a miss but never a
// wrong hit.
struct BlockKey {
  uint64_t hash = 0;
  uint64_t parent_hash = 0;  // 0 for the first block of a sequence
  std::vector<int32_t> tokens;  // [block_size]
};

// Hash of a block given its parent's hash (0 for the first block).
uint64_t block_hash(uint64_t parent_hash, std::span<const int32_t> tokens);

// One atomic change of the pool, applied by commit() in this order: ref, take, publish, release.
struct PoolChange {
  std::vector<int32_t> ref;       // blocks gaining a reference (prefix-cache hits, forks); cached ones leave the LRU list
  int32_t n_take = 0;             // fresh blocks to take (from the free list, else by evicting the LRU cached block)
  std::vector<std::pair<int32_t, BlockKey>> publish;  // full, computed blocks to index (skipped when the key is already indexed)
  std::vector<int32_t> release;   // blocks losing a reference, in this order; indexed ones that reach 0 join the LRU tail
};

class BlockPool {
 public:
  explicit BlockPool(int32_t n_blocks);

  // --- the one mutating method ---
  // Applies `change` and returns the ids of the n_take blocks taken, in order. The caller must
  // have checked that n_take <= n_free() after the refs (KESTREL_ASSERT otherwise).
  std::vector<int32_t> commit(const PoolChange& change);

  // --- queries ---
  int32_t n_blocks() const { return static_cast<int32_t>(ref_count_.size()); }
  int32_t n_free() const { return static_cast<int32_t>(free_.size()) + n_lru_; }
  int32_t n_in_use() const { return n_blocks() - n_free(); }
  int32_t n_cached() const { return static_cast<int32_t>(index_.size()); }  // indexed, in use or not
  int32_t ref_count(int32_t block) const { return ref_count_[static_cast<size_t>(block)]; }
  // The indexed block whose key matches (hash, parent, tokens), or -1.
  int32_t lookup(uint64_t hash, uint64_t parent_hash, std::span<const int32_t> tokens) const;
  bool is_indexed(int32_t block) const { return keys_[static_cast<size_t>(block)].has_value; }
  int64_t n_evictions() const { return n_evictions_; }
  // With recording on, each cached block that commit() evicts to hand it out again is listed with
  // the key it held (before any K/V of the new owner is written), for the host tier to keep.
  void set_record_evictions(bool on) { record_evictions_ = on; }
  // The evictions recorded since the last call, in eviction order; clears the list.
  std::vector<std::pair<int32_t, BlockKey>> take_evictions() { return std::move(evicted_); }
  // Recounts every state and list from scratch; KESTREL_ASSERT on any inconsistency (tests).
  void check_invariants() const;

 private:
  struct Slot {
    bool has_value = false;
    BlockKey key;
  };
  void lru_push_back(int32_t b);
  void lru_remove(int32_t b);
  int32_t take_one();

  std::vector<int32_t> ref_count_;  // [n_blocks]
  std::vector<int32_t> free_;       // stack of free, unindexed blocks
  std::vector<Slot> keys_;          // [n_blocks] the key of each indexed block
  std::unordered_map<uint64_t, int32_t> index_;  // hash -> block
  // Intrusive doubly linked LRU list of cached blocks with ref 0 (node n_blocks is the sentinel).
  std::vector<int32_t> lru_prev_, lru_next_;
  int32_t n_lru_ = 0;
  int64_t n_evictions_ = 0;
  bool record_evictions_ = false;
  std::vector<std::pair<int32_t, BlockKey>> evicted_;
};

}  // namespace kestrel
