// The mixture-of-experts kernels (src/backend/cuda/moe_ops.h) against host references: routing
// against kestrel::moe_select (Mixtral-, Qwen2-MoE- and DeepSeek-style rules, with ties), the
// grouping of rows by expert, the grouped GEMMs against float64 loops on uneven expert loads (empty
// experts, one heavy expert, padding rows), the combine, and the whole chain against a float64
// reference, row results independent of the batch.
// Tolerances: a bf16 output of an f32 sum is within half a bf16 ulp (2^-9 = 2e-3 relative) of the
// exact value, so relative L2 errors of one rounded GEMM are checked at 4e-3; the whole chain rounds
// three times (gate|up activation, expert output, combined output): 1e-2.
#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>

#include "backend/cuda/moe_ops.h"
#include "cuda_test_util.h"
#include "model/moe_router.h"

namespace kestrel::test {
namespace {

using cuda::MoePlan;
using cuda::MoeRouteArgs;

MoeRouteArgs route_args(const MoeRouting& r) {
  MoeRouteArgs a;
  a.n_expert = r.n_expert;
  a.top_k = r.n_expert_used;
  a.group_limited = r.select == MoeRouting::Select::GroupLimited;
  a.n_group = r.n_group;
  a.topk_group = r.topk_group;
  a.norm_topk = r.norm_topk;
  a.routed_scale = r.routed_scale;
  return a;
}

struct RouteCase {
  const char* name;
  MoeRouting r;
};

MoeRouting routing(int32_t n, int32_t k, bool norm, float scale = 1.0f, int32_t groups = 0, int32_t topk_group = 0) {
  MoeRouting r;
  r.n_expert = n;
  r.n_expert_used = k;
  r.norm_topk = norm;
  r.routed_scale = scale;
  if (groups > 0) {
    r.select = MoeRouting::Select::GroupLimited;
    r.n_group = groups;
    r.topk_group = topk_group;
  }
  return r;
}

// One f32 ulp of v: the device's double exp may round differently from the host's in the last
// bit, so a weight may land on the other side of an f32 rounding boundary.
float ulp_of(float v) { return std::fabs(v) * 1.2e-7f; }

TEST(CudaMoe, RouteMatchesMoeSelect) {
  KESTREL_REQUIRE_CUDA();
  const std::vector<RouteCase> cases = {
      {"mixtral 8 top-2 renormalised", routing(8, 2, true)},
      {"qwen2-moe 60 top-4", routing(60, 4, false)},
      {"deepseek-v2-lite 64 top-6 x 1.0", routing(64, 6, false)},
      {"deepseek group-limited 16 / 4 groups, 2 kept, top-3 x 2.5", routing(16, 3, false, 2.5f, 4, 2)},
      {"deepseek-v2 160 / 8 groups, 3 kept, top-6 x 16", routing(160, 6, false, 16.0f, 8, 3)},
      {"deepseek-v3-like 256 / 8 groups, 4 kept, top-8 renormalised x 2.5", routing(256, 8, true, 2.5f, 8, 4)},
  };
  std::mt19937 rng(71);
  for (const RouteCase& c : cases) {
    SCOPED_TRACE(c.name);
    const int32_t n_exp = c.r.n_expert, k = c.r.n_expert_used;
    const int64_t n_tok = 37, stride = n_exp + 3;  // rows not packed: the stride is honoured
    std::vector<float> logits(static_cast<size_t>(n_tok * stride), 1e30f);
    for (int64_t t = 0; t < n_tok; ++t)
      for (int32_t e = 0; e < n_exp; ++e) {
        float v;
        if (t % 3 == 0) {
          v = static_cast<float>(static_cast<int>(rng() % 4));  // few values: ties within and across groups
        } else if (t % 3 == 1) {
          v = std::uniform_real_distribution<float>(-4.0f, 4.0f)(rng);
        } else {
          v = e % 2 == 0 ? 1.5f : std::uniform_real_distribution<float>(-1.0f, 1.0f)(rng);  // ties of the best
        }
        logits[static_cast<size_t>(t * stride + e)] = v;
      }
    std::vector<int64_t> slots(static_cast<size_t>(n_tok));
    for (int64_t t = 0; t < n_tok; ++t) slots[static_cast<size_t>(t)] = t % 11 == 5 ? -1 : t;  // padding rows
    DeviceBuffer<float> d_logits(logits), d_w(static_cast<size_t>(n_tok * k));
    DeviceBuffer<int64_t> d_slots(slots);
    DeviceBuffer<int32_t> d_ids(static_cast<size_t>(n_tok * k));
    d_w.poison();
    d_ids.poison();
    cuda::moe_route(d_logits.get(), stride, d_slots.get(), n_tok, route_args(c.r), d_ids.get(), d_w.get(), nullptr);
    const auto ids = d_ids.download();
    const auto w = d_w.download();
    std::vector<int32_t> want_ids(static_cast<size_t>(k));
    std::vector<float> want_w(static_cast<size_t>(k));
    for (int64_t t = 0; t < n_tok; ++t) {
      if (slots[static_cast<size_t>(t)] < 0) {
        for (int32_t j = 0; j < k; ++j) {
          EXPECT_EQ(ids[static_cast<size_t>(t * k + j)], -1) << "padding token " << t;
          EXPECT_EQ(w[static_cast<size_t>(t * k + j)], 0.0f) << "padding token " << t;
        }
        continue;
      }
      moe_select(logits.data() + t * stride, c.r, want_ids.data(), want_w.data());
      for (int32_t j = 0; j < k; ++j) {
        EXPECT_EQ(ids[static_cast<size_t>(t * k + j)], want_ids[static_cast<size_t>(j)]) << "token " << t << " slot " << j;
        const float got_w = w[static_cast<size_t>(t * k + j)], want = want_w[static_cast<size_t>(j)];
        EXPECT_LE(std::fabs(got_w - want), ulp_of(want)) << "token " << t << " slot " << j;
      }
    }
  }
}

// The kestrel::Error message fn throws, "" when none.
template <class Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(CudaMoe, RouteRejectsWhatItCannotRun) {
  KESTREL_REQUIRE_CUDA();
  auto msg = [](MoeRouteArgs a) {
    return error_of([&] { cuda::moe_route(nullptr, a.n_expert, nullptr, 0, a, nullptr, nullptr, nullptr); });
  };
  EXPECT_NE(msg(route_args(routing(1024, 2, true))).find("n_expert 1024"), std::string::npos);
  EXPECT_NE(msg(route_args(routing(8, 9, true))).find("top_k 9"), std::string::npos);
  EXPECT_NE(msg(route_args(routing(16, 2, false, 1.0f, 3, 1))).find("n_group 3"), std::string::npos);
  EXPECT_NE(msg(route_args(routing(16, 6, false, 1.0f, 4, 1))).find("topk_group 1"), std::string::npos);
}

// ids [n_rows] with uneven loads: expert 1 takes about half the rows, experts >= n_exp / 2 only
// every 7th, expert 2 none, and every 13th row is padding (-1).
std::vector<int32_t> skewed_ids(int64_t n_tok, int32_t k, int32_t n_exp, std::mt19937& rng) {
  std::vector<int32_t> ids(static_cast<size_t>(n_tok * k));
  for (int64_t t = 0; t < n_tok; ++t) {
    std::vector<int32_t> pool(static_cast<size_t>(n_exp));
    std::iota(pool.begin(), pool.end(), 0);
    std::shuffle(pool.begin(), pool.end(), rng);
    std::stable_partition(pool.begin(), pool.end(), [&](int32_t e) { return e == 1 && rng() % 2 == 0; });
    std::vector<int32_t> pick;
    for (int32_t e : pool)
      if (static_cast<int32_t>(pick.size()) < k && e != 2 && (e < n_exp / 2 || rng() % 7 == 0 || n_exp - 1 < 2 * k))
        pick.push_back(e);
    for (int32_t e : pool)
      if (static_cast<int32_t>(pick.size()) < k && std::find(pick.begin(), pick.end(), e) == pick.end()) pick.push_back(e);
    for (int32_t j = 0; j < k; ++j) ids[static_cast<size_t>(t * k + j)] = t % 13 == 4 ? -1 : pick[static_cast<size_t>(j)];
  }
  return ids;
}

struct Sorted {
  std::vector<int32_t> tile_expert, perm;
};

// moe_sort's documented result, built on the host.
Sorted sort_reference(const std::vector<int32_t>& ids, int32_t n_exp, const MoePlan& plan) {
  Sorted s;
  s.tile_expert.assign(static_cast<size_t>(plan.max_tiles), -1);
  s.perm.assign(static_cast<size_t>(plan.padded_rows()), -2);  // -2: not written
  int64_t tile = 0;
  for (int32_t e = 0; e < n_exp; ++e) {
    std::vector<int32_t> rows;
    for (size_t r = 0; r < ids.size(); ++r)
      if (ids[r] == e) rows.push_back(static_cast<int32_t>(r));
    const int64_t tiles = (static_cast<int64_t>(rows.size()) + plan.tile_rows - 1) / plan.tile_rows;
    for (int64_t i = 0; i < tiles * plan.tile_rows; ++i)
      s.perm[static_cast<size_t>(tile * plan.tile_rows + i)] = i < static_cast<int64_t>(rows.size()) ? rows[static_cast<size_t>(i)] : -1;
    for (int64_t i = 0; i < tiles; ++i) s.tile_expert[static_cast<size_t>(tile + i)] = e;
    tile += tiles;
  }
  EXPECT_LE(tile, plan.max_tiles);
  return s;
}

TEST(CudaMoe, SortGroupsRowsByExpertInTiles) {
  KESTREL_REQUIRE_CUDA();
  std::mt19937 rng(72);
  struct Case {
    int64_t n_tok;
    int32_t k, n_exp;
  };
  // Plans of 8-, 16-, 32- and 64-row tiles; 300 x 6 rows: several block-wide chunks.
  for (const Case& c : {Case{1, 2, 8}, Case{5, 6, 64}, Case{40, 2, 8}, Case{100, 4, 16}, Case{300, 6, 64},
                        Case{600, 2, 8}}) {
    SCOPED_TRACE("tokens " + std::to_string(c.n_tok) + " k " + std::to_string(c.k) + " experts " + std::to_string(c.n_exp));
    const auto ids = skewed_ids(c.n_tok, c.k, c.n_exp, rng);
    const MoePlan plan = cuda::moe_plan(c.n_tok, c.n_exp, c.k);
    const Sorted want = sort_reference(ids, c.n_exp, plan);
    DeviceBuffer<int32_t> d_ids(ids), d_tiles(static_cast<size_t>(plan.max_tiles)),
        d_perm(static_cast<size_t>(plan.padded_rows()));
    d_tiles.poison();
    std::vector<unsigned long long> counts0(static_cast<size_t>(c.n_exp));
    for (size_t e = 0; e < counts0.size(); ++e) counts0[e] = 1000 + e;
    DeviceBuffer<unsigned long long> d_counts(counts0);
    for (int pass = 0; pass < 2; ++pass) {
      std::vector<int32_t> unwritten(static_cast<size_t>(plan.padded_rows()), -2);
      d_perm.upload(unwritten);
      cuda::moe_sort(d_ids.get(), c.n_tok * c.k, c.n_exp, plan, d_tiles.get(), d_perm.get(), d_counts.get(), nullptr);
      EXPECT_EQ(d_tiles.download(), want.tile_expert);
      // Entries of unused tiles are left alone, like the -2 the reference leaves.
      EXPECT_EQ(d_perm.download(), want.perm);
    }
    const auto counts = d_counts.download();
    for (int32_t e = 0; e < c.n_exp; ++e)
      EXPECT_EQ(counts[static_cast<size_t>(e)],
                static_cast<unsigned long long>(1000 + e + 2 * std::count(ids.begin(), ids.end(), e))) << "expert " << e;
  }
}

// The fused routing and grouping of small steps gives moe_route's and moe_sort's outputs bit for
// bit (and the same unfused beyond its bound), padding tokens included.
TEST(CudaMoe, RouteSortMatchesRouteThenSort) {
  KESTREL_REQUIRE_CUDA();
  std::mt19937 rng(74);
  const std::vector<MoeRouting> rules = {routing(8, 2, true), routing(60, 4, false), routing(64, 6, false),
                                         routing(160, 6, false, 16.0f, 8, 3), routing(256, 8, true, 2.5f, 8, 4)};
  for (const MoeRouting& rule : rules)
    for (int64_t n_tok : {1, 3, 16, 17}) {
      SCOPED_TRACE(std::to_string(rule.n_expert) + " experts top-" + std::to_string(rule.n_expert_used) + ", " +
                   std::to_string(n_tok) + " tokens");
      const MoeRouteArgs a = route_args(rule);
      EXPECT_EQ(cuda::moe_route_sort_fused(n_tok, a), n_tok <= 16);
      const int32_t n_exp = rule.n_expert, k = rule.n_expert_used;
      const int64_t stride = n_exp + 1;
      std::vector<float> logits(static_cast<size_t>(n_tok * stride));
      for (size_t i = 0; i < logits.size(); ++i)
        logits[i] = i % 5 == 0 ? 0.5f : std::uniform_real_distribution<float>(-3.0f, 3.0f)(rng);  // with ties
      std::vector<int64_t> slots(static_cast<size_t>(n_tok));
      for (int64_t t = 0; t < n_tok; ++t) slots[static_cast<size_t>(t)] = t % 4 == 2 ? -1 : t;
      const MoePlan plan = cuda::moe_plan(n_tok, n_exp, k);
      DeviceBuffer<float> d_logits(logits);
      DeviceBuffer<int64_t> d_slots(slots);
      struct Out {
        std::vector<int32_t> ids, tiles, perm;
        std::vector<float> w;
        std::vector<unsigned long long> counts;
      };
      auto run = [&](bool fused) {
        DeviceBuffer<int32_t> ids(static_cast<size_t>(n_tok * k)), tiles(static_cast<size_t>(plan.max_tiles));
        DeviceBuffer<int32_t> perm(std::vector<int32_t>(static_cast<size_t>(plan.padded_rows()), -2));
        DeviceBuffer<float> w(static_cast<size_t>(n_tok * k));
        DeviceBuffer<unsigned long long> counts(std::vector<unsigned long long>(static_cast<size_t>(n_exp), 7));
        ids.poison();
        tiles.poison();
        w.poison();
        if (fused) {
          cuda::moe_route_sort(d_logits.get(), stride, d_slots.get(), n_tok, a, plan, ids.get(), w.get(), tiles.get(),
                               perm.get(), counts.get(), nullptr);
        } else {
          cuda::moe_route(d_logits.get(), stride, d_slots.get(), n_tok, a, ids.get(), w.get(), nullptr);
          cuda::moe_sort(ids.get(), n_tok * k, n_exp, plan, tiles.get(), perm.get(), counts.get(), nullptr);
        }
        return Out{ids.download(), tiles.download(), perm.download(), w.download(), counts.download()};
      };
      const Out want = run(false), got = run(true);
      EXPECT_EQ(got.ids, want.ids);
      EXPECT_EQ(got.w, want.w);
      EXPECT_EQ(got.tiles, want.tiles);
      EXPECT_EQ(got.perm, want.perm);
      EXPECT_EQ(got.counts, want.counts);
      EXPECT_EQ(got.tiles, sort_reference(want.ids, n_exp, plan).tile_expert);
    }
}

TEST(CudaMoe, PlanBoundsTheTilesOfAnyRouting) {
  // max_tiles is reached when every expert's rows spill one row into an extra tile.
  const MoePlan p = cuda::moe_plan(64, 8, 2);  // 128 rows, mean 16 per expert: tiles of twice that
  EXPECT_EQ(p.tile_rows, 32);
  EXPECT_EQ(p.max_tiles, 4 + 8);
  EXPECT_EQ(cuda::moe_plan(64, 64, 6).tile_rows, 16);  // mean 6
  EXPECT_EQ(cuda::moe_plan(64, 64, 6).max_tiles, 24 + 64);
  EXPECT_EQ(cuda::moe_plan(1, 64, 6).max_tiles, 6);
  EXPECT_EQ(cuda::moe_plan(1, 64, 6).tile_rows, 8);
  EXPECT_EQ(cuda::moe_plan(4096, 8, 2).tile_rows, 64);
  EXPECT_EQ(cuda::moe_plan(4096, 8, 2).max_tiles, 128 + 8);
}

float silu_ref(double g) { return static_cast<float>(g / (1.0 + std::exp(-g))); }

// x . w^T for one row of x and row `row` of w [*, n_in], in double.
double dot_bf16(const std::vector<uint16_t>& x, int64_t x_row, const std::vector<uint16_t>& w, int64_t w_row,
                int64_t n_in) {
  double s = 0;
  for (int64_t i = 0; i < n_in; ++i)
    s += static_cast<double>(from_bf16(x[static_cast<size_t>(x_row * n_in + i)])) *
         from_bf16(w[static_cast<size_t>(w_row * n_in + i)]);
  return s;
}

struct GemmCase {
  int64_t n_tok;
  int32_t k, n_exp;
  int64_t d, f;
};

TEST(CudaMoe, GroupedGemmsMatchPlainLoopsOnUnevenLoads) {
  KESTREL_REQUIRE_CUDA();
  std::mt19937 rng(73);
  // d 72 and f 40: k tails shorter than a 64-wide stage and partial weight-row tiles; tile plans
  // of 8 (1 and 3 tokens), 16 (12 tokens), 32 and 64 rows.
  std::vector<GemmCase> cases = {{1, 2, 8, 64, 96}, {3, 4, 8, 72, 40}, {12, 4, 8, 72, 40}, {24, 2, 4, 128, 64},
                                 {50, 4, 8, 64, 32}, {90, 2, 4, 72, 136}};
  if (!kCudaEmulated) {
    cases.push_back({1, 6, 64, 2048, 1408});
    cases.push_back({64, 2, 8, 4096, 1024});
    cases.push_back({512, 6, 64, 2048, 1408});
  }
  for (const GemmCase& c : cases) {
    for (const cuda::MoeGemmKernel kern : {cuda::MoeGemmKernel::Tiled, cuda::MoeGemmKernel::Skinny}) {
      const MoePlan plan = cuda::moe_plan(c.n_tok, c.n_exp, c.k);
      if (kern == cuda::MoeGemmKernel::Skinny && plan.tile_rows != 8) continue;
      SCOPED_TRACE("tokens " + std::to_string(c.n_tok) + " k " + std::to_string(c.k) + " experts " +
                   std::to_string(c.n_exp) + " d " + std::to_string(c.d) + " f " + std::to_string(c.f) +
                   (kern == cuda::MoeGemmKernel::Skinny ? " skinny" : " tiled"));
      const auto ids = skewed_ids(c.n_tok, c.k, c.n_exp, rng);
      const auto x = random_bf16(static_cast<size_t>(c.n_tok * c.d), rng);
      const auto wgu = random_bf16(static_cast<size_t>(c.n_exp * 2 * c.f * c.d), rng, -0.5f, 0.5f);
      const auto wd = random_bf16(static_cast<size_t>(c.n_exp * c.d * c.f), rng, -0.5f, 0.5f);
      DeviceBuffer<int32_t> d_ids(ids), d_tiles(static_cast<size_t>(plan.max_tiles)),
          d_perm(static_cast<size_t>(plan.padded_rows()));
      DeviceBuffer<uint16_t> d_x(x), d_wgu(wgu), d_wd(wd), d_act(static_cast<size_t>(plan.padded_rows() * c.f)),
          d_y(static_cast<size_t>(c.n_tok * c.k * c.d));
      d_act.poison();
      d_y.poison();
      cuda::moe_sort(d_ids.get(), c.n_tok * c.k, c.n_exp, plan, d_tiles.get(), d_perm.get(), nullptr, nullptr);
      cuda::MoeGemmArgs gu;
      gu.x = d_x.bf16();
      gu.w = d_wgu.bf16();
      gu.y = d_act.bf16();
      gu.tile_expert = d_tiles.get();
      gu.perm = d_perm.get();
      gu.n_in = c.d;
      gu.n_out = c.f;
      gu.top_k = c.k;
      gu.n_tokens = c.n_tok;
      gu.swiglu = true;
      gu.kernel = kern;
      cuda::moe_gemm(gu, plan, nullptr);
      cuda::MoeGemmArgs dn = gu;
      dn.x = d_act.bf16();
      dn.w = d_wd.bf16();
      dn.y = d_y.bf16();
      dn.n_in = c.f;
      dn.n_out = c.d;
      dn.swiglu = false;
      cuda::moe_gemm(dn, plan, nullptr);
      const auto perm = d_perm.download();
      const auto act_bits = d_act.download();
      const auto act = bf16_to_f32(act_bits);
      const auto y = bf16_to_f32(d_y.download());

      // gate|up: each sorted row against silu(x w_gate^T) * (x w_up^T) of its token and expert.
      std::vector<float> got_act;
      std::vector<double> want_act;
      std::vector<int32_t> expert_of_row(static_cast<size_t>(c.n_tok * c.k), -1);
      const Sorted want = sort_reference(ids, c.n_exp, plan);
      for (int64_t p = 0; p < plan.padded_rows(); ++p) {
        const int32_t r = perm[static_cast<size_t>(p)];
        if (p >= static_cast<int64_t>(want.perm.size()) || want.perm[static_cast<size_t>(p)] < 0) continue;
        const int32_t e = want.tile_expert[static_cast<size_t>(p / plan.tile_rows)];
        expert_of_row[static_cast<size_t>(r)] = e;
        const int64_t t = r / c.k;
        for (int64_t col = 0; col < c.f; ++col) {
          const double g = dot_bf16(x, t, wgu, e * 2 * c.f + col, c.d);
          const double u = dot_bf16(x, t, wgu, e * 2 * c.f + c.f + col, c.d);
          want_act.push_back(g / (1.0 + std::exp(-g)) * u);
          got_act.push_back(act[static_cast<size_t>(p * c.f + col)]);
        }
      }
      EXPECT_LE(rel_error(got_act, want_act), 4e-3);
      // down: row t * k + j = act row . w_down^T of its expert (from the device's act, so that this
      // checks the second GEMM alone); rows of padding tokens stay unwritten (NaN).
      std::vector<float> got_y;
      std::vector<double> want_y;
      for (int64_t p = 0; p < plan.padded_rows(); ++p) {
        if (p >= static_cast<int64_t>(want.perm.size()) || want.perm[static_cast<size_t>(p)] < 0) continue;
        const int32_t r = perm[static_cast<size_t>(p)];
        const int32_t e = expert_of_row[static_cast<size_t>(r)];
        for (int64_t col = 0; col < c.d; ++col) {
          want_y.push_back(dot_bf16(act_bits, p, wd, e * c.d + col, c.f));
          got_y.push_back(y[static_cast<size_t>(r * c.d + col)]);
        }
      }
      EXPECT_LE(rel_error(got_y, want_y), 4e-3);
      for (size_t r = 0; r < ids.size(); ++r)
        if (ids[r] < 0) EXPECT_TRUE(std::isnan(y[r * static_cast<size_t>(c.d)])) << "padding row " << r << " written";
    }
  }
}

TEST(CudaMoe, GemmRejectsBadShapes) {
  KESTREL_REQUIRE_CUDA();
  DeviceBuffer<uint16_t> buf(64);
  cuda::MoeGemmArgs a;
  a.x = buf.bf16();
  a.w = buf.bf16();
  a.n_in = 12;
  a.n_out = 8;
  EXPECT_NE(error_of([&] { cuda::moe_gemm(a, cuda::moe_plan(1, 8, 2), nullptr); }).find("n_in 12"),
            std::string::npos);
}

// One MoE layer's tensors on the host: router logits, token rows, the experts' stacked gate|up and
// down weights, a shared expert's output and its gate logit (column n_exp of the logits).
struct Layer {
  int64_t n_tok, d, f, stride;
  MoeRouting r;
  std::vector<float> logits;           // [n_tok, stride]
  std::vector<uint16_t> x, wgu, wd;    // [n_tok, d], [E, 2f, d], [E, d, f]
  std::vector<uint16_t> shared;        // [n_tok, d]
};

Layer random_layer(int64_t n_tok, const MoeRouting& r, int64_t d, int64_t f, std::mt19937& rng) {
  Layer L{n_tok, d, f, r.n_expert + 1, r, {}, {}, {}, {}, {}};
  L.logits = random_f32(static_cast<size_t>(n_tok * L.stride), rng, -3.0f, 3.0f);
  L.x = random_bf16(static_cast<size_t>(n_tok * d), rng);
  L.wgu = random_bf16(static_cast<size_t>(r.n_expert * 2 * f * d), rng, -0.5f, 0.5f);
  L.wd = random_bf16(static_cast<size_t>(r.n_expert * d * f), rng, -0.5f, 0.5f);
  L.shared = random_bf16(static_cast<size_t>(n_tok * d), rng);
  return L;
}

// route -> sort -> gate|up -> down -> combine over tokens [t0, t0 + n) of L, as the runner chains
// them; the shared expert with its sigmoid gate when `shared`. Returns out [n, d] as f32.
// kern Skinny: tiles of 8 rows whatever n (the skinny kernel's only size).
std::vector<float> run_chain(const Layer& L, int64_t t0, int64_t n, bool shared, cuda::MoeGemmKernel kern) {
  const int32_t E = L.r.n_expert, k = L.r.n_expert_used;
  const MoePlan plan =
      kern == cuda::MoeGemmKernel::Skinny ? cuda::moe_plan_tiles(n, E, k, 8) : cuda::moe_plan(n, E, k);
  DeviceBuffer<float> d_logits(std::vector<float>(L.logits.begin() + t0 * L.stride, L.logits.begin() + (t0 + n) * L.stride));
  DeviceBuffer<uint16_t> d_x(std::vector<uint16_t>(L.x.begin() + t0 * L.d, L.x.begin() + (t0 + n) * L.d));
  DeviceBuffer<uint16_t> d_sh(std::vector<uint16_t>(L.shared.begin() + t0 * L.d, L.shared.begin() + (t0 + n) * L.d));
  DeviceBuffer<uint16_t> d_wgu(L.wgu), d_wd(L.wd), d_act(static_cast<size_t>(plan.padded_rows() * L.f)),
      d_y(static_cast<size_t>(n * k * L.d)), d_out(static_cast<size_t>(n * L.d));
  DeviceBuffer<int32_t> d_ids(static_cast<size_t>(n * k)), d_tiles(static_cast<size_t>(plan.max_tiles)),
      d_perm(static_cast<size_t>(plan.padded_rows()));
  DeviceBuffer<float> d_w(static_cast<size_t>(n * k));
  d_out.poison();
  cuda::moe_route(d_logits.get(), L.stride, nullptr, n, route_args(L.r), d_ids.get(), d_w.get(), nullptr);
  cuda::moe_sort(d_ids.get(), n * k, E, plan, d_tiles.get(), d_perm.get(), nullptr, nullptr);
  cuda::MoeGemmArgs gu;
  gu.x = d_x.bf16();
  gu.w = d_wgu.bf16();
  gu.y = d_act.bf16();
  gu.tile_expert = d_tiles.get();
  gu.perm = d_perm.get();
  gu.n_in = L.d;
  gu.n_out = L.f;
  gu.top_k = k;
  gu.n_tokens = n;
  gu.swiglu = true;
  gu.kernel = kern;
  cuda::moe_gemm(gu, plan, nullptr);
  cuda::MoeGemmArgs dn = gu;
  dn.x = d_act.bf16();
  dn.w = d_wd.bf16();
  dn.y = d_y.bf16();
  dn.n_in = L.f;
  dn.n_out = L.d;
  dn.swiglu = false;
  cuda::moe_gemm(dn, plan, nullptr);
  cuda::moe_combine(d_y.bf16(), d_ids.get(), d_w.get(), shared ? d_sh.bf16() : nullptr,
                    shared ? d_logits.get() + E : nullptr, L.stride, n, k, L.d, d_out.bf16(), nullptr);
  return bf16_to_f32(d_out.download());
}

// The layer in float64 from moe_select's routing: out[t] = sum_j w_j down_e(silu(x gate_e) * (x
// up_e)) [+ sigmoid(logit) * shared[t]].
std::vector<double> chain_reference(const Layer& L, bool shared) {
  const int32_t E = L.r.n_expert, k = L.r.n_expert_used;
  std::vector<double> out(static_cast<size_t>(L.n_tok * L.d), 0.0);
  std::vector<int32_t> ids(static_cast<size_t>(k));
  std::vector<float> w(static_cast<size_t>(k));
  std::vector<double> h(static_cast<size_t>(L.f));
  for (int64_t t = 0; t < L.n_tok; ++t) {
    moe_select(L.logits.data() + t * L.stride, L.r, ids.data(), w.data());
    for (int32_t j = 0; j < k; ++j) {
      const int64_t e = ids[static_cast<size_t>(j)];
      for (int64_t c = 0; c < L.f; ++c) {
        const double g = dot_bf16(L.x, t, L.wgu, e * 2 * L.f + c, L.d);
        const double u = dot_bf16(L.x, t, L.wgu, e * 2 * L.f + L.f + c, L.d);
        h[static_cast<size_t>(c)] = g / (1.0 + std::exp(-g)) * u;
      }
      for (int64_t o = 0; o < L.d; ++o) {
        double s = 0;
        for (int64_t c = 0; c < L.f; ++c)
          s += h[static_cast<size_t>(c)] * from_bf16(L.wd[static_cast<size_t>((e * L.d + o) * L.f + c)]);
        out[static_cast<size_t>(t * L.d + o)] += w[static_cast<size_t>(j)] * s;
      }
    }
    if (shared) {
      const double gate = 1.0 / (1.0 + std::exp(-static_cast<double>(L.logits[static_cast<size_t>(t * L.stride + E)])));
      for (int64_t o = 0; o < L.d; ++o)
        out[static_cast<size_t>(t * L.d + o)] += gate * from_bf16(L.shared[static_cast<size_t>(t * L.d + o)]);
    }
  }
  return out;
}

// The whole chain against float64, and each token's row the same bits whether it runs in the
// batch or alone, for each GEMM kernel.
TEST(CudaMoe, ChainMatchesFloat64AndRowsIgnoreTheBatch) {
  KESTREL_REQUIRE_CUDA();
  std::mt19937 rng(74);
  struct Case {
    const char* name;
    int64_t n_tok;
    MoeRouting r;
    int64_t d, f;
    bool shared;
  };
  std::vector<Case> cases = {{"mixtral-like", 70, routing(8, 2, true), 64, 96, false},
                             {"qwen2-moe-like, gated shared expert", 40, routing(8, 4, false), 64, 32, true},
                             {"deepseek-like, group-limited", 33, routing(16, 3, false, 2.5f, 4, 2), 72, 40, true}};
  if (!kCudaEmulated) cases.push_back({"deepseek-v2-lite shape", 300, routing(64, 6, false), 2048, 1408, true});
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const Layer L = random_layer(c.n_tok, c.r, c.d, c.f, rng);
    const std::vector<double> want = chain_reference(L, c.shared);
    const std::vector<float> all = run_chain(L, 0, c.n_tok, c.shared, cuda::MoeGemmKernel::Auto);
    EXPECT_LE(rel_error(all, want), 1e-2);
    // Each kernel fixes its rows' sums: alone and in the batch give the same bits when the same
    // kernel runs both (the tiled one: tiles of 8 alone, larger in the batch; the skinny one: 8).
    for (const cuda::MoeGemmKernel kern : {cuda::MoeGemmKernel::Tiled, cuda::MoeGemmKernel::Skinny}) {
      SCOPED_TRACE(kern == cuda::MoeGemmKernel::Skinny ? "skinny" : "tiled");
      const std::vector<float> batch = run_chain(L, 0, c.n_tok, c.shared, kern);
      EXPECT_LE(rel_error(batch, want), 1e-2);
      for (const int64_t t : {int64_t{0}, c.n_tok / 2, c.n_tok - 1}) {
        const std::vector<float> alone = run_chain(L, t, 1, c.shared, kern);
        EXPECT_TRUE(std::equal(alone.begin(), alone.end(), batch.begin() + t * c.d)) << "token " << t;
      }
    }
  }
}

// The combine's sums: slots in order, padding slots (-1) skipped, the shared expert gated or not.
TEST(CudaMoe, CombineWeighsSlotsAndTheSharedExpert) {
  KESTREL_REQUIRE_CUDA();
  std::mt19937 rng(75);
  const int64_t n = 5, d = 24;
  const int32_t k = 3;
  const auto y = random_bf16(static_cast<size_t>(n * k * d), rng);
  const auto sh = random_bf16(static_cast<size_t>(n * d), rng);
  const auto w = random_f32(static_cast<size_t>(n * k), rng, 0.0f, 1.0f);
  const auto logit = random_f32(static_cast<size_t>(n * 2), rng, -2.0f, 2.0f);  // stride 2, column 1
  std::vector<int32_t> ids(static_cast<size_t>(n * k), 0);
  ids[4] = -1;  // token 1, slot 1
  for (int32_t j = 0; j < k; ++j) ids[static_cast<size_t>(3 * k + j)] = -1;  // token 3: a padding token
  DeviceBuffer<uint16_t> d_y(y), d_sh(sh), d_out(static_cast<size_t>(n * d));
  DeviceBuffer<int32_t> d_ids(ids);
  DeviceBuffer<float> d_w(w), d_logit(logit);
  for (const int mode : {0, 1, 2}) {  // no shared expert, ungated, gated
    SCOPED_TRACE("mode " + std::to_string(mode));
    d_out.poison();
    cuda::moe_combine(d_y.bf16(), d_ids.get(), d_w.get(), mode > 0 ? d_sh.bf16() : nullptr,
                      mode == 2 ? d_logit.get() + 1 : nullptr, 2, n, k, d, d_out.bf16(), nullptr);
    const auto out = bf16_to_f32(d_out.download());
    std::vector<double> want(static_cast<size_t>(n * d), 0.0);
    for (int64_t t = 0; t < n; ++t)
      for (int64_t i = 0; i < d; ++i) {
        double s = 0;
        for (int32_t j = 0; j < k; ++j)
          if (ids[static_cast<size_t>(t * k + j)] >= 0)
            s += static_cast<double>(w[static_cast<size_t>(t * k + j)]) * from_bf16(y[static_cast<size_t>((t * k + j) * d + i)]);
        const double g = mode == 2 ? 1.0 / (1.0 + std::exp(-static_cast<double>(logit[static_cast<size_t>(t * 2 + 1)]))) : 1.0;
        if (mode > 0) s += g * from_bf16(sh[static_cast<size_t>(t * d + i)]);
        want[static_cast<size_t>(t * d + i)] = s;
      }
    EXPECT_LE(rel_error(out, want), 4e-3);
    if (mode == 0)
      for (int64_t i = 0; i < d; ++i) EXPECT_EQ(out[static_cast<size_t>(3 * d + i)], 0.0f) << "padding token";
  }
}

}  // namespace
}  // namespace kestrel::test
