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

namespace kestrel::test {
namespace {

uint16_t f32_to_f16_bits(float f) {  // normal values only (the scales drawn here)
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const int32_t e = static_cast<int32_t>((u >> 23) & 0xFFu) - 127 + 15;
  uint32_t m = u & 0x7FFFFFu;
  uint32_t h = sign | (static_cast<uint32_t>(e) << 10) | (m >> 13);
  const uint32_t rest = m & 0x1FFFu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
  return static_cast<uint16_t>(h);
}
float f16_bits_to_f32(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, f = h & 0x3FFu;
  const uint32_t u = sign | ((e + 112) << 23) | (f << 13);
  float v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

// A random INT4 matrix as a checkpoint describes it (input-channel order) and its device copy.
struct Int4Case {
  int64_t n_in = 0, n_out = 0, group = 0;
  bool f16 = true, act_order = false, sym = false;
  std::vector<uint8_t> q;             // [n_out, n_in] codes
  std::vector<uint16_t> scale_bits;   // [n_out, n_groups]
  std::vector<int> zero;              // [n_out, n_groups]
  std::vector<int32_t> g_idx, perm;   // [n_in]; perm empty for the identity
  std::vector<double> w;              // [n_out, n_in] s (q - z), input-channel order
  std::vector<uint32_t> codes, meta;  // the layout

  int64_t n_groups() const { return n_in / group; }
  float scale(int64_t n, int64_t g) const {
    const uint16_t b = scale_bits[static_cast<size_t>(n * n_groups() + g)];
    return f16 ? f16_bits_to_f32(b) : from_bf16(b);
  }
};

Int4Case make_case(int64_t n_in, int64_t n_out, int64_t group, bool f16, bool act_order, bool sym,
                   std::mt19937& rng) {
  Int4Case c;
  c.n_in = n_in, c.n_out = n_out, c.group = group, c.f16 = f16, c.act_order = act_order, c.sym = sym;
  const int64_t ng = c.n_groups();
  std::uniform_int_distribution<int> code(0, 15), zero(0, 16);
  std::uniform_real_distribution<float> sc(2e-3f, 2e-2f);
  c.q.resize(static_cast<size_t>(n_out * n_in));
  for (uint8_t& v : c.q) v = static_cast<uint8_t>(code(rng));
  for (int64_t i = 0; i < n_out * ng; ++i) {
    const float s = sc(rng);
    c.scale_bits.push_back(f16 ? f32_to_f16_bits(s) : to_bf16(s));
    c.zero.push_back(sym ? 8 : zero(rng));
  }
  c.g_idx.resize(static_cast<size_t>(n_in));
  for (int64_t k = 0; k < n_in; ++k) c.g_idx[static_cast<size_t>(k)] = static_cast<int32_t>(k / group);
  if (act_order) std::shuffle(c.g_idx.begin(), c.g_idx.end(), rng);
  EXPECT_TRUE(cuda::int4_act_order_perm(c.g_idx.data(), n_in, group, c.perm));
  EXPECT_EQ(c.perm.empty(), !act_order);
  c.w.resize(c.q.size());
  for (int64_t n = 0; n < n_out; ++n)
    for (int64_t k = 0; k < n_in; ++k) {
      const int64_t g = c.g_idx[static_cast<size_t>(k)];
      c.w[static_cast<size_t>(n * n_in + k)] =
          static_cast<double>(c.scale(n, g)) *
          (c.q[static_cast<size_t>(n * n_in + k)] - c.zero[static_cast<size_t>(n * ng + g)]);
    }
  c.codes.resize(static_cast<size_t>(n_out * n_in / 8));
  cuda::pack_int4_rows(c.q.data(), n_out, n_in, c.perm.empty() ? nullptr : c.perm.data(), c.codes.data());
  for (int64_t i = 0; i < n_out * ng; ++i)
    c.meta.push_back(cuda::int4_meta_word(c.scale_bits[static_cast<size_t>(i)], c.zero[static_cast<size_t>(i)]));
  return c;
}

struct DeviceInt4 {
  DeviceBuffer<uint32_t> codes, meta;
  DeviceBuffer<int32_t> perm;
  cuda::Int4Matrix m;
  explicit DeviceInt4(const Int4Case& c)
      : codes(c.codes), meta(c.meta), perm(c.perm.empty() ? std::vector<int32_t>{0} : c.perm) {
    m.codes = codes.get();
    m.meta = meta.get();
    m.perm = c.perm.empty() ? nullptr : perm.get();
    m.n_in = c.n_in, m.n_out = c.n_out, m.group_size = c.group, m.scale_f16 = c.f16;
  }
};

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
