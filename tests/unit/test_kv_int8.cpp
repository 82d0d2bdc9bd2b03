// The INT8 KV cache of the CPU backend: KvCache's storage (bytes per token equal to the planner's,
// scales copied with their block), the row quantizer (ops.h quantize_row_int8) and the attention
// kernel reading int8 codes with per-row scales, on each SIMD path this CPU has: against a float64
// softmax over the dequantized codes (the kernel's own arithmetic, so a tight bound) and against
// the same attention over the unquantized f32 rows (a bound derived from the quantization step).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "backend/cpu/ops.h"
#include "core/cpu_features.h"
#include "memory/kv_cache.h"
#include "memory/kv_planner.h"
#include "int8_kv_query.h"

namespace kestrel {
namespace {

std::vector<const cpu::OpsTable*> tables() {
  std::vector<const cpu::OpsTable*> t = {&cpu::ops_generic()};
  if (simd_level() >= SimdLevel::Avx2) t.push_back(&cpu::ops_avx2());
  if (simd_level() >= SimdLevel::Avx512) t.push_back(&cpu::ops_avx512());
  return t;
}

// Llama-2-7B-like layers (32 KV heads of 128) and DeepSeek-V2's MLA row (latent 512, RoPE key 64).
TEST(KvCacheInt8, BytesPerTokenEqualThePlanners) {
  KvGeometry standard;
  standard.n_layer = 3;
  standard.n_head_kv = 32;
  standard.head_dim = 128;
  KvGeometry mla;
  mla.n_layer = 3;
  mla.kv_lora_rank = 512;
  mla.rope_dim = 64;
  for (const KvGeometry& g : {standard, mla}) {
    const KvCache kv(g, 16, 2, KvDtype::INT8);
    EXPECT_EQ(kv.bytes_per_token(), kv_bytes_per_token(g, KvDtype::INT8));
    EXPECT_EQ(kv.bytes_total(), 32 * kv.bytes_per_token());
  }
  // Per layer: 2 x 32 rows of (128 codes + a 4-byte scale); MLA: 576 codes and two scales.
  EXPECT_EQ(KvCache(standard, 16, 2, KvDtype::INT8).bytes_per_token(), 3 * 2 * 32 * (128 + 4));
  EXPECT_EQ(KvCache(mla, 16, 2, KvDtype::INT8).bytes_per_token(), 3 * (576 + 8));
  // The float types are unchanged: no scales.
  EXPECT_EQ(KvCache(standard, 16, 2, KvDtype::F16).bytes_per_token(), kv_bytes_per_token(standard, KvDtype::F16));
  EXPECT_EQ(KvCache(mla, 16, 2, KvDtype::F32).bytes_per_token(), kv_bytes_per_token(mla, KvDtype::F32));
}

TEST(KvCacheInt8, ScalesExistOnlyWhereTheDtypeHasThem) {
  KvGeometry mla;
  mla.n_layer = 2;
  mla.kv_lora_rank = 32;
  mla.rope_dim = 8;
  const KvCache m(mla, 4, 3, KvDtype::INT8);
  EXPECT_NE(m.k_scale(1), nullptr);
  EXPECT_NE(m.rope_scale(1), nullptr);
  EXPECT_EQ(m.v_scale(1), nullptr);
  const KvCache s(2, 2, 8, 4, 3, KvDtype::INT8);
  EXPECT_NE(s.k_scale(0), nullptr);
  EXPECT_NE(s.v_scale(0), nullptr);
  EXPECT_EQ(s.rope_scale(0), nullptr);
  const KvCache f(2, 2, 8, 4, 3, KvDtype::F16);
  EXPECT_EQ(f.k_scale(0), nullptr);
  EXPECT_EQ(f.v_scale(0), nullptr);
}

// Fills block `b` of every array of the cache with a pattern of seed s, copies it to another block
// and reads both back: codes and scales of K, V (and MLA's RoPE scales) all follow.
TEST(KvCacheInt8, CopyBlockCopiesCodesAndScales) {
  KvGeometry mla;
  mla.n_layer = 2;
  mla.kv_lora_rank = 32;
  mla.rope_dim = 8;
  for (bool is_mla : {false, true}) {
    SCOPED_TRACE(is_mla ? "mla" : "standard");
    KvCache kv = is_mla ? KvCache(mla, 4, 5, KvDtype::INT8) : KvCache(2, 3, 8, 4, 5, KvDtype::INT8);
    const int64_t codes_per_block = kv.block_size() * kv.kv_dim();
    const int64_t scales_per_block = kv.block_size() * kv.n_head_kv();
    auto fill = [&](int32_t block, int seed) {
      for (int64_t l = 0; l < 2; ++l) {
        for (void* c : {kv.k(l), kv.v(l)}) {
          if (c == nullptr) continue;
          auto* p = static_cast<int8_t*>(c) + block * codes_per_block;
          for (int64_t i = 0; i < codes_per_block; ++i) p[i] = static_cast<int8_t>((i * 7 + seed) % 255 - 127);
        }
        for (float* s : {kv.k_scale(l), kv.v_scale(l), kv.rope_scale(l)}) {
          if (s == nullptr) continue;
          for (int64_t i = 0; i < scales_per_block; ++i) s[block * scales_per_block + i] = 0.25f * (i + seed);
        }
      }
    };
    auto same = [&](int32_t a, int32_t b) {
      for (int64_t l = 0; l < 2; ++l) {
        for (const void* c : {kv.k(l), kv.v(l)}) {
          if (c == nullptr) continue;
          const auto* p = static_cast<const int8_t*>(c);
          if (std::memcmp(p + a * codes_per_block, p + b * codes_per_block, static_cast<size_t>(codes_per_block)) != 0)
            return false;
        }
        for (const float* s : {kv.k_scale(l), kv.v_scale(l), kv.rope_scale(l)}) {
          if (s == nullptr) continue;
          if (!std::equal(s + a * scales_per_block, s + (a + 1) * scales_per_block, s + b * scales_per_block))
            return false;
        }
      }
      return true;
    };
    fill(1, 3);
    fill(4, 11);
    ASSERT_FALSE(same(1, 4));
    kv.copy_block(1, 4);
    EXPECT_TRUE(same(1, 4));
    EXPECT_EQ(kv.k_scale(1)[4 * scales_per_block + 2], 0.25f * (2 + 3));
  }
}

// The row quantizer: scale amax / 127, the largest element at code +-127, every element within
// half a step, ties to even; zero rows have scale 0, rows with inf or NaN scale NaN.
TEST(KvCacheInt8, QuantizeRowRoundsToTheNearestCode) {
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  std::vector<float> x(67);
  for (float& v : x) v = nd(rng);
  x[40] = -9.5f;  // the amax, negative
  std::vector<int8_t> c(x.size());
  const float scale = cpu::quantize_row_int8(x.data(), c.data(), static_cast<int64_t>(x.size()));
  EXPECT_EQ(scale, 9.5f / 127.0f);
  EXPECT_EQ(c[40], -127);
  for (size_t i = 0; i < x.size(); ++i) {
    const double want = std::nearbyint(static_cast<double>(x[i]) / scale);
    EXPECT_LE(std::abs(x[i] - c[i] * static_cast<double>(scale)), scale / 2.0 * (1 + 1e-6)) << i;
    EXPECT_NEAR(c[i], want, 1.0) << i;  // f32 division may land on the other side of a tie
  }
  // Exact halves: amax 127 gives scale 1, so 2.5 -> 2 and -3.5 -> -4 (nearest even).
  const float halves[4] = {2.5f, -3.5f, 127.0f, 0.5f};
  int8_t hc[4];
  EXPECT_EQ(cpu::quantize_row_int8(halves, hc, 4), 1.0f);
  EXPECT_EQ(hc[0], 2);
  EXPECT_EQ(hc[1], -4);
  EXPECT_EQ(hc[2], 127);
  EXPECT_EQ(hc[3], 0);
  const float zeros[5] = {0.0f, -0.0f, 0.0f, 0.0f, 0.0f};
  int8_t zc[5] = {1, 1, 1, 1, 1};
  EXPECT_EQ(cpu::quantize_row_int8(zeros, zc, 5), 0.0f);
  for (int8_t v : zc) EXPECT_EQ(v, 0);
  const float bad[3] = {1.0f, INFINITY, 2.0f};
  int8_t bc[3];
  EXPECT_TRUE(std::isnan(cpu::quantize_row_int8(bad, bc, 3)));
  for (int8_t v : bc) EXPECT_EQ(v, 0);
}

// A paged KV layer of random rows, held both as f32 and quantized per row; the MLA form keeps the
// key's last rope elements under their own scale and reads values from the key rows' first v_dim.
struct Layer {
  int64_t block_size, n_head_kv, head_dim, v_dim, n_blocks;
  std::vector<float> k, v;                 // f32 rows
  std::vector<int8_t> kc, vc;              // codes
  std::vector<float> ks, vs, rs;           // scales per row (rs: the RoPE part of an MLA key)
  bool mla() const { return v_dim < head_dim; }
};

// head_dim 0: 24 (40 with MLA); a GQA head_dim of 64 or more takes the AVX-512 byte transposition
// of 64-element slabs of the keys (136: two slabs and a tail; 128: two slabs, multiplied with the
// query in integers by AVX-512 VNNI).
Layer make_layer(bool mla, std::mt19937& rng, int64_t head_dim = 0) {
  const int64_t hd = head_dim > 0 ? head_dim : mla ? 40 : 24;
  Layer L{4, mla ? 1 : 2, hd, mla ? 32 : hd, 6, {}, {}, {}, {}, {}, {}, {}};
  const int64_t rows = L.n_blocks * L.n_head_kv * L.block_size;
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<float> mag(0.2f, 3.0f);  // rows of different magnitudes
  L.k.resize(static_cast<size_t>(rows * L.head_dim));
  L.v.resize(mla ? 0 : L.k.size());
  for (int64_t r = 0; r < rows; ++r) {
    const float m = mag(rng), m2 = mag(rng);
    for (int64_t i = 0; i < L.head_dim; ++i) {
      L.k[static_cast<size_t>(r * L.head_dim + i)] = m * nd(rng) * (mla && i >= L.v_dim ? 4.0f : 1.0f);
      if (!mla) L.v[static_cast<size_t>(r * L.head_dim + i)] = m2 * nd(rng);
    }
  }
  L.kc.resize(L.k.size());
  L.vc.resize(L.v.size());
  L.ks.resize(static_cast<size_t>(rows));
  L.vs.resize(mla ? 0 : static_cast<size_t>(rows));
  L.rs.resize(mla ? static_cast<size_t>(rows) : 0);
  for (int64_t r = 0; r < rows; ++r) {
    const size_t o = static_cast<size_t>(r * L.head_dim);
    if (mla) {
      L.ks[r] = cpu::quantize_row_int8(&L.k[o], &L.kc[o], L.v_dim);
      L.rs[r] = cpu::quantize_row_int8(&L.k[o + L.v_dim], &L.kc[o + L.v_dim], L.head_dim - L.v_dim);
    } else {
      L.ks[r] = cpu::quantize_row_int8(&L.k[o], &L.kc[o], L.head_dim);
      L.vs[r] = cpu::quantize_row_int8(&L.v[o], &L.vc[o], L.head_dim);
    }
  }
  return L;
}

class Int8Attention : public ::testing::TestWithParam<int> {};  // param: 0 GQA, 1 MLA, 2 GQA of 136, 3 of 128

TEST_P(Int8Attention, MatchesFloat64OverTheDequantizedRowsAndStaysNearF32) {
  const bool mla = GetParam() == 1;
  std::mt19937 rng(mla ? 5 : 9);
  const Layer L = make_layer(mla, rng, GetParam() == 2 ? 136 : GetParam() == 3 ? 128 : 0);
  const int64_t group = mla ? 5 : 3, n_ctx = 19, hd = L.head_dim, vd = L.v_dim;
  const std::vector<int32_t> table = {3, 0, 5, 1, 4};  // positions 0-3 in block 3, 4-7 in block 0, ...
  const int64_t kvh = L.n_head_kv - 1;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> q(static_cast<size_t>(group * hd));
  for (float& x : q) x = nd(rng);
  auto row = [&](int64_t pos) { return (table[pos / L.block_size] * L.n_head_kv + kvh) * L.block_size + pos % L.block_size; };
  // Dequantized key / value element, and the f32 original.
  auto kq = [&](int64_t pos, int64_t i) {
    const int64_t r = row(pos);
    const double s = mla && i >= vd ? L.rs[r] : L.ks[r];
    return L.kc[static_cast<size_t>(r * hd + i)] * s;
  };
  auto vq = [&](int64_t pos, int64_t i) {
    const int64_t r = row(pos);
    return mla ? kq(pos, i) : L.vc[static_cast<size_t>(r * hd + i)] * static_cast<double>(L.vs[r]);
  };
  auto kf = [&](int64_t pos, int64_t i) { return static_cast<double>(L.k[static_cast<size_t>(row(pos) * hd + i)]); };
  auto vf = [&](int64_t pos, int64_t i) {
    return static_cast<double>((mla ? L.k : L.v)[static_cast<size_t>(row(pos) * hd + i)]);
  };
  // Head g's query: as given, and as the kernels use it (without a RoPE scale, rounded to 16 bits:
  // quantize_query_q16).
  auto query = [&](int64_t g) { return std::vector<double>(q.begin() + g * hd, q.begin() + (g + 1) * hd); };
  auto kernel_query = [&](int64_t g) { return mla ? query(g) : test::int8_kv_query(q.data() + g * hd, hd); };
  // Softmax attention in float64 over keys [begin, n_ctx) of query row qg.
  auto reference = [&](const std::vector<double>& qg, int64_t begin, auto key, auto value) {
    std::vector<double> s, out(static_cast<size_t>(vd), 0.0);
    double mx = -INFINITY, sum = 0;
    for (int64_t pos = begin; pos < n_ctx; ++pos) {
      double d = 0;
      for (int64_t i = 0; i < hd; ++i) d += qg[static_cast<size_t>(i)] * key(pos, i);
      s.push_back(d * scale);
      mx = std::max(mx, s.back());
    }
    for (double& x : s) sum += (x = std::exp(x - mx));
    for (int64_t pos = begin; pos < n_ctx; ++pos)
      for (int64_t i = 0; i < vd; ++i) out[static_cast<size_t>(i)] += s[static_cast<size_t>(pos - begin)] / sum * value(pos, i);
    return out;
  };
  for (const cpu::OpsTable* t : tables())
    for (int64_t begin : {0, 2, 4, 11}) {
      std::vector<float> out(static_cast<size_t>(group * vd), -1.0f);
      cpu::AttentionArgs a{};
      a.q = q.data();
      a.k_cache = L.kc.data();
      a.v_cache = mla ? L.kc.data() : L.vc.data();
      a.kv_dtype = KvDtype::INT8;
      a.k_scale = L.ks.data();
      a.v_scale = mla ? L.ks.data() : L.vs.data();
      a.k_rope_scale = mla ? L.rs.data() : nullptr;
      a.block_stride = L.n_head_kv * L.block_size * hd;
      a.head_offset = kvh * L.block_size * hd;
      a.block_table = table.data();
      a.block_size = static_cast<int32_t>(L.block_size);
      a.n_ctx = &n_ctx;
      a.kv_begin = &begin;
      a.head_dim = hd;
      a.v_dim = mla ? vd : 0;
      a.group = group;
      a.scale = scale;
      a.out = out.data();
      t->attention(a);
      for (int64_t g = 0; g < group; ++g) {
        // 1. The kernel's arithmetic in float64: 1e-5 relative to the output's largest element
        //    (f32 dot products of 24-40 terms and a 19-key softmax, measured below 1e-6).
        const std::vector<double> want = reference(kernel_query(g), begin, kq, vq);
        double amax = 0;
        for (double w : want) amax = std::max(amax, std::abs(w));
        for (int64_t i = 0; i < vd; ++i)
          EXPECT_NEAR(out[static_cast<size_t>(g * vd + i)], want[static_cast<size_t>(i)], 1e-5 * amax)
              << "kv_begin " << begin << " head " << g << " dim " << i;
        // 2. Against the f32 rows and the query as given. Each code is within half a step (scale /
        //    2) of its element and each query element within dq_i = |kernel q_i - q_i| of the
        //    kernel's, so a score moves by at most eps = softmax scale x max over keys of
        //    sum_i (|q_i| x step_i / 2 + dq_i x |key_i|); every softmax weight then changes by a
        //    factor within [e^-2eps, e^2eps], their absolute changes sum to at most e^2eps - 1, and
        //    an output element moves by at most max_key(v step / 2) + (e^2eps - 1) x max_key |v_i|
        //    (plus f32 rounding: 1e-5).
        const std::vector<double> exact = reference(query(g), begin, kf, vf);
        const std::vector<double> qk = kernel_query(g);
        double eps = 0, v_half_step = 0;
        for (int64_t pos = begin; pos < n_ctx; ++pos) {
          const int64_t r = row(pos);
          double e = 0;
          for (int64_t i = 0; i < hd; ++i)
            e += std::abs(q[static_cast<size_t>(g * hd + i)]) * (mla && i >= vd ? L.rs[r] : L.ks[r]) / 2 +
                 std::abs(qk[static_cast<size_t>(i)] - q[static_cast<size_t>(g * hd + i)]) * std::abs(kq(pos, i));
          eps = std::max(eps, e * scale);
          v_half_step = std::max(v_half_step, static_cast<double>(mla ? L.ks[r] : L.vs[r]) / 2);
        }
        for (int64_t i = 0; i < vd; ++i) {
          double v_max = 0;
          for (int64_t pos = begin; pos < n_ctx; ++pos) v_max = std::max(v_max, std::abs(vf(pos, i)));
          const double bound = v_half_step + std::expm1(2 * eps) * v_max + 1e-5;
          EXPECT_NEAR(out[static_cast<size_t>(g * vd + i)], exact[static_cast<size_t>(i)], bound)
              << "kv_begin " << begin << " head " << g << " dim " << i;
        }
      }
    }
}

INSTANTIATE_TEST_SUITE_P(Layouts, Int8Attention, ::testing::Values(0, 1, 2, 3), [](const auto& info) {
  return info.param == 1 ? "Mla" : info.param == 2 ? "GqaHeadDim136" : info.param == 3 ? "GqaHeadDim128" : "Gqa";
});

}  // namespace
}  // namespace kestrel
