// INT4 weights on the GPU (int4_ops.h): the repack's layout, the W4A16 skinny GEMM, the
// dequantization to bf16 and the act-order gather, against float64 references over the
// dequantized weights W[n, k] = s (q - z) computed here from the same codes, scales and zeros.
// Tolerances: the skinny GEMM forms each product of x and q - z exactly and sums in f32, then
// rounds the output to bf16 once: |y - ref| <= 2^-8 |ref| + 1e-5 sum_k |x_k W_k| (half a bf16 ulp
// and the f32 sums); the dequantization is exact (bit for bit the f32 product rounded to nearest
// even, as the host upload makes it).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <tuple>

#include "backend/cuda/int4_ops.h"
#include "cuda_test_util.h"
#include "int4_test_case.h"

namespace kestrel::test {
namespace {

TEST(CudaInt4, LayoutPlacesEveryColumnOnceAndActOrderSortsByGroup) {
  // Every physical column has its own (word, nibble); a 16-byte lane load covers columns 8 t .. of each chunk.
  std::vector<int> seen(256 * 8 / 8 * 8, 0);
  for (int64_t k = 0; k < 256; ++k) ++seen[static_cast<size_t>(cuda::int4_word_of(k) * 8 + cuda::int4_nibble_of(k))];
  EXPECT_TRUE(std::all_of(seen.begin(), seen.begin() + 256, [](int v) { return v == 1; }));
  EXPECT_EQ(cuda::int4_word_of(8), 4);   // lane 1 of tile 0, chunk 0
  EXPECT_EQ(cuda::int4_word_of(32), 1);  // lane 0, chunk 1
  EXPECT_EQ(cuda::int4_nibble_of(1), 4);
  const int32_t g_idx[8] = {1, 0, 1, 0, 0, 1, 1, 0};
  std::vector<int32_t> perm;
  ASSERT_TRUE(cuda::int4_act_order_perm(g_idx, 8, 4, perm));
  EXPECT_EQ(perm, (std::vector<int32_t>{1, 3, 4, 7, 0, 2, 5, 6}));
  const int32_t uneven[8] = {1, 1, 1, 0, 0, 1, 1, 0};  // 3 and 5 members: not the layout's
  EXPECT_FALSE(cuda::int4_act_order_perm(uneven, 8, 4, perm));
  EXPECT_TRUE(cuda::int4_layout_supports(256, 3, 32));
  EXPECT_TRUE(cuda::int4_layout_supports(384, 3, 384));  // one group per row
  EXPECT_FALSE(cuda::int4_layout_supports(96, 3, 32));   // n_in not a multiple of 128
  EXPECT_FALSE(cuda::int4_layout_supports(384, 3, 96));  // group size not a power of two
  EXPECT_FALSE(cuda::int4_layout_supports(256, 3, 16));
}

TEST(CudaInt4, SkinnyGemmMatchesFloat64Reference) {
  KESTREL_REQUIRE_CUDA();
  std::mt19937 rng(41);
  struct Shape {
    int64_t n_tokens, n_in, n_out, group;
    bool f16, act_order, sym, swiglu;
  };
  std::vector<Shape> shapes = {{1, 256, 40, 32, true, false, false, false},  {3, 384, 17, 128, false, false, true, false},
                               {8, 256, 33, 64, true, true, false, false},   {9, 512, 20, 128, true, true, true, true},
                               {16, 128, 5, 128, false, false, false, true}, {21, 256, 19, 32, true, false, false, false},
                               {5, 384, 24, 384, true, false, false, true},  {40, 256, 37, 128, true, false, false, false},
                               {2, 256, 70, 128, true, false, true, false},  {12, 384, 23, 128, false, false, false, false}};
  if (!kCudaEmulated) {
    shapes.push_back({1, 4096, 6144, 128, true, false, true, false});
    shapes.push_back({16, 14336, 4096, 128, true, true, false, true});
    shapes.push_back({64, 4096, 1000, 32, false, false, false, false});
  }
  for (const Shape& sh : shapes) {
    SCOPED_TRACE("tokens " + std::to_string(sh.n_tokens) + " n_in " + std::to_string(sh.n_in) + " n_out " +
                 std::to_string(sh.n_out) + " G " + std::to_string(sh.group) + (sh.act_order ? " act order" : "") +
                 (sh.swiglu ? " swiglu" : ""));
    const Int4Case c = make_case(sh.n_in, sh.n_out, sh.group, sh.f16, sh.act_order, sh.sym, rng);
    DeviceInt4 d(c);
    const int64_t x_cols = sh.swiglu ? 2 * sh.n_in : sh.n_in, x_stride = x_cols + 8;
    const auto x = random_bf16(static_cast<size_t>(sh.n_tokens * x_stride), rng, -2.0f, 2.0f);
    // a(x) as the kernel forms it: silu(gate) * up rounded to bf16 (silu_mul's rounding).
    std::vector<float> a(static_cast<size_t>(sh.n_tokens * sh.n_in));
    for (int64_t t = 0; t < sh.n_tokens; ++t)
      for (int64_t k = 0; k < sh.n_in; ++k) {
        const float g = from_bf16(x[static_cast<size_t>(t * x_stride + k)]);
        a[static_cast<size_t>(t * sh.n_in + k)] =
            sh.swiglu ? from_bf16(to_bf16(g / (1.0f + std::exp(-g)) * from_bf16(x[static_cast<size_t>(t * x_stride + sh.n_in + k)])))
                      : g;
      }
    DeviceBuffer<uint16_t> d_x(x), d_xp(static_cast<size_t>(sh.n_tokens * sh.n_in)),
        d_y(static_cast<size_t>(sh.n_tokens * sh.n_out));
    d_y.poison();
    cuda::SkinnyInt4Args args;
    static_cast<cuda::ProjectionOperands&>(args) = {d_x.bf16(), x_stride, nullptr, d_y.get(), sh.n_tokens,
                                                    sh.n_in,    sh.n_out, sh.swiglu, false};
    args.w4 = d.m;
    if (d.m.perm != nullptr) {  // act order: gather a(x) into the physical order first
      cuda::int4_gather_columns(d_x.bf16(), x_stride, d.m.perm, sh.n_tokens, sh.n_in, sh.swiglu, d_xp.bf16(), nullptr);
      const auto xp = d_xp.download();
      for (int64_t t = 0; t < sh.n_tokens; ++t)
        for (int64_t k = 0; k < sh.n_in; ++k) {
          const float want = a[static_cast<size_t>(t * sh.n_in + c.perm[static_cast<size_t>(k)])];
          const float got = from_bf16(xp[static_cast<size_t>(t * sh.n_in + k)]);
          ASSERT_NEAR(got, want, 1e-6f * std::fabs(want) + 1e-30f) << "gather t " << t << " k " << k;  // silu: __expf
        }
      args.x = d_xp.bf16();
      args.x_stride = sh.n_in;
      args.swiglu = false;
      EXPECT_THROW(
          {
            cuda::SkinnyInt4Args bad = args;
            bad.swiglu = true;
            bad.x_stride = 2 * sh.n_in;
            cuda::skinny_gemm_int4(bad, nullptr);
          },
          Error);
    }
    // The default, and for group sizes from 128 without SwiGLU the benchmark's variants
    // (unroll, row groups, warps) of the token count.
    std::vector<std::tuple<int, int, int>> variants = {{0, 0, 0}};
    if (sh.group >= 128 && !sh.swiglu) {
      if (sh.n_tokens <= 8) variants.insert(variants.end(), {{2, 1, 4}, {1, 1, 8}, {1, 2, 4}});
      else if (sh.n_tokens <= 16) variants.insert(variants.end(), {{1, 2, 4}, {1, 1, 4}});
      else variants.push_back({1, 1, 4});
    }
    for (const auto& [u, r, wp] : variants) {
      SCOPED_TRACE("variant " + std::to_string(u) + " " + std::to_string(r) + " " + std::to_string(wp));
      args.unroll = u, args.row_groups = r, args.warps = wp;
      d_y.poison();
      cuda::skinny_gemm_int4(args, nullptr);
      const auto y = bf16_to_f32(d_y.download());
      int bad = 0;
      for (int64_t t = 0; t < sh.n_tokens; ++t)
        for (int64_t n = 0; n < sh.n_out; ++n) {
          double ref = 0, mag = 0;
          for (int64_t k = 0; k < sh.n_in; ++k) {
            const double p = a[static_cast<size_t>(t * sh.n_in + k)] * c.w[static_cast<size_t>(n * sh.n_in + k)];
            ref += p;
            mag += std::fabs(p);
          }
          const double got = y[static_cast<size_t>(t * sh.n_out + n)];
          if (!(std::fabs(got - ref) <= std::ldexp(std::fabs(ref), -8) + 1e-5 * mag) && ++bad <= 5)
            ADD_FAILURE() << "t " << t << " n " << n << ": " << got << " against " << ref << " (sum |x w| " << mag << ")";
        }
      EXPECT_EQ(bad, 0);
    }
  }
}

TEST(CudaInt4, DequantizeIsExactInChannelOrder) {
  KESTREL_REQUIRE_CUDA();
  std::mt19937 rng(42);
  for (const auto& [n_in, n_out, group, f16, act_order] :
       {std::tuple{256, 7, 32, true, true}, std::tuple{384, 20, 128, false, false}, std::tuple{256, 3, 256, true, false},
        std::tuple{512, 9, 64, false, true}}) {
    SCOPED_TRACE("n_in " + std::to_string(n_in) + " G " + std::to_string(group));
    const Int4Case c = make_case(n_in, n_out, group, f16, act_order, false, rng);
    DeviceInt4 d(c);
    DeviceBuffer<uint16_t> out(static_cast<size_t>(n_in * n_out));
    out.poison();
    cuda::dequantize_int4(d.m, out.bf16(), nullptr);
    const auto got = out.download();
    for (size_t i = 0; i < got.size(); ++i)
      ASSERT_EQ(got[i], to_bf16(static_cast<float>(c.w[i]))) << "element " << i;  // s (q - z) is exact in f32
  }
}

TEST(CudaInt4, UnsupportedShapesAreClearErrors) {
  KESTREL_REQUIRE_CUDA();
  std::mt19937 rng(43);
  const Int4Case c = make_case(128, 4, 32, true, false, false, rng);
  DeviceInt4 d(c);
  DeviceBuffer<uint16_t> x(static_cast<size_t>(65 * 128)), y(static_cast<size_t>(65 * 4));
  cuda::SkinnyInt4Args a;
  static_cast<cuda::ProjectionOperands&>(a) = {x.bf16(), 128, nullptr, y.get(), 65, 128, 4, false, false};
  a.w4 = d.m;
  EXPECT_FALSE(cuda::skinny_gemm_int4_supports(65, d.m));
  EXPECT_THROW(cuda::skinny_gemm_int4(a, nullptr), Error);  // more tokens than the decode kernel takes
  a.n_tokens = 2;
  a.f32_out = true;
  EXPECT_THROW(cuda::skinny_gemm_int4(a, nullptr), Error);  // bf16 output only
  a.f32_out = false;
  a.w4.group_size = 48;
  EXPECT_THROW(cuda::skinny_gemm_int4(a, nullptr), Error);
  EXPECT_THROW(cuda::dequantize_int4(a.w4, y.bf16(), nullptr), Error);
}

}  // namespace
}  // namespace kestrel::test
