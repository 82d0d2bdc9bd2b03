// KvManager under sliding-window attention: release_before drops whole blocks before the window
// (entries kNoBlock), publishes them first when asked, is idempotent; allocate's lookback skips
// prefix-cache hits before the window; fork, truncate, append and free handle the leading holes;
// the forward batch accepts holes only before the first key a token reads.
#include <gtest/gtest.h>

#include <numeric>
#include <string>
#include <vector>

#include "core/error.h"
#include "memory/kv_manager.h"
#include "model/forward_batch.h"

namespace kestrel {
namespace {

std::vector<int32_t> iota_tokens(int32_t n, int32_t start = 100) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  std::iota(t.begin(), t.end(), start);
  return t;
}

constexpr int32_t kNo = KvManager::kNoBlock;

TEST(KvManager, ReleaseBeforeFreesWholeBlocksOnly) {
  KvManager kv({/*n_blocks=*/8, /*block_size=*/4, /*prefix caching=*/false});
  const auto t = iota_tokens(20);
  kv.allocate(1, t, 14);  // [0,4) [4,8) [8,12) [12,14)
  const std::vector<int32_t> table = kv.block_table(1);
  EXPECT_EQ(kv.n_free_blocks(), 4);
  EXPECT_EQ(kv.first_held(1), 0);
  EXPECT_EQ(kv.release_before(1, 3), 0);  // block 0 still holds position 3
  EXPECT_EQ(kv.release_before(1, 7), 1);  // block 1 holds 7: only block 0 goes
  EXPECT_EQ(kv.n_free_blocks(), 5);
  EXPECT_EQ(kv.block_table(1), (std::vector<int32_t>{kNo, table[1], table[2], table[3]}));
  EXPECT_EQ(kv.first_held(1), 4);
  kv.check_invariants();
  // Idempotent, and a smaller position changes nothing.
  EXPECT_EQ(kv.release_before(1, 7), 0);
  EXPECT_EQ(kv.release_before(1, 2), 0);
  EXPECT_EQ(kv.n_free_blocks(), 5);
  EXPECT_EQ(kv.release_before(1, 12), 2);
  EXPECT_EQ(kv.block_table(1), (std::vector<int32_t>{kNo, kNo, kNo, table[3]}));
  EXPECT_EQ(kv.n_free_blocks(), 7);
  // The partial last block stays however far first_needed reaches into it.
  EXPECT_EQ(kv.release_before(1, 13), 0);
  EXPECT_EQ(kv.first_held(1), 12);
  kv.check_invariants();
  // The sequence grows on after the holes, and free returns exactly the held blocks.
  std::vector<BlockCopy> copies;
  ASSERT_TRUE(kv.can_append(1, 14, 20));
  kv.append(1, t, 14, 20, copies);
  EXPECT_TRUE(copies.empty());
  EXPECT_EQ(kv.block_table(1).size(), 5u);
  EXPECT_EQ(kv.n_free_blocks(), 6);
  kv.check_invariants();
  kv.free(1, t, 20);
  EXPECT_EQ(kv.n_free_blocks(), 8);
  EXPECT_EQ(kv.n_used_blocks(), 0);
  kv.check_invariants();
}

TEST(KvManager, ReleasedComputedBlocksStayInThePrefixCache) {
  KvManager kv({8, 4, true});
  const auto t = iota_tokens(14);
  kv.allocate(1, t, 14);
  // 13 tokens computed, in one prefill step: blocks 0..2 are full and computed but not yet
  // published (append publishes them only at the next step); release_before publishes first.
  EXPECT_EQ(kv.n_cached_blocks(), 0);
  EXPECT_EQ(kv.release_before(1, 9, t, 13), 2);
  EXPECT_EQ(kv.n_cached_blocks(), 3);  // blocks 0, 1 (released) and 2 (held)
  EXPECT_EQ(kv.n_used_blocks(), 2);
  EXPECT_EQ(kv.n_free_blocks(), 6);   // the two released ones are evictable
  EXPECT_EQ(kv.cached_prefix_len(t), 12);
  kv.check_invariants();
  // A later sequence with the same prefix may take the hits back (no window) ...
  EXPECT_EQ(kv.allocate(2, t, 14), 12);
  EXPECT_EQ(kv.n_used_blocks(), 5);  // seq 1's blocks 2 and 3, the revived 0 and 1, a new last block
  kv.check_invariants();
  kv.free(2, t, 13);
  // ... or, looking back 4 positions, only those from 12 + 1 - 4 = 9 on: block 2.
  EXPECT_EQ(kv.n_used_blocks(), 2);
  ASSERT_TRUE(kv.can_allocate(t, 14, true, /*lookback=*/4));
  EXPECT_EQ(kv.allocate(3, t, 14, true, 4), 12);
  const std::vector<int32_t>& b3 = kv.block_table(3);
  ASSERT_EQ(b3.size(), 4u);
  EXPECT_EQ(b3[0], kNo);
  EXPECT_EQ(b3[1], kNo);
  EXPECT_EQ(b3[2], kv.block_table(1)[2]);
  EXPECT_EQ(kv.first_held(3), 8);
  EXPECT_EQ(kv.n_used_blocks(), 3);  // seq 1's 2 (block 2 shared) + seq 3's new last block
  kv.check_invariants();
}

TEST(KvManager, ForkTruncateAndFreeSkipReleasedBlocks) {
  KvManager kv({8, 4, false});
  const auto t = iota_tokens(16);
  kv.allocate(1, t, 16);
  EXPECT_EQ(kv.release_before(1, 8), 2);
  kv.fork(1, 2);
  EXPECT_EQ(kv.block_table(2), kv.block_table(1));
  EXPECT_EQ(kv.n_used_blocks(), 2);  // blocks 2, 3 shared
  kv.check_invariants();
  // Rolling back into a released block cannot be done; to its first held block can.
  EXPECT_THROW(kv.truncate(2, 8), Error);
  kv.truncate(2, 9);
  EXPECT_EQ(kv.block_table(2).size(), 3u);
  EXPECT_EQ(kv.n_used_blocks(), 2);  // block 3 still held by sequence 1
  std::vector<BlockCopy> copies;
  EXPECT_THROW(kv.append(2, t, 4, 9, copies), Error);  // a write into a released block
  kv.truncate(2, 0);
  EXPECT_TRUE(kv.block_table(2).empty());
  EXPECT_EQ(kv.first_held(2), 0);
  kv.check_invariants();
  kv.free(2);
  kv.free(1);
  EXPECT_EQ(kv.n_free_blocks(), 8);
  kv.check_invariants();
}

// One sequence of context 12 in blocks of 4 whose table starts with a released block; its one token
// sits at position 11.
struct HoleBatch {
  std::vector<int32_t> ids{5}, pos{11}, qs{0, 1}, ctx{12}, table{kNoBlock, 3, 4}, rows{0};
  std::vector<int64_t> slots{4 * 4 + 3};
  ForwardBatch view() const {
    ForwardBatch b;
    b.token_ids = ids;
    b.positions = pos;
    b.slot_mapping = slots;
    b.query_start = qs;
    b.context_lens = ctx;
    b.block_tables = table;
    b.max_blocks_per_seq = 3;
    b.logits_indices = rows;
    return b;
  }
};

std::string test_error(const HoleBatch& h, int64_t lookback) {
  try {
    validate_forward_batch(h.view(), 100, 8, 4, lookback);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(ForwardBatch, ReleasedBlocksOnlyBeforeTheFirstKeyRead) {
  HoleBatch h;
  // Lookback 8: position 11 reads keys 4..11, blocks 1 and 2.
  EXPECT_NO_THROW(validate_forward_batch(h.view(), 100, 8, 4, 8));
  // Lookback 9 reads key 3, in the released block; no lookback (full attention) reads it too.
  EXPECT_NE(test_error(h, 9).find("block 0 of sequence 0 is released"), std::string::npos);
  EXPECT_NE(test_error(h, 0).find("released"), std::string::npos);
  h.table = {-2, 3, 4};
  EXPECT_NE(test_error(h, 8).find("block id -2 outside the KV cache"), std::string::npos);
}

}  // namespace
}  // namespace kestrel
