// The CPU attention kernel (ops.h AttentionArgs) on each SIMD path this CPU has, against a float64
// softmax over the same keys: the paged layout with scattered blocks, GQA groups, and a first key
// (a sliding window's start) at and inside block boundaries; query tiles of several tokens, and
// the bits of a row whatever shares its call, however its keys are split (split-KV) and on however
// many threads (paged_attention).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "backend/cpu/ops.h"
#include "backend/cpu/paged_attention.h"
#include "core/cpu_features.h"
#include "core/dtype.h"
#include "core/thread_pool.h"
#include "memory/kv_cache.h"
#include "int8_kv_query.h"

namespace kestrel::cpu {
namespace {

TEST(CpuAttention, KeysFromKvBeginMatchFloat64Softmax) {
  constexpr int64_t kBlockSize = 4, kHeadDim = 16, kKvHeads = 2, kGroup = 3, kCtx = 13, kBlocks = 6;
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  // [kBlocks, kKvHeads, kBlockSize, kHeadDim]; the sequence's blocks scattered over the pool.
  std::vector<float> k(kBlocks * kKvHeads * kBlockSize * kHeadDim), v(k.size()), q(kGroup * kHeadDim);
  for (float& x : k) x = nd(rng);
  for (float& x : v) x = nd(rng);
  for (float& x : q) x = nd(rng);
  const std::vector<int32_t> table = {4, 1, 5, 0};  // positions 0-3 in block 4, 4-7 in block 1, ...
  const int64_t kvh = 1;
  const float scale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));
  auto key = [&](const std::vector<float>& c, int64_t pos) {
    return c.data() + ((table[pos / kBlockSize] * kKvHeads + kvh) * kBlockSize + pos % kBlockSize) * kHeadDim;
  };
  std::vector<const OpsTable*> tables = {&ops_generic()};
  if (simd_level() >= SimdLevel::Avx2) tables.push_back(&ops_avx2());
  if (simd_level() >= SimdLevel::Avx512) tables.push_back(&ops_avx512());
  for (const OpsTable* t : tables)
    for (int64_t begin : {0, 3, 4, 5, 8, 12}) {
      std::vector<float> out(kGroup * kHeadDim, -1.0f);
      AttentionArgs a{};
      a.q = q.data();
      a.k_cache = k.data();
      a.v_cache = v.data();
      a.kv_dtype = KvDtype::F32;
      a.block_stride = kKvHeads * kBlockSize * kHeadDim;
      a.head_offset = kvh * kBlockSize * kHeadDim;
      a.block_table = table.data();
      a.block_size = static_cast<int32_t>(kBlockSize);
      const int64_t n_ctx = kCtx;
      a.n_ctx = &n_ctx;
      a.kv_begin = &begin;
      a.head_dim = kHeadDim;
      a.group = kGroup;
      a.scale = scale;
      a.out = out.data();
      t->attention(a);
      for (int64_t g = 0; g < kGroup; ++g) {
        std::vector<double> s;
        double mx = -INFINITY, sum = 0;
        for (int64_t pos = begin; pos < kCtx; ++pos) {
          double d = 0;
          for (int64_t i = 0; i < kHeadDim; ++i) d += static_cast<double>(q[g * kHeadDim + i]) * key(k, pos)[i];
          s.push_back(d * scale);
          mx = std::max(mx, s.back());
        }
        for (double& x : s) sum += (x = std::exp(x - mx));
        for (int64_t i = 0; i < kHeadDim; ++i) {
          double want = 0;
          for (int64_t pos = begin; pos < kCtx; ++pos) want += s[pos - begin] / sum * key(v, pos)[i];
          EXPECT_NEAR(out[g * kHeadDim + i], want, 1e-5) << "kv_begin " << begin << " head " << g << " dim " << i;
        }
      }
    }
}

std::vector<const OpsTable*> tables() {
  std::vector<const OpsTable*> t = {&ops_generic()};
  if (simd_level() >= SimdLevel::Avx2) t.push_back(&ops_avx2());
  if (simd_level() >= SimdLevel::Avx512) t.push_back(&ops_avx512());
  return t;
}

// One layer of a paged cache of one sequence, n_ctx keys of n_head_kv heads written from N(0, 1)
// values through the runner's conversions, its blocks scattered in reverse order; the stored values
// read back in float64 for the reference.
struct Cache {
  int64_t hd, n_head_kv = 2;
  int32_t bs;
  KvCache kv;
  std::vector<int32_t> table;
  std::vector<double> k, v;  // [n_ctx, n_head_kv, hd]: what the cache holds, as values
  Cache(int64_t head_dim, int32_t block_size, int64_t n_ctx, KvDtype dtype, uint32_t seed)
      : hd(head_dim), bs(block_size), kv(1, 2, head_dim, block_size, static_cast<int32_t>((n_ctx + block_size - 1) / block_size), dtype) {
    table.resize(static_cast<size_t>(kv.n_blocks()));
    std::iota(table.rbegin(), table.rend(), 0);
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> row(static_cast<size_t>(hd));
    std::vector<uint16_t> h(row.size());
    for (int64_t pos = 0; pos < n_ctx; ++pos)
      for (int64_t head = 0; head < n_head_kv; ++head)
        for (int part = 0; part < 2; ++part) {
          for (float& x : row) x = nd(rng);
          const int64_t slot = table[static_cast<size_t>(pos / bs)] * int64_t{bs} + pos % bs;
          const int64_t off = kv.offset(slot, head);
          void* base = part == 0 ? kv.k(0) : kv.v(0);
          std::vector<double>& dst = part == 0 ? k : v;
          for (int64_t i = 0; i < hd; ++i) {
            double x = row[static_cast<size_t>(i)];
            if (dtype == KvDtype::F16) x = fp16_to_fp32(fp32_to_fp16(row[static_cast<size_t>(i)]));
            dst.push_back(x);
          }
          if (dtype == KvDtype::F32) {
            std::memcpy(static_cast<float*>(base) + off, row.data(), sizeof(float) * row.size());
          } else if (dtype == KvDtype::F16) {
            ops_generic().f32_to_f16(row.data(), static_cast<uint16_t*>(base) + off, hd);
          } else {
            int8_t* codes = static_cast<int8_t*>(base) + off;
            const float sc = quantize_row_int8(row.data(), codes, hd);
            (part == 0 ? kv.k_scale(0) : kv.v_scale(0))[off / hd] = sc;
            for (int64_t i = 0; i < hd; ++i) dst[dst.size() - static_cast<size_t>(hd - i)] = codes[i] * static_cast<double>(sc);
          }
        }
  }
  AttentionArgs layer(int64_t group) const {
    AttentionArgs a{};
    a.k_cache = kv.k(0);
    a.v_cache = kv.v(0);
    a.kv_dtype = kv.dtype();
    a.k_scale = kv.k_scale(0);
    a.v_scale = kv.v_scale(0);
    a.block_stride = n_head_kv * bs * hd;
    a.block_table = table.data();
    a.block_size = bs;
    a.head_dim = hd;
    a.group = group;
    a.scale = 1.0f / std::sqrt(static_cast<float>(hd));
    return a;
  }
  // Softmax attention in float64 of query row q (KV head `head`) over keys [begin, end).
  // INT8: q rounded to 16 bits first, as the kernels do (quantize_query_q16).
  std::vector<double> reference(const float* q_row, int64_t head, int64_t begin, int64_t end, double scale) const {
    const std::vector<double> q =
        kv.dtype() == KvDtype::INT8 ? test::int8_kv_query(q_row, hd) : std::vector<double>(q_row, q_row + hd);
    std::vector<double> s, out(static_cast<size_t>(hd), 0.0);
    double mx = -INFINITY, sum = 0;
    for (int64_t pos = begin; pos < end; ++pos) {
      double d = 0;
      for (int64_t i = 0; i < hd; ++i) d += q[static_cast<size_t>(i)] * k[static_cast<size_t>((pos * n_head_kv + head) * hd + i)];
      s.push_back(d * scale);
      mx = std::max(mx, s.back());
    }
    for (double& x : s) sum += (x = std::exp(x - mx));
    for (int64_t pos = begin; pos < end; ++pos)
      for (int64_t i = 0; i < hd; ++i)
        out[static_cast<size_t>(i)] += s[static_cast<size_t>(pos - begin)] / sum * v[static_cast<size_t>((pos * n_head_kv + head) * hd + i)];
    return out;
  }
};

struct Shape {
  int64_t head_dim;
  int32_t block_size;
  KvDtype dtype;
};

// 11 consecutive query tokens (3 heads per KV head) at the end of a 300-key context, which crosses
// two chunk boundaries (kAttentionChunk = 128), causal, with and without a 150-key window: one call
// for all tokens against float64, and bit for bit against each token alone and against the chunks
// computed one by one (attention_chunks) and merged (attention_merge).
TEST(CpuAttention, QueryTileMatchesFloat64AndEachRowAloneAndSplitKv) {
  constexpr int64_t kCtx = 300, kTokens = 11, kGroup = 3;
  for (const Shape sh : {Shape{64, 16, KvDtype::F16}, Shape{40, 24, KvDtype::F32}, Shape{19, 5, KvDtype::F32},
                         Shape{64, 16, KvDtype::INT8}, Shape{80, 16, KvDtype::F16}, Shape{128, 32, KvDtype::F16},
                         Shape{24, 8, KvDtype::F16}, Shape{96, 16, KvDtype::INT8}, Shape{256, 16, KvDtype::INT8}}) {
    const Cache c(sh.head_dim, sh.block_size, kCtx, sh.dtype, 3);
    const int64_t hd = sh.head_dim, q_stride = c.n_head_kv * kGroup * hd;
    std::mt19937 rng(5);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> q(static_cast<size_t>(kTokens * q_stride));
    for (float& x : q) x = nd(rng);
    for (const int64_t window : {int64_t{0}, int64_t{150}}) {
      std::vector<int64_t> n_ctx(kTokens), begin(kTokens);
      for (int64_t t = 0; t < kTokens; ++t) {
        n_ctx[static_cast<size_t>(t)] = kCtx - kTokens + t + 1;
        begin[static_cast<size_t>(t)] = window > 0 ? n_ctx[static_cast<size_t>(t)] - window : 0;
      }
      for (const OpsTable* t : tables())
        for (int64_t head = 0; head < c.n_head_kv; ++head) {
          SCOPED_TRACE("head_dim " + std::to_string(hd) + " block " + std::to_string(sh.block_size) + " dtype " +
                       std::string(kv_dtype_name(sh.dtype)) + " window " + std::to_string(window));
          AttentionArgs a = c.layer(kGroup);
          a.head_offset = head * sh.block_size * hd;
          a.q = q.data() + head * kGroup * hd;
          a.q_stride = q_stride;
          a.out_stride = kGroup * hd;
          a.n_tokens = kTokens;
          a.n_ctx = n_ctx.data();
          a.kv_begin = begin.data();
          std::vector<float> tile(static_cast<size_t>(kTokens * kGroup * hd), NAN), alone(tile.size(), NAN),
              split(tile.size(), NAN);
          a.out = tile.data();
          t->attention(a);
          for (int64_t i = 0; i < kTokens; ++i) {
            AttentionArgs one = a;
            one.n_tokens = 1;
            one.q = a.q + i * q_stride;
            one.n_ctx = n_ctx.data() + i;
            one.kv_begin = begin.data() + i;
            one.out = alone.data() + i * kGroup * hd;
            t->attention(one);
          }
          const int64_t chunks = attention_chunk_count(a);
          ASSERT_EQ(chunks, window > 0 ? 2 : 3);
          std::vector<float> states(static_cast<size_t>(chunks * attention_state_floats(a)));
          for (int64_t ch = chunks - 1; ch >= 0; --ch)  // any order: each chunk's state stands alone
            t->attention_chunks(a, ch, ch + 1, states.data() + ch * attention_state_floats(a));
          a.out = split.data();
          t->attention_merge(a, chunks, states.data());
          EXPECT_EQ(std::memcmp(tile.data(), alone.data(), tile.size() * sizeof(float)), 0);
          EXPECT_EQ(std::memcmp(tile.data(), split.data(), tile.size() * sizeof(float)), 0);
          for (int64_t i = 0; i < kTokens; ++i)
            for (int64_t g = 0; g < kGroup; ++g) {
              const size_t ti = static_cast<size_t>(i);
              const std::vector<double> want =
                  c.reference(q.data() + i * q_stride + (head * kGroup + g) * hd, head, begin[ti], n_ctx[ti], a.scale);
              for (int64_t d = 0; d < hd; ++d)
                ASSERT_NEAR(tile[static_cast<size_t>((i * kGroup + g) * hd + d)], want[static_cast<size_t>(d)], 2e-5)
                    << "token " << i << " head " << g << " dim " << d;
            }
        }
    }
  }
}

// paged_attention over a batch of two sequences (a 40-token prefill chunk after 200 cached keys and
// one decode token after 250), on one and two threads, gives each row the bits it gets alone: the
// decode token alone takes the split-KV path, in the batch the whole-range one.
TEST(CpuAttention, PagedAttentionRowsDoNotDependOnTheBatchOrThreads) {
  constexpr int64_t kHd = 64, kGroup = 3, kHeads = 2;
  const Cache c0(kHd, 16, 240, KvDtype::F16, 8), c1(kHd, 16, 251, KvDtype::F16, 9);
  ASSERT_EQ(c0.kv.n_blocks(), 15);
  // One pool: sequence 0 in blocks [0, 15), sequence 1 in blocks [15, 31) (c1's rows copied there).
  KvCache kv(1, kHeads, kHd, 16, 31, KvDtype::F16);
  const size_t block_bytes = static_cast<size_t>(kHeads * 16 * kHd) * sizeof(uint16_t);
  std::memcpy(kv.k(0), c0.kv.k(0), 15 * block_bytes);
  std::memcpy(kv.v(0), c0.kv.v(0), 15 * block_bytes);
  std::memcpy(static_cast<std::byte*>(kv.k(0)) + 15 * block_bytes, c1.kv.k(0), 16 * block_bytes);
  std::memcpy(static_cast<std::byte*>(kv.v(0)) + 15 * block_bytes, c1.kv.v(0), 16 * block_bytes);
  std::vector<int32_t> tables(2 * 16, 0);
  for (size_t i = 0; i < 15; ++i) tables[i] = c0.table[i];
  for (size_t i = 0; i < 16; ++i) tables[16 + i] = 15 + c1.table[i];
  const int64_t q_dim = kHeads * kGroup * kHd;
  std::mt19937 rng(4);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> q(static_cast<size_t>(41 * q_dim));
  for (float& x : q) x = nd(rng);
  std::vector<int64_t> n_ctx(41), begin(41, 0);
  for (int64_t t = 0; t < 40; ++t) n_ctx[static_cast<size_t>(t)] = 200 + t + 1;
  n_ctx[40] = 251;
  AttentionArgs layer = c0.layer(kGroup);
  layer.k_cache = kv.k(0);
  layer.v_cache = kv.v(0);
  auto run = [&](int threads, int64_t seq_first, int64_t n_seqs, std::vector<float>& out) {
    ThreadPool pool(threads);
    std::vector<float> states;
    const int32_t all_starts[3] = {0, 40, 41};
    std::vector<int32_t> starts(all_starts + seq_first, all_starts + seq_first + n_seqs + 1);
    const AttentionBatch b{n_seqs, starts.data(), tables.data() + seq_first * 16, 16, n_ctx.data(), begin.data(),
                           q.data(), q_dim, out.data(), q_dim, kHeads, 16 * kHd};
    paged_attention(pool, layer, b, states);
  };
  for (int threads : {1, 2}) {
    std::vector<float> both(q.size(), NAN), apart(q.size(), NAN);
    run(threads, 0, 2, both);
    run(1, 0, 1, apart);
    run(threads, 1, 1, apart);
    EXPECT_EQ(std::memcmp(both.data(), apart.data(), both.size() * sizeof(float)), 0) << threads << " threads";
    // And right: the decode token against float64.
    for (int64_t h = 0; h < kHeads * kGroup; ++h) {
      const std::vector<double> want = c1.reference(q.data() + 40 * q_dim + h * kHd, h / kGroup, 0, 251, layer.scale);
      for (int64_t d = 0; d < kHd; ++d) ASSERT_NEAR(both[static_cast<size_t>(40 * q_dim + h * kHd + d)], want[static_cast<size_t>(d)], 2e-5);
    }
  }
}

}  // namespace
}  // namespace kestrel::cpu
