// KvManager and BlockPool: allocation, growth, prefix caching (hash chain, LRU eviction, counters),
// fork with copy-on-write, and that every commit leaves the pool consistent.
#include <gtest/gtest.h>

#include <numeric>

#include "core/error.h"
#include "memory/kv_manager.h"

namespace kestrel {
namespace {

std::vector<int32_t> iota_tokens(int32_t n, int32_t start = 100) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  std::iota(t.begin(), t.end(), start);
  return t;
}

TEST(KvManager, AllocateAppendFreeReturnsEveryBlock) {
  KvManager kv({/*n_blocks=*/8, /*block_size=*/4, /*prefix caching=*/false});
  const auto t = iota_tokens(10);
  ASSERT_TRUE(kv.can_allocate(t, 6));
  EXPECT_EQ(kv.allocate(1, t, 6), 0);
  EXPECT_EQ(kv.block_table(1).size(), 2u);
  EXPECT_EQ(kv.n_free_blocks(), 6);
  std::vector<BlockCopy> copies;
  ASSERT_TRUE(kv.can_append(1, 6, 10));
  kv.append(1, t, 6, 10, copies);
  EXPECT_TRUE(copies.empty());
  EXPECT_EQ(kv.block_table(1).size(), 3u);
  EXPECT_FALSE(kv.can_append(1, 10, 33));  // 9 blocks > 8
  EXPECT_TRUE(kv.can_append(1, 10, 32));
  kv.check_invariants();
  kv.free(1);
  EXPECT_EQ(kv.n_free_blocks(), 8);
  EXPECT_EQ(kv.n_used_blocks(), 0);
  EXPECT_FALSE(kv.has(1));
  kv.check_invariants();
}

TEST(KvManager, CannotAllocateBeyondThePool) {
  KvManager kv({4, 4, false});
  const auto t = iota_tokens(20);
  EXPECT_TRUE(kv.can_allocate(t, 16));
  EXPECT_FALSE(kv.can_allocate(t, 17));
  kv.allocate(1, t, 12);
  EXPECT_FALSE(kv.can_allocate(t, 5));
  EXPECT_TRUE(kv.can_allocate(t, 4));
  EXPECT_THROW(kv.allocate(2, t, 8), Error);  // broken precondition: an assertion, nothing changes
  kv.check_invariants();
  EXPECT_EQ(kv.n_free_blocks(), 1);
}

TEST(KvManager, BadConfigIsAnError) {
  EXPECT_THROW(KvManager({0, 16, true}), Error);
  EXPECT_THROW(KvManager({8, 0, true}), Error);
}

TEST(KvManager, ComputedFullBlocksAreReusedByALaterSequence) {
  KvManager kv({16, 4, true});
  const auto a = iota_tokens(10);  // blocks [0..4) [4..8) and a partial [8..10)
  EXPECT_EQ(kv.cached_prefix_len(a), 0);
  EXPECT_EQ(kv.allocate(1, a, 10), 0);
  // Nothing is published before its K/V are computed.
  std::vector<int32_t> b = a;
  b[9] = 7;
  EXPECT_EQ(kv.cached_prefix_len(b), 0);
  std::vector<BlockCopy> copies;
  kv.append(1, a, /*n_computed=*/10, 11, copies);  // a decode step after the prompt
  EXPECT_EQ(kv.n_cached_blocks(), 2);
  EXPECT_EQ(kv.cached_prefix_len(b), 8);
  const std::vector<int32_t> table_a = kv.block_table(1);
  EXPECT_EQ(kv.allocate(2, b, 10), 8);
  EXPECT_EQ(kv.block_table(2)[0], table_a[0]);
  EXPECT_EQ(kv.block_table(2)[1], table_a[1]);
  EXPECT_NE(kv.block_table(2)[2], table_a[2]);
  EXPECT_EQ(kv.prefix_queried_tokens(), 20);
  EXPECT_EQ(kv.prefix_hit_tokens(), 8);
  kv.check_invariants();
  // A different first block breaks the chain even though the second block's tokens match.
  std::vector<int32_t> c = a;
  c[0] = 5;
  EXPECT_EQ(kv.cached_prefix_len(c), 0);
  kv.free(1);
  kv.free(2);
  // Freed cached blocks stay indexed and count as free.
  EXPECT_EQ(kv.n_free_blocks(), 16);
  EXPECT_EQ(kv.n_cached_blocks(), 2);
  EXPECT_EQ(kv.cached_prefix_len(a), 8);
  kv.check_invariants();
}

TEST(KvManager, NeverReportsTheWholePromptAsCached) {
  KvManager kv({16, 4, true});
  const auto a = iota_tokens(8);
  kv.allocate(1, a, 8);
  kv.free(1, a, 8);  // publishes both full blocks on the way out
  EXPECT_EQ(kv.n_cached_blocks(), 2);
  EXPECT_EQ(kv.cached_prefix_len(a), 4);  // the last token must still run to give logits
  auto longer = iota_tokens(9);
  EXPECT_EQ(kv.cached_prefix_len(longer), 8);
}

TEST(KvManager, EvictsLeastRecentlyReleasedFirst) {
  KvManager kv({4, 2, true});
  const auto a = iota_tokens(3, 0), b = iota_tokens(3, 50);
  kv.allocate(1, a, 3);
  kv.free(1, a, 3);  // block of a[0..2) cached, released first
  kv.allocate(2, b, 3);
  kv.free(2, b, 3);  // block of b[0..2) cached, released later
  EXPECT_EQ(kv.n_cached_blocks(), 2);
  // Taking 3 fresh blocks uses the 2 plain free ones and evicts a's block (the oldest).
  const auto c = iota_tokens(6, 200);
  kv.allocate(3, c, 6);
  EXPECT_EQ(kv.n_evictions(), 1);
  EXPECT_EQ(kv.cached_prefix_len(a), 0);
  EXPECT_EQ(kv.cached_prefix_len(b), 2);
  kv.check_invariants();
  // A hit on an evictable block takes it out of the free count.
  EXPECT_EQ(kv.n_free_blocks(), 1);
  EXPECT_TRUE(kv.can_allocate(b, 2));
  EXPECT_FALSE(kv.can_allocate(b, 3));  // the hit block plus one fresh block: 2 > 1 free
}

TEST(KvManager, PrefixCachingOffNeverHits) {
  KvManager kv({8, 4, false});
  const auto a = iota_tokens(9);
  kv.allocate(1, a, 9);
  kv.free(1, a, 9);
  EXPECT_EQ(kv.cached_prefix_len(a), 0);
  EXPECT_EQ(kv.n_cached_blocks(), 0);
  EXPECT_EQ(kv.allocate(2, a, 9), 0);
  EXPECT_EQ(kv.prefix_queried_tokens(), 0);
}

TEST(KvManager, ForkSharesBlocksAndCopiesOnWrite) {
  KvManager kv({8, 4, true});
  const auto a = iota_tokens(6);  // one full block, one with 2 of 4 slots used
  kv.allocate(1, a, 6);
  kv.fork(1, 2);
  EXPECT_EQ(kv.block_table(2), kv.block_table(1));
  EXPECT_EQ(kv.n_used_blocks(), 2);
  kv.check_invariants();
  std::vector<BlockCopy> copies;
  // The child writes position 6, inside the shared partial block: it gets a private copy.
  ASSERT_TRUE(kv.can_append(2, 6, 7));
  kv.append(2, a, 6, 7, copies);
  ASSERT_EQ(copies.size(), 1u);
  EXPECT_EQ(copies[0].src, kv.block_table(1)[1]);
  EXPECT_EQ(copies[0].dst, kv.block_table(2)[1]);
  EXPECT_EQ(kv.block_table(2)[0], kv.block_table(1)[0]);  // the full block stays shared
  // Now the parent's partial block is its own: no copy.
  copies.clear();
  kv.append(1, a, 6, 7, copies);
  EXPECT_TRUE(copies.empty());
  kv.check_invariants();
  kv.free(1);
  kv.free(2);
  EXPECT_EQ(kv.n_free_blocks(), 8);
  kv.check_invariants();
}

TEST(KvManager, ForkWithoutFreeBlockCannotAppend) {
  KvManager kv({2, 4, false});
  const auto a = iota_tokens(6);
  kv.allocate(1, a, 6);
  kv.fork(1, 2);
  EXPECT_FALSE(kv.can_append(2, 6, 7));  // the copy needs a block and none is free
  EXPECT_TRUE(kv.can_append(2, 8, 8));   // nothing left to write in the shared blocks
}

TEST(BlockPool, HashChainDependsOnParentAndTokens) {
  const std::vector<int32_t> x{1, 2, 3, 4}, y{1, 2, 3, 5};
  EXPECT_EQ(block_hash(0, x), block_hash(0, x));
  EXPECT_NE(block_hash(0, x), block_hash(0, y));
  EXPECT_NE(block_hash(0, x), block_hash(block_hash(0, y), x));
  EXPECT_NE(block_hash(0, x), 0u);
}

TEST(BlockPool, LookupComparesTokensNotJustTheHash) {
  BlockPool pool(2);
  PoolChange take;
  take.n_take = 1;
  const int32_t b = pool.commit(take)[0];
  PoolChange pub;
  BlockKey key{block_hash(0, std::vector<int32_t>{1, 2}), 0, {1, 2}};
  const uint64_t h = key.hash;
  pub.publish.emplace_back(b, std::move(key));
  pool.commit(pub);
  EXPECT_EQ(pool.lookup(h, 0, std::vector<int32_t>{1, 2}), b);
  EXPECT_EQ(pool.lookup(h, 0, std::vector<int32_t>{1, 3}), -1);  // same hash forced, other tokens
  EXPECT_EQ(pool.lookup(h, 9, std::vector<int32_t>{1, 2}), -1);  // other parent
  pool.check_invariants();
}

}  // namespace
}  // namespace kestrel
