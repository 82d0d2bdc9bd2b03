// KvManager and BlockPool: allocation, growth, prefix caching (hash chain, LRU eviction, counters),
// fork with copy-on-write, truncate (rollback), and that every commit leaves the pool consistent.
#include <gtest/gtest.h>

#include <map>
#include <numeric>
#include <random>

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

TEST(KvManager, TruncateReturnsTheBlocksPastTheNewEnd) {
  KvManager kv({16, 4, false});
  const auto t = iota_tokens(14);
  kv.allocate(1, t, 14);  // 4 blocks
  const std::vector<int32_t> table = kv.block_table(1);
  ASSERT_EQ(table.size(), 4u);
  EXPECT_EQ(kv.n_free_blocks(), 12);
  EXPECT_EQ(kv.capacity(1), 16);
  kv.truncate(1, 9);  // mid-block: position 8 keeps block 2
  EXPECT_EQ(kv.block_table(1), std::vector<int32_t>(table.begin(), table.begin() + 3));
  EXPECT_EQ(kv.n_free_blocks(), 13);
  kv.check_invariants();
  kv.truncate(1, 8);  // a block boundary: block 2 goes
  EXPECT_EQ(kv.block_table(1), std::vector<int32_t>(table.begin(), table.begin() + 2));
  EXPECT_EQ(kv.n_free_blocks(), 14);
  kv.truncate(1, 8);  // nothing past the end: no change
  EXPECT_EQ(kv.n_free_blocks(), 14);
  kv.check_invariants();
  // Growing again takes the released blocks back in their old order (released last block first).
  std::vector<BlockCopy> copies;
  ASSERT_TRUE(kv.can_append(1, 8, 14));
  kv.append(1, t, 8, 14, copies);
  EXPECT_TRUE(copies.empty());
  EXPECT_EQ(kv.block_table(1), table);
  EXPECT_EQ(kv.n_free_blocks(), 12);
  // Outside [0, capacity] or an unknown sequence: an assertion, nothing changes.
  EXPECT_THROW(kv.truncate(1, 17), Error);
  EXPECT_THROW(kv.truncate(1, -1), Error);
  EXPECT_THROW(kv.truncate(2, 0), Error);
  EXPECT_EQ(kv.block_table(1), table);
  EXPECT_EQ(kv.n_free_blocks(), 12);
  // To 0: the sequence stays, with no blocks, and grows again from position 0.
  kv.truncate(1, 0);
  EXPECT_TRUE(kv.has(1));
  EXPECT_TRUE(kv.block_table(1).empty());
  EXPECT_EQ(kv.n_free_blocks(), 16);
  kv.append(1, t, 0, 5, copies);
  EXPECT_EQ(kv.block_table(1).size(), 2u);
  EXPECT_EQ(kv.n_free_blocks(), 14);
  kv.check_invariants();
  kv.free(1);
  EXPECT_EQ(kv.n_free_blocks(), 16);
  kv.check_invariants();
}

TEST(KvManager, TruncatingOneSideOfAForkLeavesTheOtherIntact) {
  KvManager kv({8, 4, false});
  const auto t = iota_tokens(10);
  kv.allocate(1, t, 10);  // 3 blocks
  kv.fork(1, 2);
  const std::vector<int32_t> parent = kv.block_table(1);
  kv.truncate(2, 5);  // the child keeps blocks 0 and 1, still shared
  EXPECT_EQ(kv.block_table(1), parent);
  EXPECT_EQ(kv.block_table(2), std::vector<int32_t>(parent.begin(), parent.begin() + 2));
  EXPECT_EQ(kv.n_used_blocks(), 3);  // block 2 is still the parent's
  EXPECT_EQ(kv.n_free_blocks(), 5);
  kv.check_invariants();  // ref counts: 2, 2, 1
  // The child rewrites positions [5, 10): a copy of shared block 1, a fresh block 2.
  std::vector<int32_t> u(t.begin(), t.begin() + 5);
  for (int32_t x : {900, 901, 902, 903, 904}) u.push_back(x);
  std::vector<BlockCopy> copies;
  ASSERT_TRUE(kv.can_append(2, 5, 10));
  kv.append(2, u, 5, 10, copies);
  ASSERT_EQ(copies.size(), 1u);
  EXPECT_EQ(copies[0].src, parent[1]);
  const std::vector<int32_t> child = kv.block_table(2);
  ASSERT_EQ(child.size(), 3u);
  EXPECT_EQ(copies[0].dst, child[1]);
  EXPECT_EQ(child[0], parent[0]);
  EXPECT_NE(child[1], parent[1]);
  EXPECT_NE(child[2], parent[2]);
  EXPECT_EQ(kv.block_table(1), parent);
  EXPECT_EQ(kv.n_used_blocks(), 5);
  kv.check_invariants();
  // The parent lets go of everything; only the block it shared loses a reference.
  kv.truncate(1, 0);
  EXPECT_EQ(kv.block_table(2), child);
  EXPECT_EQ(kv.n_used_blocks(), 3);
  kv.check_invariants();
  kv.free(2);
  kv.free(1);
  EXPECT_EQ(kv.n_free_blocks(), 8);
  kv.check_invariants();
}

TEST(KvManager, TruncateIntoAPublishedBlockCopiesItBeforeRewriting) {
  KvManager kv({4, 4, true});
  const auto a = iota_tokens(10);
  kv.allocate(1, a, 10);  // 3 blocks, 1 free
  std::vector<BlockCopy> copies;
  kv.append(1, a, 10, 10, copies);  // a[0, 10) computed: publishes blocks 0 and 1
  EXPECT_EQ(kv.n_cached_blocks(), 2);
  const std::vector<int32_t> old = kv.block_table(1);
  kv.truncate(1, 6);  // cuts block 1 after a[4, 6); block 2 goes
  ASSERT_EQ(kv.block_table(1).size(), 2u);
  EXPECT_EQ(kv.n_free_blocks(), 2);
  EXPECT_EQ(kv.n_cached_blocks(), 2);  // block 1 still holds a[4, 8)'s K/V
  std::vector<int32_t> b(a.begin(), a.begin() + 6);
  for (int32_t x : {900, 901, 902, 903, 904}) b.push_back(x);
  // Writing position 6 needs a copy of block 1 though no other sequence holds it: blocks to 12
  // cost 1 new + 1 copy = 2 free blocks, to 13 cost 3.
  EXPECT_TRUE(kv.can_append(1, 6, 12));
  EXPECT_FALSE(kv.can_append(1, 6, 13));
  kv.append(1, b, 6, 11, copies);
  ASSERT_EQ(copies.size(), 1u);
  EXPECT_EQ(copies[0].src, old[1]);
  EXPECT_EQ(copies[0].dst, kv.block_table(1)[1]);
  EXPECT_EQ(kv.block_table(1)[0], old[0]);
  kv.check_invariants();
  // The original tokens still find both original blocks; the new ones only the first so far.
  EXPECT_EQ(kv.cached_prefix_len(a), 8);
  EXPECT_EQ(kv.cached_prefix_len(b), 4);
  // b[0, 11) computed: the copy is published under b's tokens.
  copies.clear();
  kv.append(1, b, 11, 12, copies);
  EXPECT_TRUE(copies.empty());
  EXPECT_EQ(kv.n_cached_blocks(), 3);
  EXPECT_EQ(kv.cached_prefix_len(b), 8);
  const int32_t b_block = kv.block_table(1)[1];
  kv.free(1, b, 11);
  kv.check_invariants();
  const std::vector<int32_t> a9(a.begin(), a.begin() + 9), b9(b.begin(), b.begin() + 9);
  EXPECT_EQ(kv.allocate(2, a9, 8), 8);
  EXPECT_EQ(kv.block_table(2), (std::vector<int32_t>{old[0], old[1]}));
  EXPECT_EQ(kv.allocate(3, b9, 8), 8);
  EXPECT_EQ(kv.block_table(3), (std::vector<int32_t>{old[0], b_block}));
  kv.check_invariants();
}

TEST(KvManager, TruncateAtABoundaryKeepsThePublishedTailCached) {
  KvManager kv({8, 4, true});
  const auto a = iota_tokens(9);
  kv.allocate(1, a, 9);
  std::vector<BlockCopy> copies;
  kv.append(1, a, 9, 9, copies);  // publishes blocks 0 and 1
  const std::vector<int32_t> old = kv.block_table(1);
  kv.truncate(1, 4);  // blocks 1 and 2 go; block 1 stays cached, evictable
  EXPECT_EQ(kv.n_free_blocks(), 7);
  EXPECT_EQ(kv.n_cached_blocks(), 2);
  EXPECT_EQ(kv.cached_prefix_len(a), 8);
  std::vector<int32_t> b(a.begin(), a.begin() + 4);
  for (int32_t x : {900, 901, 902, 903, 904}) b.push_back(x);
  ASSERT_TRUE(kv.can_append(1, 4, 9));
  kv.append(1, b, 4, 9, copies);
  EXPECT_TRUE(copies.empty());  // block 1 of the table is a fresh block, not the cached one
  EXPECT_NE(kv.block_table(1)[1], old[1]);
  kv.append(1, b, 9, 9, copies);
  EXPECT_EQ(kv.cached_prefix_len(a), 8);
  EXPECT_EQ(kv.cached_prefix_len(b), 8);
  EXPECT_EQ(kv.n_cached_blocks(), 3);
  kv.free(1);
  EXPECT_EQ(kv.n_free_blocks(), 8);
  kv.check_invariants();
}

TEST(KvManager, BlocksRepublishedAfterTruncateChainToTheNewTokens) {
  KvManager kv({16, 4, true});
  const auto a = iota_tokens(9);
  kv.allocate(1, a, 9);
  std::vector<BlockCopy> copies;
  kv.append(1, a, 9, 9, copies);  // publishes a[0, 4) and a[4, 8)
  kv.truncate(1, 5);
  std::vector<int32_t> b(a.begin(), a.begin() + 5);
  for (int32_t x : {900, 901, 902, 903, 904, 905, 906}) b.push_back(x);  // 12 tokens
  kv.append(1, b, 5, 12, copies);
  kv.append(1, b, 12, 12, copies);  // b[0, 12) computed: blocks 1 and 2 published under b's chain
  EXPECT_EQ(kv.n_cached_blocks(), 4);
  auto b13 = b;
  b13.push_back(1);
  EXPECT_EQ(kv.cached_prefix_len(b13), 12);
  // a's first 8 tokens followed by b's third block: that block's K/V were computed after b[4, 8),
  // not a[4, 8), so only a's two blocks may hit.
  std::vector<int32_t> c(a.begin(), a.begin() + 8);
  c.insert(c.end(), b.begin() + 8, b.end());
  c.push_back(1);
  EXPECT_EQ(kv.cached_prefix_len(c), 8);
  kv.free(1);
  kv.check_invariants();
}

// Random allocate/append/truncate/fork/free against a model of the K/V each slot holds: every
// live sequence must read, at each computed position, what a forward pass over its own tokens
// wrote (so no write ever reached a block that another sequence or a prefix hit reads), and the
// pool must end with every block free.
TEST(KvManager, RandomRollbacksKeepEveryReaderCorrectAndLeakNoBlock) {
  constexpr int32_t kBlocks = 24, kBs = 4;
  KvManager kv({kBlocks, kBs, true});
  std::mt19937 rng(1234);
  auto pick = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  // K/V at a position stand for a hash of the tokens up to it.
  auto kv_value = [](const std::vector<int32_t>& t, int64_t pos) {
    uint64_t h = 1469598103934665603ull;
    for (int64_t i = 0; i <= pos; ++i) h = (h ^ static_cast<uint32_t>(t[static_cast<size_t>(i)])) * 1099511628211ull;
    return h;
  };
  std::vector<uint64_t> slots(static_cast<size_t>(kBlocks * kBs), 0);
  auto slot = [&](SeqId id, int64_t pos) -> uint64_t& {
    return slots[static_cast<size_t>(kv.block_table(id)[static_cast<size_t>(pos / kBs)] * kBs + pos % kBs)];
  };
  std::vector<std::vector<int32_t>> prompts(3);
  for (auto& p : prompts)
    for (int i = 0; i < 48; ++i) p.push_back(static_cast<int32_t>(pick(1, 1000)));
  struct Model {
    std::vector<int32_t> tokens;
    int64_t n_computed = 0;  // == the slots asked for: every scheduled position is written at once
    size_t prompt = 0;
  };
  std::map<SeqId, Model> live;
  SeqId next_id = 1;
  auto apply = [&](const std::vector<BlockCopy>& copies) {
    for (const BlockCopy& c : copies)
      for (int32_t i = 0; i < kBs; ++i)
        slots[static_cast<size_t>(c.dst * kBs + i)] = slots[static_cast<size_t>(c.src * kBs + i)];
  };
  auto forward = [&](SeqId id, int64_t from, int64_t to) {
    for (int64_t pos = from; pos < to; ++pos) slot(id, pos) = kv_value(live[id].tokens, pos);
    live[id].n_computed = to;
  };
  // Draft-like tokens: mostly the prompt's continuation (so blocks recur), else a small vocabulary.
  auto extend = [&](Model& m, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
      const size_t pos = m.tokens.size();
      m.tokens.push_back(pick(0, 2) != 0 && pos < prompts[m.prompt].size() ? prompts[m.prompt][pos]
                                                                             : static_cast<int32_t>(pick(1, 3)));
    }
  };
  int64_t n_truncates = 0, n_copies = 0, n_hits = 0;
  for (int op = 0; op < 1000 && !HasFailure(); ++op) {
    const int64_t kind = pick(0, 9);
    std::vector<BlockCopy> copies;
    if (kind <= 1 && live.size() < 6) {  // admit a prompt prefix
      Model m;
      m.prompt = static_cast<size_t>(pick(0, 2));
      m.tokens.assign(prompts[m.prompt].begin(), prompts[m.prompt].begin() + pick(1, 24));
      const auto n = static_cast<int64_t>(m.tokens.size());
      if (!kv.can_allocate(m.tokens, n)) continue;
      const SeqId id = next_id++;
      live[id] = m;
      const int64_t n_hit = kv.allocate(id, m.tokens, n);
      n_hits += n_hit;
      for (int64_t pos = 0; pos < n_hit; ++pos) ASSERT_EQ(slot(id, pos), kv_value(m.tokens, pos)) << "op " << op;
      forward(id, n_hit, n);
    } else if (live.empty()) {
      continue;
    } else {
      auto it = live.begin();
      std::advance(it, pick(0, static_cast<int64_t>(live.size()) - 1));
      const SeqId id = it->first;
      Model& m = it->second;
      if (kind <= 5) {  // a step of 1 + up to 4 draft tokens
        const int64_t end = m.n_computed + pick(1, 5);
        if (!kv.can_append(id, m.n_computed, end)) continue;
        extend(m, end - static_cast<int64_t>(m.tokens.size()));
        kv.append(id, m.tokens, m.n_computed, end, copies);
        n_copies += static_cast<int64_t>(copies.size());
        apply(copies);
        forward(id, m.n_computed, end);
      } else if (kind <= 7) {  // reject a tail
        const int64_t n = pick(0, m.n_computed);
        kv.truncate(id, n);
        m.tokens.resize(static_cast<size_t>(n));
        m.n_computed = n;
        ++n_truncates;
        ASSERT_EQ(kv.capacity(id), (n + kBs - 1) / kBs * kBs);
      } else if (kind == 8 && live.size() < 6) {
        kv.fork(id, next_id);
        live[next_id++] = m;
      } else if (kind == 9) {
        if (pick(0, 1) != 0) kv.free(id, m.tokens, m.n_computed);
        else kv.free(id);
        live.erase(id);
      }
    }
    kv.check_invariants();
    for (const auto& [id, m] : live)
      for (int64_t pos = 0; pos < m.n_computed; ++pos)
        ASSERT_EQ(slot(id, pos), kv_value(m.tokens, pos)) << "op " << op << ", sequence " << id << ", position " << pos;
  }
  for (const auto& [id, m] : live) kv.free(id, m.tokens, m.n_computed);
  kv.check_invariants();
  EXPECT_EQ(kv.n_free_blocks(), kBlocks);
  EXPECT_EQ(kv.n_used_blocks(), 0);
  // The run exercised what it is meant to: rollbacks, copy-on-write and prefix hits.
  EXPECT_GT(n_truncates, 100);
  EXPECT_GT(n_copies, 10);
  EXPECT_GT(n_hits, 100);
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
