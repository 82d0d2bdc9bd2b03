// The host tier of the prefix cache: HostBlockTier against a plain model of its state (LRU order,
// pins, keys), and KvManager with the tier under random admissions, steps, rollbacks, forks and
// frees, with simulated device and host K/V whose values reveal any copy that is missing,
// misordered or aimed at the wrong block.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <set>

#include "core/error.h"
#include "memory/host_block_tier.h"
#include "memory/kv_manager.h"

namespace kestrel {
namespace {

BlockKey key_of(std::vector<int32_t> tokens, uint64_t parent = 0) {
  BlockKey k;
  k.parent_hash = parent;
  k.hash = block_hash(parent, tokens);
  k.tokens = std::move(tokens);
  return k;
}

TEST(HostBlockTier, RandomOperationsMatchAModelOfLruAndPins) {
  constexpr int32_t kBlocks = 8, kFirst = 5;  // ids 5..12, as after a swap pool of 5 blocks
  HostBlockTier tier(kBlocks, kFirst);
  std::mt19937 rng(99);
  auto pick = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  // The model: held keys (by token) least recently used first, their host ids, and the pins.
  std::vector<int32_t> lru;
  std::map<int32_t, int32_t> host_of;
  std::set<int32_t> pinned;
  int64_t n_inserted = 0, n_dropped = 0, n_refused = 0;
  for (int op = 0; op < 1000 && !HasFailure(); ++op) {
    const int64_t kind = pick(0, 29);  // unpins are rare, so every block is sometimes pinned
    const auto t = static_cast<int32_t>(pick(0, 11));
    if (kind <= 13) {  // insert
      const int32_t h = tier.insert(key_of({t}));
      if (host_of.count(t)) {
        ASSERT_EQ(h, -1) << "op " << op << ": a held key is not copied again";
        lru.erase(std::find(lru.begin(), lru.end(), t));
        lru.push_back(t);
      } else if (static_cast<int32_t>(host_of.size()) < kBlocks) {
        ASSERT_GE(h, kFirst);
        ASSERT_LT(h, kFirst + kBlocks);
        for (const auto& [other, id] : host_of) ASSERT_NE(id, h) << "op " << op << ": a held block handed out";
        host_of[t] = h;
        lru.push_back(t);
        ++n_inserted;
      } else {
        const auto victim = std::find_if(lru.begin(), lru.end(), [&](int32_t k) { return !pinned.count(k); });
        if (victim == lru.end()) {
          ASSERT_EQ(h, -1) << "op " << op << ": every block pinned";
          ++n_refused;
        } else {
          ASSERT_EQ(h, host_of[*victim]) << "op " << op << ": drops the least recently used unpinned block";
          host_of.erase(*victim);
          lru.erase(victim);
          host_of[t] = h;
          lru.push_back(t);
          ++n_inserted;
          ++n_dropped;
        }
      }
    } else if (kind <= 28) {  // a prefix hit: lookup, then pin
      const BlockKey k = key_of({t});
      const int32_t h = tier.lookup(k.hash, k.parent_hash, k.tokens);
      ASSERT_EQ(h, host_of.count(t) ? host_of[t] : -1) << "op " << op;
      if (h >= 0) {
        tier.pin(h);
        pinned.insert(t);
        lru.erase(std::find(lru.begin(), lru.end(), t));
        lru.push_back(t);
      }
    } else {
      tier.unpin_all();
      pinned.clear();
    }
    tier.check_invariants();
    ASSERT_EQ(tier.n_held(), static_cast<int32_t>(host_of.size()));
    ASSERT_EQ(tier.n_dropped(), n_dropped);
    for (int32_t u = 0; u < 12; ++u) {  // every key, held or not
      const BlockKey k = key_of({u});
      ASSERT_EQ(tier.lookup(k.hash, k.parent_hash, k.tokens), host_of.count(u) ? host_of[u] : -1);
      // Same hash chain position, other parent: a miss.
      ASSERT_EQ(tier.lookup(k.hash, k.parent_hash + 1, k.tokens), -1);
    }
  }
  EXPECT_GT(n_inserted, 100);
  EXPECT_GT(n_dropped, 50);
  EXPECT_GT(n_refused, 0);
}

TEST(HostBlockTier, InsertAllFollowsTheDeviceOrderAndKeepsTheLastEvicted) {
  HostBlockTier tier(8, 10);
  const std::vector<BlockKey> keys = {key_of({1}), key_of({2}), key_of({3})};
  const std::vector<int32_t> got = tier.insert_all(keys, std::vector<int32_t>{7, 3, 5});
  EXPECT_EQ(got, (std::vector<int32_t>{12, 10, 11}));  // host ids ascend with the device ids
  HostBlockTier small(2, 0);
  const std::vector<int32_t> kept = small.insert_all(keys, std::vector<int32_t>{0, 1, 2});
  EXPECT_EQ(kept, (std::vector<int32_t>{-1, 0, 1}));  // room for two: the first evicted is left out
  small.check_invariants();
  EXPECT_EQ(small.lookup(keys[0].hash, 0, keys[0].tokens), -1);
  EXPECT_EQ(small.lookup(keys[2].hash, 0, keys[2].tokens), 1);
}

TEST(HostBlockTier, BadSizesAreAnError) {
  EXPECT_THROW(HostBlockTier(-1, 0), Error);
  EXPECT_THROW(HostBlockTier(4, -2), Error);
  HostBlockTier none(0, 0);
  EXPECT_EQ(none.insert(key_of({1})), -1);
}

TEST(KvManagerOffload, RandomOperationsKeepEveryReaderCorrectAndLeakNoBlock) {
  constexpr int32_t kBlocks = 16, kBs = 4, kSwap = 3, kOffload = 10;
  KvManager kv({kBlocks, kBs, true, kSwap, kOffload});
  std::mt19937 rng(4321);
  auto pick = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  // K/V at a position stand for a hash of the tokens up to it.
  auto kv_value = [](const std::vector<int32_t>& t, int64_t pos) {
    uint64_t h = 1469598103934665603ull;
    for (int64_t i = 0; i <= pos; ++i) h = (h ^ static_cast<uint32_t>(t[static_cast<size_t>(i)])) * 1099511628211ull;
    return h;
  };
  std::vector<uint64_t> device(static_cast<size_t>(kBlocks * kBs), 0);
  std::vector<uint64_t> host(static_cast<size_t>((kSwap + kOffload) * kBs), 0);
  auto slot = [&](SeqId id, int64_t pos) -> uint64_t& {
    return device[static_cast<size_t>(kv.block_table(id)[static_cast<size_t>(pos / kBs)] * kBs + pos % kBs)];
  };
  auto copy = [&](const std::vector<uint64_t>& from, int32_t src, std::vector<uint64_t>& to, int32_t dst) {
    for (int32_t i = 0; i < kBs; ++i) to[static_cast<size_t>(dst * kBs + i)] = from[static_cast<size_t>(src * kBs + i)];
  };
  // A step's copies in the engine's order: offloads, copy-on-write copies, loads.
  int64_t n_offloads = 0, n_loads = 0;
  auto run_copies = [&](const std::vector<BlockCopy>& copies) {
    const std::vector<BlockSwap> offloads = kv.take_offloads();
    for (const BlockSwap& s : offloads) {
      ASSERT_GE(s.host, kSwap) << "offload into the swap pool's ids";
      copy(device, s.device, host, s.host);
    }
    for (const BlockCopy& c : copies) copy(device, c.src, device, c.dst);
    const std::vector<BlockSwap> loads = kv.take_loads();
    for (const BlockSwap& s : loads) copy(host, s.host, device, s.device);
    n_offloads += static_cast<int64_t>(offloads.size());
    n_loads += static_cast<int64_t>(loads.size());
  };
  std::vector<std::vector<int32_t>> prompts(5);
  for (auto& p : prompts)
    for (int i = 0; i < 40; ++i) p.push_back(static_cast<int32_t>(pick(1, 1000)));
  struct Model {
    std::vector<int32_t> tokens;
    int64_t n_computed = 0;
    size_t prompt = 0;
  };
  std::map<SeqId, Model> live;
  SeqId next_id = 1;
  auto forward = [&](SeqId id, int64_t from, int64_t to) {
    for (int64_t pos = from; pos < to; ++pos) slot(id, pos) = kv_value(live[id].tokens, pos);
    live[id].n_computed = to;
  };
  int64_t n_hits = 0, n_truncates = 0;
  for (int op = 0; op < 1000 && !HasFailure(); ++op) {
    const int64_t kind = pick(0, 9);
    std::vector<BlockCopy> copies;
    if (kind <= 2 && live.size() < 3) {  // admit a prompt prefix
      Model m;
      m.prompt = static_cast<size_t>(pick(0, 4));
      m.tokens.assign(prompts[m.prompt].begin(), prompts[m.prompt].begin() + pick(1, 40));
      const auto n = static_cast<int64_t>(m.tokens.size());
      const int64_t n_cached = kv.cached_prefix_len(m.tokens);
      if (!kv.can_allocate(m.tokens, n)) continue;
      const SeqId id = next_id++;
      live[id] = m;
      const int64_t n_hit = kv.allocate(id, m.tokens, n);
      ASSERT_EQ(n_hit, n_cached) << "op " << op;
      run_copies(copies);
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
      if (kind <= 5) {  // a step of 1 + up to 3 draft tokens, the prompt's continuation
        const int64_t end = m.n_computed + pick(1, 4);
        if (!kv.can_append(id, m.n_computed, end)) continue;
        for (auto pos = static_cast<int64_t>(m.tokens.size()); pos < end; ++pos)
          m.tokens.push_back(pos < 40 ? prompts[m.prompt][static_cast<size_t>(pos)] : static_cast<int32_t>(pick(1, 3)));
        kv.append(id, m.tokens, m.n_computed, end, copies);
        run_copies(copies);
        forward(id, m.n_computed, end);
      } else if (kind == 6) {  // reject a tail
        const int64_t n = pick(0, m.n_computed);
        kv.truncate(id, n);
        m.tokens.resize(static_cast<size_t>(n));
        m.n_computed = n;
        ++n_truncates;
      } else if (kind == 7 && live.size() < 3) {
        kv.fork(id, next_id);
        live[next_id++] = m;
      } else {
        kv.free(id, m.tokens, m.n_computed);
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
  EXPECT_EQ(kv.n_free_swap_blocks(), kSwap);
  EXPECT_EQ(kv.n_offloaded_blocks(), n_offloads);
  EXPECT_EQ(kv.n_offload_hit_blocks(), n_loads);
  EXPECT_LE(kv.host_tier().n_held(), kOffload);
  // The run exercised the tier: evictions offloaded, hits brought back, rollbacks.
  EXPECT_GT(n_offloads, 50);
  EXPECT_GT(n_loads, 50);
  EXPECT_GT(n_hits, 200);
  EXPECT_GT(n_truncates, 50);
}

TEST(KvManagerOffload, AnEvictedPrefixComesBackFromTheHostTier) {
  // 4 device blocks of 2 tokens; a 7-token prompt publishes 3 blocks, another evicts them.
  KvManager kv({4, 2, true, 0, 8});
  const std::vector<int32_t> a = {1, 2, 3, 4, 5, 6, 7}, b = {9, 9, 8, 8, 7, 7, 6};
  kv.allocate(1, a, 7);
  kv.free(1, a, 7);
  EXPECT_EQ(kv.take_offloads().size(), 0u);
  kv.allocate(2, b, 7);  // takes all 4 blocks: the 3 cached ones are evicted
  const std::vector<BlockSwap> offloads = kv.take_offloads();
  ASSERT_EQ(offloads.size(), 3u);
  kv.free(2, b, 7);
  EXPECT_EQ(kv.cached_prefix_len(a), 6);  // 3 blocks, all in the host tier now
  kv.allocate(3, a, 7);
  const std::vector<BlockSwap> loads = kv.take_loads();
  ASSERT_EQ(loads.size(), 3u);
  // Each block comes back, in table order, from the host block its key was offloaded to; free()
  // released the blocks last first, so they were evicted (and offloaded) in reverse table order.
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(loads[i].device, kv.block_table(3)[i]);
    EXPECT_EQ(loads[i].host, offloads[2 - i].host);
  }
  EXPECT_EQ(kv.n_offload_hit_blocks(), 3);
  EXPECT_EQ(kv.prefix_hit_tokens(), 6);
  kv.check_invariants();
}

}  // namespace
}  // namespace kestrel
