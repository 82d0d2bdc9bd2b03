// The CPU attention kernel (ops.h AttentionArgs) on each SIMD path this CPU has, against a float64
// softmax over the same keys: the paged layout with scattered blocks, GQA groups, and a first key
// (a sliding window's start) at and inside block boundaries.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "backend/cpu/ops.h"
#include "core/cpu_features.h"

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
      a.n_ctx = kCtx;
      a.kv_begin = begin;
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

}  // namespace
}  // namespace kestrel::cpu
