#include "memory/kv_manager.h"

#include <algorithm>
#include <string>

#include "core/error.h"

namespace kestrel {

KvManager::KvManager(const KvManagerConfig& config)
    : block_size_(config.block_size),
      caching_(config.enable_prefix_caching),
      pool_(config.n_blocks),
      tier_(config.n_offload_blocks, std::max(0, config.n_swap_blocks)) {
  if (config.block_size <= 0)
    throw Error("KV block size must be positive, got " + std::to_string(config.block_size));
  if (config.n_swap_blocks < 0)
    throw Error("KV swap blocks must be >= 0, got " + std::to_string(config.n_swap_blocks));
  n_swap_blocks_ = config.n_swap_blocks;
  swap_free_.reserve(static_cast<size_t>(n_swap_blocks_));
  for (int32_t b = n_swap_blocks_ - 1; b >= 0; --b) swap_free_.push_back(b);  // hands out 0, 1, 2, ...
  pool_.set_record_evictions(caching_ && tier_.n_blocks() > 0);
}

std::vector<int32_t> KvManager::commit(const PoolChange& change) {
  std::vector<int32_t> taken = pool_.commit(change);
  if (tier_.n_blocks() == 0) return taken;
  // The evicted blocks still hold their keys' K/V: nothing of this step has written them yet.
  const std::vector<std::pair<int32_t, BlockKey>> evicted = pool_.take_evictions();
  if (evicted.empty()) return taken;
  std::vector<BlockKey> keys;
  std::vector<int32_t> devices;
  for (const auto& e : evicted) {
    devices.push_back(e.first);
    keys.push_back(e.second);
  }
  const std::vector<int32_t> hosts = tier_.insert_all(keys, devices);
  for (size_t i = 0; i < evicted.size(); ++i) {
    if (hosts[i] < 0) continue;
    offloads_.push_back({evicted[i].first, hosts[i]});
    ++n_offloaded_;
  }
  return taken;
}

std::vector<BlockSwap> KvManager::take_offloads() { return std::move(offloads_); }

std::vector<BlockSwap> KvManager::take_loads() {
  tier_.unpin_all();
  return std::move(loads_);
}

const std::vector<int32_t>& KvManager::block_table(SeqId seq) const {
  const auto it = seqs_.find(seq);
  KESTREL_ASSERT(it != seqs_.end(), "KvManager: unknown sequence " + std::to_string(seq));
  return it->second.blocks;
}

int64_t KvManager::capacity(SeqId seq) const {
  return static_cast<int64_t>(block_table(seq).size()) * block_size_;
}

int64_t KvManager::first_held(SeqId seq) const {
  const auto it = seqs_.find(seq);
  KESTREL_ASSERT(it != seqs_.end(), "KvManager: unknown sequence " + std::to_string(seq));
  return it->second.n_released * block_size_;
}

int64_t KvManager::hits_before_window(int64_t n_hit, int64_t lookback) const {
  if (lookback <= 0) return 0;
  // The first computed token sits at position n_hit * block_size and reads keys from there + 1 - lookback.
  const int64_t first_needed = std::max<int64_t>(0, n_hit * block_size_ + 1 - lookback);
  return std::min(n_hit, first_needed / block_size_);
}

void KvManager::release_held(const SeqBlocks& s, size_t begin, size_t end, std::vector<int32_t>& release) {
  for (size_t i = end; i-- > begin;)
    if (s.blocks[i] != kNoBlock) release.push_back(s.blocks[i]);
}

KvManager::PrefixHit KvManager::find_prefix(std::span<const int32_t> tokens) const {
  PrefixHit hit;
  if (!caching_ || tokens.empty()) return hit;
  const int64_t max_blocks = (static_cast<int64_t>(tokens.size()) - 1) / block_size_;
  uint64_t parent = 0;
  for (int64_t i = 0; i < max_blocks; ++i) {
    const auto blk = tokens.subspan(static_cast<size_t>(i * block_size_), static_cast<size_t>(block_size_));
    const uint64_t h = block_hash(parent, blk);
    const int32_t b = pool_.lookup(h, parent, blk);
    if (b < 0) break;
    hit.blocks.push_back(b);
    hit.hashes.push_back(h);
    parent = h;
  }
  for (auto i = static_cast<int64_t>(hit.blocks.size()); i < max_blocks && tier_.n_blocks() > 0; ++i) {
    const auto blk = tokens.subspan(static_cast<size_t>(i * block_size_), static_cast<size_t>(block_size_));
    const uint64_t h = block_hash(parent, blk);
    const int32_t b = tier_.lookup(h, parent, blk);
    if (b < 0) break;
    hit.host.push_back(b);
    hit.hashes.push_back(h);
    parent = h;
  }
  return hit;
}

int64_t KvManager::cached_prefix_len(std::span<const int32_t> tokens) const {
  const PrefixHit hit = find_prefix(tokens);
  return static_cast<int64_t>(hit.blocks.size() + hit.host.size()) * block_size_;
}

bool KvManager::can_allocate(std::span<const int32_t> tokens, int64_t n_tokens, bool reuse_prefix,
                             int64_t lookback) const {
  const PrefixHit hit = reuse_prefix ? find_prefix(tokens) : PrefixHit{};
  const int64_t n_hit = static_cast<int64_t>(hit.blocks.size());
  // Host tier hits need fresh device blocks, like the positions after the hits.
  const int64_t n_new =
      std::max<int64_t>(blocks_for(n_tokens), n_hit + static_cast<int64_t>(hit.host.size())) - n_hit;
  // A hit on an evictable block takes it out of the free count (hits before the window are not taken).
  const int64_t n_revived =
      std::count_if(hit.blocks.begin() + hits_before_window(n_hit, lookback), hit.blocks.end(),
                    [&](int32_t b) { return pool_.ref_count(b) == 0; });
  return n_new + n_revived <= pool_.n_free();
}

int64_t KvManager::allocate(SeqId seq, std::span<const int32_t> tokens, int64_t n_tokens, bool reuse_prefix,
                            int64_t lookback) {
  KESTREL_ASSERT(!has(seq), "KvManager: allocate of an existing sequence " + std::to_string(seq));
  KESTREL_ASSERT(can_allocate(tokens, n_tokens, reuse_prefix, lookback),
                 "KvManager: allocate without enough free blocks");
  PrefixHit hit = reuse_prefix ? find_prefix(tokens) : PrefixHit{};
  KESTREL_ASSERT(hit.host.empty() || lookback <= 0, "KvManager: host tier hits with a sliding window");
  const int64_t n_hit = static_cast<int64_t>(hit.blocks.size());
  const auto n_host = static_cast<int64_t>(hit.host.size());
  const int64_t n_skip = hits_before_window(n_hit, lookback);
  std::fill(hit.blocks.begin(), hit.blocks.begin() + n_skip, kNoBlock);
  // The host hits must survive this commit's evictions, which feed the tier.
  for (int32_t h : hit.host) tier_.pin(h);
  PoolChange change;
  change.ref.assign(hit.blocks.begin() + n_skip, hit.blocks.end());
  change.n_take = static_cast<int32_t>(std::max<int64_t>(blocks_for(n_tokens), n_hit + n_host) - n_hit);
  const std::vector<int32_t> taken = commit(change);
  SeqBlocks& s = seqs_[seq];
  s.blocks = std::move(hit.blocks);
  s.blocks.insert(s.blocks.end(), taken.begin(), taken.end());
  s.n_released = n_skip;
  if (n_host > 0) {
    // The host hits' fresh blocks are published at once: the copies that fill them run before
    // the pass that could read them.
    PoolChange publish;
    for (int64_t i = 0; i < n_host; ++i) {
      const auto at = static_cast<size_t>(n_hit + i);
      loads_.push_back({s.blocks[at], hit.host[static_cast<size_t>(i)]});
      BlockKey key;
      key.hash = hit.hashes[at];
      key.parent_hash = at == 0 ? 0 : hit.hashes[at - 1];
      const auto blk = tokens.subspan(at * static_cast<size_t>(block_size_), static_cast<size_t>(block_size_));
      key.tokens.assign(blk.begin(), blk.end());
      publish.publish.emplace_back(s.blocks[at], std::move(key));
    }
    commit(publish);
    n_offload_hits_ += n_host;
  }
  s.hashes = std::move(hit.hashes);
  const int64_t n_cached = (n_hit + n_host) * block_size_;
  if (caching_ && reuse_prefix) {
    n_queried_ += static_cast<int64_t>(tokens.size());
    n_hit_ += n_cached;
  }
  return n_cached;
}

int64_t KvManager::n_copies_needed(const SeqBlocks& s, int64_t n_computed, int64_t n_tokens) const {
  const int64_t end = std::min<int64_t>(static_cast<int64_t>(s.blocks.size()), blocks_for(n_tokens));
  int64_t n = 0;
  for (int64_t i = std::max(n_computed / block_size_, s.n_released); i < end; ++i)
    if (needs_copy(s.blocks[static_cast<size_t>(i)])) ++n;
  return n;
}

bool KvManager::can_append(SeqId seq, int64_t n_computed, int64_t n_tokens) const {
  const auto it = seqs_.find(seq);
  KESTREL_ASSERT(it != seqs_.end(), "KvManager: can_append of unknown sequence " + std::to_string(seq));
  const SeqBlocks& s = it->second;
  const int64_t n_new = std::max<int64_t>(0, blocks_for(n_tokens) - static_cast<int64_t>(s.blocks.size()));
  return n_new + n_copies_needed(s, n_computed, n_tokens) <= pool_.n_free();
}

void KvManager::plan_publish(SeqBlocks& s, std::span<const int32_t> tokens, int64_t n_computed,
                             PoolChange& change) const {
  if (!caching_) return;
  KESTREL_ASSERT(static_cast<int64_t>(tokens.size()) >= n_computed, "KvManager: fewer tokens than computed");
  const int64_t n_full = std::min<int64_t>(n_computed / block_size_, static_cast<int64_t>(s.blocks.size()));
  for (auto i = static_cast<int64_t>(s.hashes.size()); i < n_full; ++i) {
    const auto blk = tokens.subspan(static_cast<size_t>(i * block_size_), static_cast<size_t>(block_size_));
    BlockKey key;
    key.parent_hash = s.hashes.empty() ? 0 : s.hashes.back();
    key.hash = block_hash(key.parent_hash, blk);
    key.tokens.assign(blk.begin(), blk.end());
    s.hashes.push_back(key.hash);
    // A block released unpublished (release_before without tokens) still extends the hash chain.
    if (s.blocks[static_cast<size_t>(i)] != kNoBlock)
      change.publish.emplace_back(s.blocks[static_cast<size_t>(i)], std::move(key));
  }
}

void KvManager::append(SeqId seq, std::span<const int32_t> tokens, int64_t n_computed, int64_t n_tokens,
                       std::vector<BlockCopy>& copies) {
  KESTREL_ASSERT(can_append(seq, n_computed, n_tokens), "KvManager: append without enough free blocks");
  SeqBlocks& s = seqs_.at(seq);
  KESTREL_ASSERT(n_computed >= s.n_released * block_size_,
                 "KvManager: append of sequence " + std::to_string(seq) + " writes position " +
                     std::to_string(n_computed) + ", in a block released before its window");
  PoolChange change;
  plan_publish(s, tokens, n_computed, change);
  const int64_t end = std::min<int64_t>(static_cast<int64_t>(s.blocks.size()), blocks_for(n_tokens));
  std::vector<int64_t> copy_at;  // logical blocks to replace by a private copy
  for (int64_t i = n_computed / block_size_; i < end; ++i)
    if (needs_copy(s.blocks[static_cast<size_t>(i)])) {
      copy_at.push_back(i);
      change.release.push_back(s.blocks[static_cast<size_t>(i)]);
    }
  const int64_t n_new = std::max<int64_t>(0, blocks_for(n_tokens) - static_cast<int64_t>(s.blocks.size()));
  change.n_take = static_cast<int32_t>(n_new + static_cast<int64_t>(copy_at.size()));
  if (change.n_take == 0 && change.publish.empty()) return;
  const std::vector<int32_t> taken = commit(change);
  size_t t = 0;
  for (int64_t i : copy_at) {
    int32_t& b = s.blocks[static_cast<size_t>(i)];
    copies.push_back({b, taken[t]});
    b = taken[t++];
  }
  for (; t < taken.size(); ++t) s.blocks.push_back(taken[t]);
}

void KvManager::fork(SeqId parent, SeqId child) {
  KESTREL_ASSERT(has(parent), "KvManager: fork of unknown sequence " + std::to_string(parent));
  KESTREL_ASSERT(!has(child), "KvManager: fork into an existing sequence " + std::to_string(child));
  SeqBlocks copy = seqs_.at(parent);
  PoolChange change;
  for (int32_t b : copy.blocks)
    if (b != kNoBlock) change.ref.push_back(b);
  commit(change);
  seqs_.emplace(child, std::move(copy));
}

void KvManager::truncate(SeqId seq, int64_t n_tokens) {
  const auto it = seqs_.find(seq);
  KESTREL_ASSERT(it != seqs_.end(), "KvManager: truncate of unknown sequence " + std::to_string(seq));
  SeqBlocks& s = it->second;
  const auto n_held = static_cast<int64_t>(s.blocks.size());
  KESTREL_ASSERT(n_tokens >= 0 && n_tokens <= n_held * block_size_,
                 "KvManager: truncate of sequence " + std::to_string(seq) + " to " + std::to_string(n_tokens) +
                     " tokens, outside [0, " + std::to_string(n_held * block_size_) + "]");
  const int64_t n_keep = blocks_for(n_tokens);
  KESTREL_ASSERT(n_keep == 0 || n_keep > s.n_released,
                 "KvManager: truncate of sequence " + std::to_string(seq) + " to " + std::to_string(n_tokens) +
                     " tokens, into blocks released before its window (positions < " +
                     std::to_string(s.n_released * block_size_) + ")");
  if (n_keep < n_held) {
    PoolChange change;
    release_held(s, static_cast<size_t>(n_keep), static_cast<size_t>(n_held), change.release);
    commit(change);
    s.blocks.resize(static_cast<size_t>(n_keep));
  }
  if (n_keep == 0) s.n_released = 0;
  // Only blocks wholly below n_tokens stay published. A cut block keeps its cache entry, which is
  // still right (its K/V are those of its key's tokens): append copies it (needs_copy) before the
  // sequence overwrites positions >= n_tokens. Dropping the entry instead would lose a valid hit,
  // and would not protect another sequence that holds the block.
  const int64_t n_whole = n_tokens / block_size_;
  if (static_cast<int64_t>(s.hashes.size()) > n_whole) s.hashes.resize(static_cast<size_t>(n_whole));
}

void KvManager::free(SeqId seq, std::span<const int32_t> tokens, int64_t n_computed) {
  const auto it = seqs_.find(seq);
  KESTREL_ASSERT(it != seqs_.end(), "KvManager: free of unknown sequence " + std::to_string(seq));
  SeqBlocks& s = it->second;
  PoolChange change;
  if (!tokens.empty()) plan_publish(s, tokens, n_computed, change);
  release_held(s, 0, s.blocks.size(), change.release);
  commit(change);
  seqs_.erase(it);
}

int32_t KvManager::release_before(SeqId seq, int64_t first_needed, std::span<const int32_t> tokens,
                                  int64_t n_computed) {
  const auto it = seqs_.find(seq);
  KESTREL_ASSERT(it != seqs_.end(), "KvManager: release_before of unknown sequence " + std::to_string(seq));
  SeqBlocks& s = it->second;
  KESTREL_ASSERT(tokens.empty() || first_needed <= n_computed,
                 "KvManager: release_before position " + std::to_string(first_needed) + " of sequence " +
                     std::to_string(seq) + " beyond its " + std::to_string(n_computed) + " computed tokens");
  const int64_t n_drop =
      std::min<int64_t>(std::max<int64_t>(0, first_needed) / block_size_, static_cast<int64_t>(s.blocks.size()));
  if (n_drop <= s.n_released) return 0;
  PoolChange change;
  if (!tokens.empty()) plan_publish(s, tokens, n_computed, change);
  release_held(s, static_cast<size_t>(s.n_released), static_cast<size_t>(n_drop), change.release);
  commit(change);
  std::fill(s.blocks.begin() + s.n_released, s.blocks.begin() + n_drop, kNoBlock);
  const auto n = static_cast<int32_t>(n_drop - s.n_released);
  s.n_released = n_drop;
  return n;
}

int64_t KvManager::n_held_blocks(SeqId seq) const {
  const auto on_device = seqs_.find(seq);
  const SeqBlocks* s = on_device != seqs_.end() ? &on_device->second : nullptr;
  if (s == nullptr) {
    const auto on_host = swapped_.find(seq);
    KESTREL_ASSERT(on_host != swapped_.end(), "KvManager: unknown sequence " + std::to_string(seq));
    s = &on_host->second;
  }
  return static_cast<int64_t>(s->blocks.size()) - s->n_released;
}

bool KvManager::can_swap_out(SeqId seq) const {
  if (!has(seq) || n_held_blocks(seq) > static_cast<int64_t>(swap_free_.size())) return false;
  // A block another sequence holds stays on the device anyway: such a sequence is recomputed,
  // and its re-admission takes the shared blocks again as prefix-cache hits.
  for (int32_t b : seqs_.at(seq).blocks)
    if (b != kNoBlock && pool_.ref_count(b) > 1) return false;
  return true;
}

std::vector<BlockSwap> KvManager::swap_out(SeqId seq, std::span<const int32_t> tokens, int64_t n_computed) {
  KESTREL_ASSERT(can_swap_out(seq), "KvManager: swap_out of sequence " + std::to_string(seq) +
                                        " without enough free host blocks");
  const auto it = seqs_.find(seq);
  SeqBlocks& s = it->second;
  PoolChange change;
  plan_publish(s, tokens, n_computed, change);
  release_held(s, 0, s.blocks.size(), change.release);
  commit(change);
  std::vector<BlockSwap> swaps;
  for (int32_t& b : s.blocks) {
    if (b == kNoBlock) continue;
    const int32_t h = swap_free_.back();
    swap_free_.pop_back();
    swaps.push_back({b, h});
    b = h;
  }
  n_swapped_out_ += static_cast<int64_t>(swaps.size());
  swapped_.emplace(seq, std::move(s));
  seqs_.erase(it);
  return swaps;
}

bool KvManager::can_swap_in(SeqId seq, int64_t n_tokens) const {
  const auto it = swapped_.find(seq);
  if (it == swapped_.end()) return false;
  const SeqBlocks& s = it->second;
  const int64_t n_grow = std::max<int64_t>(0, blocks_for(n_tokens) - static_cast<int64_t>(s.blocks.size()));
  return n_held_blocks(seq) + n_grow <= pool_.n_free();
}

std::vector<BlockSwap> KvManager::swap_in(SeqId seq) {
  const auto it = swapped_.find(seq);
  KESTREL_ASSERT(it != swapped_.end(), "KvManager: swap_in of sequence " + std::to_string(seq) + ", not swapped out");
  SeqBlocks& s = it->second;
  PoolChange change;
  change.n_take = static_cast<int32_t>(n_held_blocks(seq));
  KESTREL_ASSERT(change.n_take <= pool_.n_free(), "KvManager: swap_in without enough free blocks");
  const std::vector<int32_t> taken = commit(change);
  std::vector<BlockSwap> swaps;
  size_t t = 0;
  for (int32_t& b : s.blocks) {
    if (b == kNoBlock) continue;
    swaps.push_back({taken[t], b});
    swap_free_.push_back(b);
    b = taken[t++];
  }
  n_swapped_in_ += static_cast<int64_t>(swaps.size());
  seqs_.emplace(seq, std::move(s));
  swapped_.erase(it);
  return swaps;
}

void KvManager::free_swapped(SeqId seq) {
  const auto it = swapped_.find(seq);
  KESTREL_ASSERT(it != swapped_.end(), "KvManager: free_swapped of sequence " + std::to_string(seq) + ", not swapped out");
  for (int32_t b : it->second.blocks)
    if (b != kNoBlock) swap_free_.push_back(b);
  swapped_.erase(it);
}

void KvManager::check_invariants() const {
  pool_.check_invariants();
  tier_.check_invariants();
  std::vector<int32_t> host(static_cast<size_t>(n_swap_blocks_), 0);
  for (int32_t b : swap_free_) {
    KESTREL_ASSERT(b >= 0 && b < n_swap_blocks_, "KvManager: free host block outside the swap pool");
    ++host[static_cast<size_t>(b)];
  }
  for (const auto& [id, s] : swapped_) {
    KESTREL_ASSERT(!has(id), "KvManager: sequence " + std::to_string(id) + " both swapped and on the device");
    for (int32_t b : s.blocks)
      if (b != kNoBlock) {
        KESTREL_ASSERT(b >= 0 && b < n_swap_blocks_, "KvManager: host block outside the swap pool");
        ++host[static_cast<size_t>(b)];
      }
  }
  for (int32_t b = 0; b < n_swap_blocks_; ++b)
    KESTREL_ASSERT(host[static_cast<size_t>(b)] == 1, "KvManager: host block " + std::to_string(b) + " is in " +
                                                          std::to_string(host[static_cast<size_t>(b)]) +
                                                          " places (free list and swapped tables)");
  std::vector<int32_t> refs(static_cast<size_t>(pool_.n_blocks()), 0);
  for (const auto& [id, s] : seqs_)
    for (size_t i = 0; i < s.blocks.size(); ++i) {
      const int32_t b = s.blocks[i];
      KESTREL_ASSERT((b == kNoBlock) == (static_cast<int64_t>(i) < s.n_released),
                     "KvManager: sequence " + std::to_string(id) + " has a hole outside its leading released blocks");
      if (b != kNoBlock) ++refs[static_cast<size_t>(b)];
    }
  for (int32_t b = 0; b < pool_.n_blocks(); ++b)
    KESTREL_ASSERT(refs[static_cast<size_t>(b)] == pool_.ref_count(b),
                   "KvManager: block " + std::to_string(b) + " has ref count " +
                       std::to_string(pool_.ref_count(b)) + " but " +
                       std::to_string(refs[static_cast<size_t>(b)]) + " tables hold it");
}

}  // namespace kestrel
