// CUDA streaming GEMVs over narrow weights against float64 references: INT4 (stream_gemv_w4a16.cuh
// and stream_gemv_narrow.cuh, over the exactly dequantized weights s (q - z)) and FP8 W8A8
// (stream_gemv_w8a8.cuh, over the codes of the weights and of the activation), for one and two
// tokens, the plain, SwiGLU and fused residual + RMSNorm inputs, rows that straddle lines (n_in
// 6144: 1.5 lines of FP8 codes a row; INT4 n_in 2048: four rows a line), uneven last blocks; the
// same bits for a row whatever the block count (batch invariance); and the shapes that go
// elsewhere. Tolerances: every product is exact, the sums are f32 (the tensor cores' over a tile,
// then in a fixed order over tiles, chunks or warps), then one rounding to bf16:
// |y - ref| <= 2^-8 |ref| + 1e-5 sum_k |a_k W_k| (half a bf16 ulp and the f32 sums). The fused
// norm's input is rounded to bf16 by the kernel from f32 arithmetic: the reference rounds the
// float64 norm to bf16, and an input one bf16 ulp off adds at most 2^-7 |a_k W_k| to the bound.
#include <cmath>

#include "backend/cuda/fp8_ops.h"
#include "backend/cuda/int4_ops.h"
#include "core/fp8.h"
#include "cuda_test_util.h"
#include "int4_test_case.h"

namespace kestrel::test {
namespace {

enum class Input { Plain, SwiGLU, Norm };

struct Shape {
  int64_t n_tokens, n_in, n_out;
  int blocks;
  Input input;
};

std::string trace(const Shape& s) {
  const char* in = s.input == Input::Plain ? "plain" : s.input == Input::SwiGLU ? "swiglu" : "norm";
  return "tokens " + std::to_string(s.n_tokens) + " n_in " + std::to_string(s.n_in) + " n_out " +
         std::to_string(s.n_out) + " blocks " + std::to_string(s.blocks) + " " + in;
}

// The input operands of one case and the activation a [n_tokens, n_in] the reference multiplies.
struct Inputs {
  int64_t x_stride = 0;
  std::vector<uint16_t> x, add, norm_w;
  std::vector<float> res;
  std::vector<double> a;
  double norm_slack = 0;  // 2^-7 for the fused norm's rounded input, else 0
  DeviceBuffer<uint16_t> d_x, d_add, d_norm_w;
  DeviceBuffer<float> d_res, d_res_out;

  Inputs(const Shape& s, std::mt19937& rng)
      : x_stride(s.input == Input::SwiGLU ? 2 * s.n_in + 8 : s.n_in + 8),
        x(random_bf16(static_cast<size_t>(s.n_tokens * x_stride), rng, -2.0f, 2.0f)),
        add(random_bf16(static_cast<size_t>(s.n_tokens * s.n_in), rng)),
        norm_w(random_bf16(static_cast<size_t>(s.n_in), rng, 0.5f, 1.5f)),
        res(random_f32(static_cast<size_t>(s.n_tokens * s.n_in), rng, -3.0f, 3.0f)),
        a(static_cast<size_t>(s.n_tokens * s.n_in)),
        d_x(x),
        d_add(add),
        d_norm_w(norm_w),
        d_res(res),
        d_res_out(res.size()) {
    const int64_t n = s.n_in;
    for (int64_t t = 0; t < s.n_tokens; ++t) {
      double ss = 0;
      for (int64_t k = 0; k < n; ++k) {
        const size_t i = static_cast<size_t>(t * n + k);
        const double r = static_cast<double>(res[i]) + from_bf16(add[i]);
        ss += r * r;
      }
      const double inv = 1.0 / std::sqrt(ss / static_cast<double>(n) + 1e-5);
      for (int64_t k = 0; k < n; ++k) {
        const size_t i = static_cast<size_t>(t * n + k);
        double v = from_bf16(x[static_cast<size_t>(t * x_stride + k)]);
        if (s.input == Input::SwiGLU)  // silu_mul's rounding of silu(gate) * up
          v = from_bf16(to_bf16(static_cast<float>(v / (1.0 + std::exp(-v))) *
                                from_bf16(x[static_cast<size_t>(t * x_stride + n + k)])));
        if (s.input == Input::Norm) {
          const double r = static_cast<double>(res[i]) + from_bf16(add[i]);
          v = from_bf16(to_bf16(static_cast<float>(r * inv * from_bf16(norm_w[static_cast<size_t>(k)]))));
        }
        a[i] = v;
      }
    }
    norm_slack = s.input == Input::Norm ? std::ldexp(1.0, -7) : 0.0;
  }

  void set(cuda::StreamGemvArgs& g, const Shape& s, void* y) const {
    g.x = d_x.bf16();
    g.x_stride = x_stride;
    g.y = y;
    g.n_tokens = s.n_tokens, g.n_in = s.n_in, g.n_out = s.n_out;
    g.swiglu = s.input == Input::SwiGLU;
    g.blocks = s.blocks;
    if (s.input == Input::Norm) {
      g.norm_residual_in = d_res.get();
      g.norm_add = d_add.bf16();
      g.norm_weight = d_norm_w.bf16();
      g.norm_residual_out = d_res_out.get();
      g.norm_eps = 1e-5f;
    }
  }
};

// Counts the outputs outside the bound against a [n_tokens, n_in] . w^T, w [n_out, n_in] float64.
int count_bad(const std::vector<float>& y, const std::vector<double>& a, const std::vector<double>& w, const Shape& s,
              double slack) {
  int bad = 0;
  for (int64_t t = 0; t < s.n_tokens; ++t)
    for (int64_t o = 0; o < s.n_out; ++o) {
      double ref = 0, mag = 0;
      for (int64_t k = 0; k < s.n_in; ++k) {
        const double p = a[static_cast<size_t>(t * s.n_in + k)] * w[static_cast<size_t>(o * s.n_in + k)];
        ref += p;
        mag += std::fabs(p);
      }
      const double got = y[static_cast<size_t>(t * s.n_out + o)];
      if (!(std::fabs(got - ref) <= std::ldexp(std::fabs(ref), -8) + (1e-5 + slack) * mag) && ++bad <= 5)
        ADD_FAILURE() << "t " << t << " o " << o << ": " << got << " against " << ref << " (sum |a w| " << mag << ")";
    }
  return bad;
}

std::vector<Shape> shapes() {
  std::vector<Shape> v;
  for (const Input in : {Input::Plain, Input::SwiGLU, Input::Norm}) {
    v.push_back({1, 2048, 7, 3, in});   // a short last block
    v.push_back({2, 4096, 5, 0, in});   // one row per block
    v.push_back({1, 6144, 40, 2, in});  // FP8: 1.5 lines a row, over several stages and ring turns
    v.push_back({2, 2048, 33, 2, in});  // INT4: four rows a line
  }
  v.push_back({2, 16384, 3, 0, Input::Plain});  // the widest x
  if (!kCudaEmulated) {
    v.push_back({1, 4096, 6144, 0, Input::Norm});
    v.push_back({2, 14336, 4096, 0, Input::SwiGLU});
    v.push_back({1, 4096, 28672, 0, Input::Norm});
  }
  return v;
}

// Another block count than the case's (so another place of each row in its block), within the
// kernel's rows per block.
int other_blocks(const Shape& s) { return s.blocks != 0 ? 0 : static_cast<int>((s.n_out + 199) / 200); }

std::vector<uint8_t> random_e4m3(size_t n, std::mt19937& rng) {
  std::uniform_int_distribution<int> code(0, 255);
  std::vector<uint8_t> v(n);
  for (uint8_t& c : v) {
    do c = static_cast<uint8_t>(code(rng));
    while ((c & 0x7F) == 0x7F);  // no NaN codes: weights hold none
  }
  return v;
}

// W8A8 (stream_gemv_w8a8) against float64: the reference quantizes each token's activation as
// quantize_rows_fp8 does (scale = max |a| / 448, e4m3(a / scale) in f32 with core/fp8.h's rounding)
// and sums the exact products of the codes. The kernel's products are exact too; its sums are the
// tensor cores' over 32 products, then f32: |y - ref| <= 2^-8 |ref| + 1e-5 sum_k |products|. The
// fused norm's bf16 input may be an ulp off the reference's (the header comment), and such an
// element may round to the neighbouring code: a slack of 2^-6 there. Also the fused norm's residual
// sum exactly, and the same bits from another block count (batch invariance) with the L2 prefetch
// of a next weight (StreamPrefetch, a hint: it must change nothing).
TEST(CudaStreamGemvNarrow, W8a8MatchesFloat64Reference) {
  KESTREL_REQUIRE_CUDA();
  std::mt19937 rng(64);
  for (const Shape& s : shapes()) {
    SCOPED_TRACE(trace(s));
    ASSERT_TRUE(cuda::stream_gemv_w8a8_supports(s.n_tokens, s.n_in, s.n_out, s.blocks));
    const auto codes = random_e4m3(static_cast<size_t>(s.n_out * s.n_in), rng);
    const auto scale = random_f32(static_cast<size_t>(s.n_out), rng, 1e-3f, 4e-3f);
    const Inputs in(s, rng);
    // The activation as the kernel multiplies it: codes times the token's scale.
    std::vector<double> aq(in.a.size());
    for (int64_t t = 0; t < s.n_tokens; ++t) {
      float amax = 0;
      for (int64_t k = 0; k < s.n_in; ++k)
        amax = std::max(amax, std::fabs(static_cast<float>(in.a[static_cast<size_t>(t * s.n_in + k)])));
      const float xs = amax > 0 ? amax / kFp8E4m3Max : 1.0f;
      for (int64_t k = 0; k < s.n_in; ++k) {
        const size_t i = static_cast<size_t>(t * s.n_in + k);
        aq[i] = static_cast<double>(xs) * e4m3_to_float(float_to_e4m3(static_cast<float>(in.a[i]) / xs));
      }
    }
    std::vector<double> w(codes.size());
    for (int64_t o = 0; o < s.n_out; ++o)
      for (int64_t k = 0; k < s.n_in; ++k) {
        const size_t i = static_cast<size_t>(o * s.n_in + k);
        w[i] = static_cast<double>(scale[static_cast<size_t>(o)]) * e4m3_to_float(codes[i]);
      }
    DeviceBuffer<uint8_t> d_w(codes);
    DeviceBuffer<float> d_scale(scale);
    DeviceBuffer<uint16_t> d_y(static_cast<size_t>(s.n_tokens * s.n_out)), d_y2(d_y.size());
    d_y.poison();
    cuda::StreamGemvFp8Args g;
    in.set(g, s, d_y.get());
    g.w8 = d_w.get();
    g.w_scale = d_scale.get();
    cuda::stream_gemv_w8a8(g, nullptr);
    const auto y = d_y.download();
    EXPECT_EQ(count_bad(bf16_to_f32(y), aq, w, s, s.input == Input::Norm ? std::ldexp(1.0, -6) : 0.0), 0);
    if (s.input == Input::Norm) {  // the residual sum, exactly
      const auto r = in.d_res_out.download();
      for (size_t i = 0; i < r.size(); ++i) ASSERT_EQ(r[i], in.res[i] + from_bf16(in.add[i])) << i;
    }
    g.blocks = other_blocks(s);
    g.next = cuda::stream_prefetch_of(d_w.get(), s.n_out, s.n_in, int64_t{64} << 10);
    g.y = d_y2.get();
    d_y2.poison();
    cuda::stream_gemv_w8a8(g, nullptr);
    EXPECT_EQ(d_y2.download(), y);
  }
}

TEST(CudaStreamGemvNarrow, Int4MatchesFloat64Reference) {
  KESTREL_REQUIRE_CUDA();
  std::mt19937 rng(62);
  int i = 0;
  for (const Shape& s : shapes()) {
    // Group sizes 128 and 256, f16 and bf16 scales, zero points from 0 to 16 and symmetric.
    const int64_t group = i % 3 == 2 ? 256 : 128;
    const bool f16 = i % 2 == 0, sym = i % 4 == 3;
    ++i;
    SCOPED_TRACE(trace(s) + " G " + std::to_string(group) + (f16 ? " f16" : " bf16") + (sym ? " sym" : ""));
    const Int4Case c = make_case(s.n_in, s.n_out, group, f16, false, sym, rng);
    DeviceInt4 d(c);
    ASSERT_TRUE(cuda::stream_gemv_int4_supports(s.n_tokens, d.m, s.blocks));
    Inputs in(s, rng);
    // Stages 0: groups of 128 take stream_gemv_w4a16.cuh, wider groups stream_gemv_narrow.cuh;
    // stages 4: stream_gemv_narrow.cuh for every group size.
    for (const int stages : {0, 4}) {
      SCOPED_TRACE("stages " + std::to_string(stages));
      ASSERT_TRUE(cuda::stream_gemv_int4_supports(s.n_tokens, d.m, s.blocks, stages));
      DeviceBuffer<uint16_t> d_y(static_cast<size_t>(s.n_tokens * s.n_out)), d_y2(d_y.size());
      d_y.poison();
      in.d_res_out.poison();
      cuda::StreamGemvInt4Args g;
      in.set(g, s, d_y.get());
      g.w4 = d.m;
      g.stages = stages;
      cuda::stream_gemv_int4(g, nullptr);
      const auto y = d_y.download();
      EXPECT_EQ(count_bad(bf16_to_f32(y), in.a, c.w, s, in.norm_slack), 0);
      if (s.input == Input::Norm) {  // the residual sum, exactly
        const auto r = in.d_res_out.download();
        for (size_t j = 0; j < r.size(); ++j) ASSERT_EQ(r[j], in.res[j] + from_bf16(in.add[j])) << j;
      }
      g.blocks = other_blocks(s);
      g.next = cuda::stream_prefetch_of(d.m.codes, s.n_out, s.n_in / 2, int64_t{64} << 10);
      g.y = d_y2.get();
      d_y2.poison();
      cuda::stream_gemv_int4(g, nullptr);
      EXPECT_EQ(d_y2.download(), y);
    }
  }
}

// The prefetch descriptor: block b of a streaming GEMV over the next weight streams rows [b r, (b +
// 1) r) with r = ceil(n_out / SMs), so block b of this one prefetches from byte b r row_bytes, at
// most one block's rows, and nothing for a zero size or a null weight.
TEST(CudaStreamGemvNarrow, PrefetchStartsAtEachBlocksFirstRow) {
  KESTREL_REQUIRE_CUDA();
#if defined(KESTREL_CUDA_EMULATE)
  const int64_t sms = 4;  // the emulation's SM count (stream_gemv.cu)
#else
  int dev = 0, v = 0;
  ASSERT_EQ(cudaGetDevice(&dev), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev), cudaSuccess);
  const int64_t sms = v;
#endif
  DeviceBuffer<uint8_t> w(16);
  for (const int64_t n_out : {int64_t{1}, int64_t{3}, sms, int64_t{6144}, int64_t{28672}}) {
    SCOPED_TRACE("n_out " + std::to_string(n_out));
    const int64_t rows = (n_out + std::min(sms, n_out) - 1) / std::min(sms, n_out);
    const cuda::StreamPrefetch p = cuda::stream_prefetch_of(w.get(), n_out, 4096, int64_t{64} << 10);
    EXPECT_EQ(p.base, static_cast<const void*>(w.get()));
    EXPECT_EQ(p.block_stride, rows * 4096);
    EXPECT_EQ(p.total, n_out * 4096);
    EXPECT_EQ(p.bytes, std::min<int64_t>(int64_t{64} << 10, rows * 4096));
  }
  EXPECT_EQ(cuda::stream_prefetch_of(w.get(), 64, 4096, 0).base, nullptr);
  EXPECT_EQ(cuda::stream_prefetch_of(nullptr, 64, 4096, 1024).base, nullptr);
}

TEST(CudaStreamGemvNarrow, ShapesItDoesNotTakeAreRefused) {
  KESTREL_REQUIRE_CUDA();
  std::mt19937 rng(63);
  EXPECT_FALSE(cuda::stream_gemv_w8a8_supports(1, 18432, 64));  // wider than kStreamGemvMaxIn
  const Int4Case g64 = make_case(2048, 4, 64, true, false, false, rng);  // a lane's 32 codes span groups
  const Int4Case act = make_case(2048, 4, 128, true, true, false, rng);  // act order: gathered first
  const Int4Case narrow = make_case(1152, 4, 128, true, false, false, rng);
  DeviceInt4 d64(g64), dact(act), dnarrow(narrow);
  EXPECT_FALSE(cuda::stream_gemv_int4_supports(1, d64.m));
  EXPECT_FALSE(cuda::stream_gemv_int4_supports(1, dact.m));
  EXPECT_FALSE(cuda::stream_gemv_int4_supports(1, dnarrow.m));
  cuda::Int4Matrix no_perm = dact.m;
  no_perm.perm = nullptr;
  EXPECT_TRUE(cuda::stream_gemv_int4_supports(2, no_perm));
  // The errors: an unsupported shape, f32 output, missing scales, an aliased norm residual.
  DeviceBuffer<uint16_t> x(2 * 2048), y(2 * 4);
  DeviceBuffer<uint8_t> w8(4 * 2048);
  DeviceBuffer<float> sc(4), res(2 * 2048);
  cuda::StreamGemvFp8Args f;
  f.x = x.bf16(), f.x_stride = 2048, f.y = y.get(), f.n_tokens = 2, f.n_in = 2048, f.n_out = 4;
  f.w8 = w8.get(), f.w_scale = sc.get();
  cuda::StreamGemvFp8Args bad = f;
  bad.n_tokens = 3;
  EXPECT_THROW(cuda::stream_gemv_w8a8(bad, nullptr), Error);
  bad = f, bad.f32_out = true;
  EXPECT_THROW(cuda::stream_gemv_w8a8(bad, nullptr), Error);
  bad = f, bad.w_scale = nullptr;
  EXPECT_THROW(cuda::stream_gemv_w8a8(bad, nullptr), Error);
  bad = f, bad.norm_residual_in = res.get(), bad.norm_weight = x.bf16(), bad.norm_residual_out = res.get();
  EXPECT_THROW(cuda::stream_gemv_w8a8(bad, nullptr), Error);
  EXPECT_FALSE(cuda::stream_gemv_w8a8_supports(3, 4096, 64));   // three tokens
  EXPECT_FALSE(cuda::stream_gemv_w8a8_supports(1, 3072, 64));   // n_in not a multiple of 2048
  EXPECT_TRUE(cuda::stream_gemv_w8a8_supports(2, 14336, 4096, 132));  // the 8B's down projection on an H200
  cuda::StreamGemvInt4Args q;
  static_cast<cuda::StreamGemvArgs&>(q) = f;
  q.w4 = dact.m;
  EXPECT_THROW(cuda::stream_gemv_int4(q, nullptr), Error);  // act order
}

}  // namespace
}  // namespace kestrel::test
