// CPU element-wise ops (ops.h) on each SIMD table this CPU has: GeGLU's GELU against float64, and
// attention of a sub-group of query heads giving the same bits as inside the whole group (a row's
// bits do not depend on the rows sharing its call).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <iterator>
#include <random>
#include <vector>

#include "backend/cpu/ops.h"
#include "core/cpu_features.h"
#include "core/dtype.h"

namespace kestrel::cpu {
namespace {

std::vector<const OpsTable*> tables() {
  std::vector<const OpsTable*> t = {&ops_generic()};
  if (simd_level() >= SimdLevel::Avx2) t.push_back(&ops_avx2());
  if (simd_level() >= SimdLevel::Avx512) t.push_back(&ops_avx512());
  return t;
}

TEST(CpuOps, GeluMulMatchesFloat64TanhFormula) {
  // 203 values: the vector body and a scalar tail; normal activations, large ones of both signs
  // (where 1 + tanh cancels for negative x), and zero.
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  std::vector<float> gate(203), up(203);
  for (size_t i = 0; i < gate.size(); ++i) {
    gate[i] = nd(rng);
    up[i] = nd(rng);
  }
  const float extremes[] = {0.0f, -0.0f, 30.0f, -30.0f, 1e4f, -1e4f, -5.5f, 5.5f, 1e-6f, -1e-6f};
  for (size_t i = 0; i < std::size(extremes); ++i) gate[8 * i + 3] = extremes[i];
  gate[200] = -9.0f;  // in the scalar tail
  for (const OpsTable* t : tables()) {
    std::vector<float> out(gate.size(), NAN);
    t->gelu_mul(gate.data(), up.data(), out.data(), static_cast<int64_t>(gate.size()));
    for (size_t i = 0; i < gate.size(); ++i) {
      // 0.5 x (1 + tanh(u)) in the form x / (1 + exp(-2u)), equal in exact arithmetic, so float64
      // keeps its relative accuracy where 1 + tanh(u) underflows for large negative x.
      const double x = gate[i];
      const double u = 0.7978845608028654 * (x + 0.044715 * x * x * x);
      const double want = x / (1.0 + std::exp(-2.0 * u)) * up[i];
      EXPECT_NEAR(out[i], want, 2e-6 * std::abs(want) + 1e-30) << "x " << x << " up " << up[i];
    }
  }
}

TEST(CpuAttention, QueryGroupSplitGivesTheSameBits) {
  // Gemma 3 270M's shape: one KV head for 4 query heads, head_dim 256, f16 cache.
  constexpr int64_t kBlockSize = 16, kHeadDim = 256, kGroup = 4, kCtx = 37, kBlocks = 4;
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<uint16_t> k(kBlocks * kBlockSize * kHeadDim), v(k.size());
  for (auto& x : k) x = fp32_to_fp16(nd(rng));
  for (auto& x : v) x = fp32_to_fp16(nd(rng));
  std::vector<float> q(kGroup * kHeadDim);
  for (float& x : q) x = nd(rng);
  const std::vector<int32_t> table = {2, 0, 3};
  for (const OpsTable* t : tables()) {
    auto run = [&](int64_t first, int64_t n, float* out) {
      AttentionArgs a{};
      a.q = q.data() + first * kHeadDim;
      a.k_cache = k.data();
      a.v_cache = v.data();
      a.kv_dtype = KvDtype::F16;
      a.block_stride = kBlockSize * kHeadDim;
      a.head_offset = 0;
      a.block_table = table.data();
      a.block_size = static_cast<int32_t>(kBlockSize);
      const int64_t n_ctx = kCtx, kv_begin = 5;
      a.n_ctx = &n_ctx;
      a.kv_begin = &kv_begin;
      a.head_dim = kHeadDim;
      a.group = n;
      a.scale = 0.0625f;
      a.out = out + first * kHeadDim;
      t->attention(a);
    };
    std::vector<float> whole(q.size()), halves(q.size()), singles(q.size());
    run(0, kGroup, whole.data());
    for (int64_t h = 0; h < kGroup; h += 2) run(h, 2, halves.data());
    for (int64_t h = 0; h < kGroup; ++h) run(h, 1, singles.data());
    EXPECT_EQ(std::memcmp(whole.data(), halves.data(), whole.size() * 4), 0);
    EXPECT_EQ(std::memcmp(whole.data(), singles.data(), whole.size() * 4), 0);
    // Not trivially equal: the heads' outputs differ from each other.
    EXPECT_NE(whole[0], whole[kHeadDim]);
  }
}

}  // namespace
}  // namespace kestrel::cpu
