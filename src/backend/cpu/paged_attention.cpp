#include "backend/cpu/paged_attention.h"

#include <algorithm>
#include <atomic>

namespace kestrel::cpu {

namespace {

struct Item {
  int64_t seq, t0, n_tokens, kv_head;
  int64_t cost;        // keys x rows read, to order the items
  int64_t chunks = 0;  // split-KV: chunks of the item's key range
  int64_t state = 0;   // split-KV: offset of its first chunk's state
  int64_t unit = 0;    // split-KV: index of its first chunk among all items' chunks
};

// Runs fn(i) for i in [0, n), each index claimed by the next free thread.
template <class Fn>
void for_each_dynamic(ThreadPool& pool, int64_t n, const Fn& fn) {
  std::atomic<int64_t> next{0};
  pool.run([&](int, int) {
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) fn(i);
  });
}

}  // namespace

void paged_attention(ThreadPool& pool, const AttentionArgs& layer, const AttentionBatch& b, std::vector<float>& states) {
  const int64_t group = layer.group, hd = layer.head_dim;
  const int64_t vd = layer.v_dim > 0 ? layer.v_dim : hd;
  const int64_t tile_tokens = std::max<int64_t>(1, kQueryTileRows / group);
  std::vector<Item> items;
  for (int64_t s = 0; s < b.n_seqs; ++s)
    for (int64_t t0 = b.query_start[s]; t0 < b.query_start[s + 1]; t0 += tile_tokens) {
      const int64_t nt = std::min<int64_t>(tile_tokens, b.query_start[s + 1] - t0);
      int64_t keys = 0;
      for (int64_t t = t0; t < t0 + nt; ++t) keys += std::max<int64_t>(0, b.n_ctx[t] - b.kv_begin[t]);
      for (int64_t h = 0; h < b.n_head_kv; ++h) items.push_back({s, t0, nt, h, keys * group});
    }
  std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.cost > y.cost; });
  const auto args = [&](const Item& it) {
    AttentionArgs a = layer;
    a.q = b.q + it.t0 * b.q_stride + it.kv_head * group * hd;
    a.q_stride = b.q_stride;
    a.n_tokens = it.n_tokens;
    a.n_ctx = b.n_ctx + it.t0;
    a.kv_begin = b.kv_begin + it.t0;
    a.head_offset = layer.head_offset + it.kv_head * b.head_stride;
    a.block_table = b.block_tables + it.seq * b.max_blocks_per_seq;
    a.out = b.out + it.t0 * b.out_stride + it.kv_head * group * vd;
    a.out_stride = b.out_stride;
    return a;
  };
  const OpsTable& op = ops();
  const int64_t n_items = static_cast<int64_t>(items.size());
  int64_t units = 0, floats = 0;
  if (n_items < 4 * pool.size())
    for (Item& it : items) {
      const AttentionArgs a = args(it);
      it.chunks = attention_chunk_count(a);
      it.unit = units;
      it.state = floats;
      units += it.chunks;
      floats += it.chunks * attention_state_floats(a);
    }
  if (units <= n_items) {  // no item has two chunks to split (or enough items): one call each
    for_each_dynamic(pool, n_items, [&](int64_t i) { op.attention(args(items[static_cast<size_t>(i)])); });
    return;
  }
  if (static_cast<int64_t>(states.size()) < floats) states.resize(static_cast<size_t>(floats));
  // unit -> item: items in order of their first unit.
  for_each_dynamic(pool, units, [&](int64_t u) {
    const auto it = std::upper_bound(items.begin(), items.end(), u, [](int64_t x, const Item& y) { return x < y.unit; }) - 1;
    const AttentionArgs a = args(*it);
    const int64_t c = u - it->unit;
    op.attention_chunks(a, c, c + 1, states.data() + it->state + c * attention_state_floats(a));
  });
  for_each_dynamic(pool, n_items, [&](int64_t i) {
    const Item& it = items[static_cast<size_t>(i)];
    op.attention_merge(args(it), it.chunks, states.data() + it.state);
  });
}

}  // namespace kestrel::cpu
