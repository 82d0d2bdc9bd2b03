// Which KV blocks each sequence holds: per-sequence block tables over one BlockPool, with
// prefix-cache reuse, copy-on-write sharing (fork) and query/commit pairs for the scheduler.
//
// The scheduler asks (can_allocate, can_append) and then commits (allocate, append, fork,
// truncate, free).
// Every commit plans its whole change first and applies it with one BlockPool::commit(), the only
// method that changes the pool, so a commit either happens completely or (on a broken
// precondition, a KESTREL_ASSERT) not at all.
//
// Token counts are totals for the sequence: "n_tokens" means slots for positions [0, n_tokens).
// A block is published to the prefix cache once all its tokens' K/V have been computed (the
// caller says how many are, n_computed), so a hit never reads K/V that a forward pass has not
// written yet. A block that a step writes is always private to the writing sequence: held by it
// alone and not in the prefix cache (else append gives it a copy), so K/V that another sequence
// or a later hit can read never change under it.
//
// Sliding-window attention: a sequence whose every layer looks back at most W positions never
// reads blocks wholly before its window again. release_before() drops them, and allocate() does
// not take prefix-cache hits that lie wholly before the window (lookback). Their table entries
// become kNoBlock: a table then starts with such holes, and the kernels must never read them
// (they start at the window).
//
// Swapping (preemption by swap, vLLM's --swap-space): a host pool of n_swap_blocks blocks of the
// KV pool's geometry, whose contents the backend holds (ModelRunner::swap_out / swap_in). swap_out
// gives each held block of a sequence a host block and releases the device block (its computed
// full blocks are published first, so they stay in the prefix cache as evictable hits); the
// sequence's table then lists host blocks and it is "swapped" (has() is false). swap_in takes
// fresh device blocks for them and frees the host blocks. A sequence that shares a block with
// another sequence (fork, n > 1, beams: reference count > 1) is not swapped (can_swap_out is
// false): the block would stay on the device for its other holders, cost a host block, and come
// back as a private copy, so sharing would be lost and the group would need more device blocks
// than before (with beams waiting for each other's rows, enough to stall); recomputing it takes
// the shared blocks again as prefix-cache hits. A block only the prefix cache also indexes is
// swapped like any other (its device copy stays in the cache, evictable).
//
// Host tier of the prefix cache (--cpu-offload-kv-gb): n_offload_blocks more host blocks, ids
// after the swap pool's in the same backend buffer (so swapping and offloading never take each
// other's memory), indexed by HostBlockTier. When the device pool evicts a cached block to hand it
// out again, its key goes to the tier and a device -> host copy is queued (take_offloads(); the
// caller issues it before anything of the step writes device blocks). A prefix lookup that
// leaves the device cache goes on in the tier: allocate() gives those blocks fresh device blocks,
// queues host -> device copies (take_loads(); issued before the step's pass) and publishes them
// at once, so they count as cached tokens. The tier needs lookback == 0: a windowed sequence
// skips the hits before its window, and cached_prefix_len cannot tell (the engine refuses the
// combination).
#pragma once

#include <cstdint>
#include <span>
#include <unordered_map>
#include <vector>

#include "memory/block_pool.h"
#include "memory/host_block_tier.h"

namespace kestrel {

using SeqId = uint64_t;

struct KvManagerConfig {
  int32_t n_blocks = 0;
  int32_t block_size = 16;            // tokens per block
  bool enable_prefix_caching = true;
  int32_t n_swap_blocks = 0;          // host swap pool; 0 = no swapping
  int32_t n_offload_blocks = 0;       // host tier of the prefix cache (ids after the swap pool's); 0 = none
};

// K/V of block src must be copied to block dst before the next forward pass (copy-on-write).
struct BlockCopy {
  int32_t src;
  int32_t dst;
};

// K/V of device block `device` and host swap block `host`: copied device -> host by swap out,
// host -> device by swap in.
struct BlockSwap {
  int32_t device;
  int32_t host;
};

class KvManager {
 public:
  // Block table entry of a block the sequence no longer holds (before its attention window); the
  // same value as the forward batch's kNoBlock (model/forward_batch.h).
  static constexpr int32_t kNoBlock = -1;

  // Errors: kestrel::Error when n_blocks or block_size is not positive.
  explicit KvManager(const KvManagerConfig& config);

  // --- queries ---
  // Tokens at the start of `tokens` whose K/V are in the prefix cache (device blocks, then host
  // tier blocks): whole blocks, and never all of `tokens` (the last token is always computed, so
  // its logits exist). 0 when caching is off.
  int64_t cached_prefix_len(std::span<const int32_t> tokens) const;
  // Whether allocate(seq, tokens, n_tokens, reuse_prefix, lookback) would find enough blocks.
  bool can_allocate(std::span<const int32_t> tokens, int64_t n_tokens, bool reuse_prefix = true,
                    int64_t lookback = 0) const;
  // Whether append(seq, ..., n_computed, n_tokens) would find enough blocks (growth + copies).
  bool can_append(SeqId seq, int64_t n_computed, int64_t n_tokens) const;
  bool has(SeqId seq) const { return seqs_.count(seq) != 0; }
  // Slots the sequence's table spans: block_table(seq).size() * block_size (the most truncate
  // accepts), released leading blocks included.
  int64_t capacity(SeqId seq) const;
  // The sequence's block table: physical block of each logical block, kNoBlock for the leading
  // blocks it released. [ceil(n_tokens / block_size)]
  const std::vector<int32_t>& block_table(SeqId seq) const;
  // Positions below this have no block (released by release_before or skipped by allocate's
  // lookback): a multiple of block_size, 0 when the sequence holds all its blocks.
  int64_t first_held(SeqId seq) const;

  // --- commits ---
  // Starts `seq` (must be new): reuses the cached prefix of `tokens` and takes fresh blocks so
  // positions [0, max(n_tokens, cached)) have slots. Returns the cached prefix length (tokens
  // whose K/V need no computing). With !reuse_prefix nothing is reused (the caller wants every
  // position computed); the sequence's blocks are still published as they fill. KESTREL_ASSERT when
  // !can_allocate.
  // lookback > 0: the sequence's attention reads at most that many positions back (every layer
  // windowed), so prefix-cache hit blocks wholly before position cached + 1 - lookback (the first
  // key the first computed token reads) are not taken: their entries are kNoBlock.
  int64_t allocate(SeqId seq, std::span<const int32_t> tokens, int64_t n_tokens, bool reuse_prefix = true,
                   int64_t lookback = 0);
  // Grows `seq` so positions [0, n_tokens) have slots. `tokens` holds the sequence's known ids
  // (at least n_computed of them); the first n_computed have K/V written, and its full blocks
  // among them are published to the prefix cache. A block that positions [n_computed, n_tokens)
  // would write and that is shared or in the prefix cache is replaced by a private copy, reported
  // in `copies`.
  void append(SeqId seq, std::span<const int32_t> tokens, int64_t n_computed, int64_t n_tokens,
              std::vector<BlockCopy>& copies);
  // `child` (must be new) shares all of `parent`'s blocks (ref counts + 1); writes diverge by
  // copy-on-write in append.
  void fork(SeqId parent, SeqId child);
  // Rolls `seq` back to positions [0, n_tokens) (rejected draft tokens, a pruned beam): it keeps
  // its first ceil(n_tokens / block_size) blocks with their slots and releases the rest, last
  // block first as free() does (a block in the prefix cache stays there, evictable; any other
  // becomes free). A kept block that reaches past n_tokens counts as unpublished again: it is
  // published anew, under the sequence's new tokens, once they are computed. If it is in the
  // prefix cache, its entry stays (its K/V are still right for the old tokens), so the next
  // append that writes it takes a copy.
  // n_tokens == 0 keeps `seq` registered with no blocks; a later append grows it again.
  // KESTREL_ASSERT unless 0 <= n_tokens <= capacity(seq), and unless n_tokens == 0 or the block of
  // position n_tokens - 1 is still held (not released before the window).
  void truncate(SeqId seq, int64_t n_tokens);
  // Sliding window: releases the blocks of `seq` that hold only positions < first_needed (no later
  // token reads them). Their entries become kNoBlock; their references go as in free() (with
  // tokens given, computed full blocks are published to the prefix cache first, so they stay
  // there as evictable hits). A block that holds position first_needed or later is kept, and
  // released blocks stay released: a repeated or smaller first_needed changes nothing. Returns the
  // number of blocks released. first_needed is at most the next position the sequence computes
  // (KESTREL_ASSERT when it exceeds n_computed with tokens given).
  int32_t release_before(SeqId seq, int64_t first_needed, std::span<const int32_t> tokens = {},
                         int64_t n_computed = 0);
  // Ends `seq`: publishes its computed full blocks (when tokens are given) and drops its
  // references, last block first so a sequence's tail is evicted before its shared head.
  void free(SeqId seq, std::span<const int32_t> tokens = {}, int64_t n_computed = 0);

  // --- swapping (host blocks) ---
  bool is_swapped(SeqId seq) const { return swapped_.count(seq) != 0; }
  // Blocks of the sequence's table that it holds (not kNoBlock), device or host.
  int64_t n_held_blocks(SeqId seq) const;
  // Whether swap_out(seq) may run: `seq` is on the device, holds no block another sequence holds,
  // and finds a host block for every block it holds.
  bool can_swap_out(SeqId seq) const;
  // Moves `seq` to the host pool (see the header comment); tokens / n_computed as for free().
  // Returns the copies to do, in table order, before any later copy or pass writes the device
  // blocks (they are free from here on). KESTREL_ASSERT unless can_swap_out.
  std::vector<BlockSwap> swap_out(SeqId seq, std::span<const int32_t> tokens, int64_t n_computed);
  // Whether swap_in(seq) and then append(seq, ..., n_tokens) find enough device blocks.
  bool can_swap_in(SeqId seq, int64_t n_tokens) const;
  // Brings swapped `seq` back: fresh device blocks for its host blocks, which become free. Returns
  // the copies to do before the next pass reads them. KESTREL_ASSERT unless swapped and there are
  // enough free blocks for its held entries.
  std::vector<BlockSwap> swap_in(SeqId seq);
  // Ends swapped `seq`: its host blocks become free.
  void free_swapped(SeqId seq);
  int32_t n_swap_blocks() const { return n_swap_blocks_; }
  int32_t n_free_swap_blocks() const { return static_cast<int32_t>(swap_free_.size()); }
  int64_t n_swapped_out_blocks() const { return n_swapped_out_; }  // blocks copied to the host so far
  int64_t n_swapped_in_blocks() const { return n_swapped_in_; }    // blocks copied back so far

  // --- host tier of the prefix cache ---
  // Device -> host copies of evicted cached blocks queued since the last call, in eviction order.
  // The caller issues them before any copy or pass of the step writes device blocks (the evicted
  // blocks are handed out again). Clears the queue.
  std::vector<BlockSwap> take_offloads();
  // Host -> device copies of host-tier hits queued since the last call; the caller issues them
  // after take_offloads()' copies of their destination blocks (a hit may take a block just
  // evicted) and before the pass that reads them. Clears the queue and unpins
  // the host blocks they read.
  std::vector<BlockSwap> take_loads();
  const HostBlockTier& host_tier() const { return tier_; }
  int64_t n_offloaded_blocks() const { return n_offloaded_; }      // device -> host copies queued so far
  int64_t n_offload_hit_blocks() const { return n_offload_hits_; }  // host -> device copies queued so far

  // --- counters ---
  int32_t block_size() const { return block_size_; }
  int32_t n_blocks() const { return pool_.n_blocks(); }
  int32_t n_free_blocks() const { return pool_.n_free(); }      // free + evictable cached
  int32_t n_used_blocks() const { return pool_.n_in_use(); }    // held by sequences
  int32_t n_cached_blocks() const { return pool_.n_cached(); }  // indexed in the prefix cache
  size_t n_seqs() const { return seqs_.size(); }
  int64_t prefix_queried_tokens() const { return n_queried_; }  // tokens looked up by allocate
  int64_t prefix_hit_tokens() const { return n_hit_; }          // of those, found in the cache
  int64_t n_evictions() const { return pool_.n_evictions(); }
  bool prefix_caching() const { return caching_; }
  // Pool invariants plus: every reference is held by exactly the tables that list the block, and
  // every host block is either free or in exactly one swapped table.
  void check_invariants() const;

 private:
  struct SeqBlocks {
    std::vector<int32_t> blocks;
    int64_t n_released = 0;  // leading entries that are kNoBlock
    // Chain hash of each leading block already offered to the prefix cache (their count is the
    // number published); truncate drops the ones that reach past the new end.
    std::vector<uint64_t> hashes;
  };
  struct PrefixHit {
    std::vector<int32_t> blocks;  // device blocks of the leading hits
    std::vector<int32_t> host;    // host tier blocks of the hits after them
    std::vector<uint64_t> hashes;  // [blocks.size() + host.size()]
  };
  // pool_.commit(), then the evicted blocks' keys go to the host tier (queued offloads).
  std::vector<int32_t> commit(const PoolChange& change);
  PrefixHit find_prefix(std::span<const int32_t> tokens) const;
  // Leading blocks of a hit of n_hit blocks that a sequence with this lookback does not read.
  int64_t hits_before_window(int64_t n_hit, int64_t lookback) const;
  // Adds the held (not kNoBlock) entries of s.blocks[begin, end) to `release`, last first.
  static void release_held(const SeqBlocks& s, size_t begin, size_t end, std::vector<int32_t>& release);
  int64_t blocks_for(int64_t n_tokens) const { return (n_tokens + block_size_ - 1) / block_size_; }
  // Whether a write into `block` needs a private copy first: another sequence holds it, or the
  // prefix cache can hand it out (its K/V belong to the tokens of its key).
  bool needs_copy(int32_t block) const { return pool_.ref_count(block) > 1 || pool_.is_indexed(block); }
  // Blocks among [n_computed, n_tokens)'s blocks that needs_copy.
  int64_t n_copies_needed(const SeqBlocks& s, int64_t n_computed, int64_t n_tokens) const;
  void plan_publish(SeqBlocks& s, std::span<const int32_t> tokens, int64_t n_computed, PoolChange& change) const;

  int32_t block_size_;
  bool caching_;
  BlockPool pool_;
  std::unordered_map<SeqId, SeqBlocks> seqs_;
  int64_t n_queried_ = 0, n_hit_ = 0;
  int32_t n_swap_blocks_ = 0;
  std::vector<int32_t> swap_free_;                  // stack of free host blocks
  std::unordered_map<SeqId, SeqBlocks> swapped_;    // tables of host blocks
  int64_t n_swapped_out_ = 0, n_swapped_in_ = 0;
  HostBlockTier tier_;
  std::vector<BlockSwap> offloads_, loads_;
  int64_t n_offloaded_ = 0, n_offload_hits_ = 0;
};

}  // namespace kestrel
