// FP8 E4M3 weights on the GPU: the row quantizer against core/fp8.h's rounding (exact), the FP8
// skinny GEMM (W8A16 decode) and the W8A8 GEMM (cuBLASLt with per-token and per-channel scales, or
// unscaled and then scaled up to 128 tokens; a plain loop in the emulation) against float64
// references over the same codes (the whole model in FP8: test_cuda_model_runner.cpp).
// Tolerances: bf16 output, one or two roundings of an f32 sum: relative L2 error <= 4e-3 (half a
// bf16 ulp is 2e-3 relative); f32 output 1e-5.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "backend/cuda/cuda_ops.h"
#include "backend/cuda/fp8_ops.h"
#include "backend/cuda/gemm.h"
#include "core/fp8.h"
#include "cuda_test_util.h"

namespace kestrel::test {
namespace {

// Random finite E4M3 codes (every code but the two NaNs can occur).
std::vector<uint8_t> random_codes(size_t n, std::mt19937& rng) {
  std::vector<uint8_t> c(n);
  std::uniform_int_distribution<int> d(0, 253);
  for (uint8_t& b : c) {
    const int v = d(rng);
    b = static_cast<uint8_t>(v >= 0x7F ? v + 1 : v);  // skip 0x7F; 254 values, 0xFF never drawn
  }
  return c;
}

// y[t, o] = scale[o] * sum_k a[t, k] * e4m3(w[o, k]) in float64; a [n_tokens, *] rows a_stride apart.
std::vector<double> fp8_reference(const std::vector<float>& a, int64_t a_stride, const std::vector<uint8_t>& w,
                                  const std::vector<float>& scale, int64_t n_tokens, int64_t n_in, int64_t n_out) {
  std::vector<double> ref(static_cast<size_t>(n_tokens * n_out));
  for (int64_t t = 0; t < n_tokens; ++t)
    for (int64_t o = 0; o < n_out; ++o) {
      double s = 0.0;
      for (int64_t k = 0; k < n_in; ++k)
        s += static_cast<double>(a[static_cast<size_t>(t * a_stride + k)]) *
             e4m3_to_float(w[static_cast<size_t>(o * n_in + k)]);
      ref[static_cast<size_t>(t * n_out + o)] = s * scale[static_cast<size_t>(o)];
    }
  return ref;
}

TEST(CudaFp8, E4m3RoundingIsNearestEvenAndEveryCodeRoundTrips) {
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7F) == 0x7F) continue;
    EXPECT_EQ(float_to_e4m3(e4m3_to_float(static_cast<uint8_t>(c))), c == 0x80 ? 0x80 : c) << c;
  }
  EXPECT_EQ(e4m3_to_float(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_EQ(e4m3_to_float(0x7E), 448.0f);
  EXPECT_EQ(float_to_e4m3(1000.0f), 0x7E);                // saturates
  EXPECT_EQ(float_to_e4m3(-1000.0f), 0xFE);
  EXPECT_EQ(float_to_e4m3(1.0625f), 0x38);                // tie between 1 and 1.125: even (1)
  EXPECT_EQ(float_to_e4m3(1.1875f), 0x3A);                // tie between 1.125 and 1.25: even (1.25)
  EXPECT_EQ(float_to_e4m3(std::ldexp(1.5f, -9)), 0x02);   // subnormal tie 1.5 -> 2
  EXPECT_EQ(float_to_e4m3(std::nanf("")), 0x7F);
}

// The W8A8 streaming GEMV quantizes its input by quotient_by_reciprocal: for bf16 inputs and
// scales amax / 448 of at least 2^-40 it must round every quotient as the division does where an
// E4M3 code can tell (|x / s| >= 2^-60; below, the codes are 0 either way).
TEST(CudaFp8, QuotientByReciprocalRoundsAsDivision) {
  std::mt19937 rng(5);
  std::uniform_int_distribution<uint32_t> mant(0, 127), sign(0, 1);
  int64_t checked = 0;
  for (uint32_t e = 1; e < 255; ++e)
    for (int trial = 0; trial < 16; ++trial) {
      const float amax = from_bf16(static_cast<uint16_t>(e << 7 | mant(rng)));
      const float s = amax / kFp8E4m3Max;
      if (!(s >= kQuotientByReciprocalMinScale) || std::isinf(amax)) continue;
      const float rs = 1.0f / s;
      std::uniform_int_distribution<uint32_t> exp(0, e);
      for (int i = 0; i < 512; ++i) {
        float x = from_bf16(static_cast<uint16_t>(sign(rng) << 15 | exp(rng) << 7 | mant(rng)));
        if (i == 0) x = amax;
        if (std::fabs(x) > amax) continue;
        const float want = x / s, got = quotient_by_reciprocal(x, s, rs);
        ASSERT_EQ(float_to_e4m3(got), float_to_e4m3(want)) << x << " / " << s;
        if (std::fabs(want) >= 0x1p-60f) ASSERT_EQ(got, want) << x << " / " << s;
        ++checked;
      }
    }
  EXPECT_GT(checked, 500000);
}

TEST(CudaFp8, QuantizeRowsMatchesTheHostRounding) {
  KESTREL_REQUIRE_CUDA();
  std::mt19937 rng(21);
  const int64_t rows = 8, cols = 136, stride = 144;
  auto x = random_bf16(static_cast<size_t>(rows * stride), rng, -3.0f, 3.0f);
  for (int64_t c = 0; c < stride; ++c) x[static_cast<size_t>(2 * stride + c)] = 0;  // an all-zero row
  for (int64_t c = 0; c < cols; ++c) x[static_cast<size_t>(3 * stride + c)] = to_bf16(1e-4f * static_cast<float>(c));
  // Row 5: scale 1 (amax 448), values on E4M3's ties (1.0625 between 1 and 1.125, 17 between 16
  // and 18, 0.0078125 between subnormal codes 3 and 4 x 2^-9 ... as the rounding meets them), both
  // zeros and values past the largest code.
  const float ties[] = {448.0f, 1.0625f, -1.0625f, 1.1875f, 17.0f, -19.0f, 0.0068359375f, 0.0087890625f,
                        0.0f, -0.0f, 0.5625f, 240.0f, -416.0f, 3.0f * 0.001953125f / 2.0f, 100.0f, -0.0009765625f};
  for (int64_t c = 0; c < cols; ++c)
    x[static_cast<size_t>(5 * stride + c)] = to_bf16(ties[c % 16] * (c % 32 < 16 ? 1.0f : -1.0f));
  // Row 6: a scale below 2^-40 (the quantizers divide there instead of using the reciprocal);
  // row 7: bf16 subnormals, a scale far below it.
  for (int64_t c = 0; c < cols; ++c) {
    x[static_cast<size_t>(6 * stride + c)] = to_bf16(1e-11f * static_cast<float>(c % 17 - 8));
    x[static_cast<size_t>(7 * stride + c)] = to_bf16(1e-39f * static_cast<float>(c % 9 - 4));
  }
  DeviceBuffer<uint16_t> d_x(x);
  DeviceBuffer<uint8_t> d_q(static_cast<size_t>(rows * cols));
  DeviceBuffer<float> d_s(static_cast<size_t>(rows));
  d_q.poison();
  d_s.poison();
  cuda::quantize_rows_fp8(d_x.bf16(), stride, rows, cols, d_q.get(), d_s.get(), nullptr);
  const auto q = d_q.download();
  const auto s = d_s.download();
  for (int64_t r = 0; r < rows; ++r) {
    float amax = 0;
    for (int64_t c = 0; c < cols; ++c) amax = std::max(amax, std::fabs(from_bf16(x[static_cast<size_t>(r * stride + c)])));
    const float want_s = amax > 0 ? amax / kFp8E4m3Max : 1.0f;
    EXPECT_EQ(s[static_cast<size_t>(r)], want_s) << "row " << r;
    for (int64_t c = 0; c < cols; ++c)
      ASSERT_EQ(q[static_cast<size_t>(r * cols + c)],
                float_to_e4m3(from_bf16(x[static_cast<size_t>(r * stride + c)]) / want_s))
          << "row " << r << " col " << c;
  }
  EXPECT_LT(s[6], kQuotientByReciprocalMinScale);
  EXPECT_GT(s[6], 0.0f);
  EXPECT_EQ(q[static_cast<size_t>(5 * cols + 9)], 0x80);  // -0 keeps its sign
  EXPECT_THROW(cuda::quantize_rows_fp8(d_x.bf16(), stride, rows, 12, d_q.get(), d_s.get(), nullptr), Error);
}

TEST(CudaFp8, SkinnyGemmMatchesFloat64ReferenceForEveryVariant) {
  KESTREL_REQUIRE_CUDA();
  std::mt19937 rng(22);
  struct Case {
    int64_t n_tokens, n_in, n_out;
  };
  std::vector<Case> cases = {{1, 576, 40}, {3, 48, 17}, {8, 16, 1}, {9, 272, 33}, {16, 320, 20}};
  if (!kCudaEmulated) {
    cases.push_back({1, 4096, 6144});
    cases.push_back({4, 14336, 4096});
  }
  for (const Case& c : cases) {
    const std::vector<std::pair<int, int>> variants =
        c.n_tokens <= 8 ? std::vector<std::pair<int, int>>{{0, 0}, {4, 4}, {2, 8}, {4, 8}, {1, 8}, {2, 4}}
                        : std::vector<std::pair<int, int>>{{0, 0}, {1, 8}, {2, 4}};
    const int64_t x_stride = c.n_in + 8;
    const auto x = random_bf16(static_cast<size_t>(c.n_tokens * x_stride), rng);
    const auto w = random_codes(static_cast<size_t>(c.n_out * c.n_in), rng);
    const auto scale = random_f32(static_cast<size_t>(c.n_out), rng, 1e-3f, 1e-2f);
    const auto ref = fp8_reference(bf16_to_f32(x), x_stride, w, scale, c.n_tokens, c.n_in, c.n_out);
    DeviceBuffer<uint16_t> d_x(x);
    DeviceBuffer<uint8_t> d_w(w);
    DeviceBuffer<float> d_s(scale);
    for (const bool f32_out : {false, true})
      for (const auto& [unroll, warps] : variants) {
        SCOPED_TRACE("tokens " + std::to_string(c.n_tokens) + " n_in " + std::to_string(c.n_in) + " n_out " +
                     std::to_string(c.n_out) + (f32_out ? " f32" : " bf16") + " unroll " + std::to_string(unroll) +
                     " warps " + std::to_string(warps));
        cuda::SkinnyFp8Args a;
        a.x = d_x.bf16();
        a.x_stride = x_stride;
        a.n_tokens = c.n_tokens;
        a.n_in = c.n_in;
        a.n_out = c.n_out;
        a.f32_out = f32_out;
        a.w8 = d_w.get();
        a.w_scale = d_s.get();
        a.unroll = unroll;
        a.warps = warps;
        const auto out = run_to_f32(static_cast<size_t>(c.n_tokens * c.n_out), f32_out, [&](void* y) {
          a.y = y;
          cuda::skinny_gemm_fp8(a, nullptr);
        });
        EXPECT_LE(rel_error(out, ref), f32_out ? 1e-5 : 4e-3);
      }
  }
}

TEST(CudaFp8, SkinnyGemmSwigluInputIsBitIdenticalToSiluMulFirst) {
  KESTREL_REQUIRE_CUDA();
  std::mt19937 rng(23);
  const int64_t n = 5, f = 96, n_out = 24;
  const auto gate_up = random_bf16(static_cast<size_t>(n * 2 * f), rng, -6.0f, 6.0f);
  const auto w = random_codes(static_cast<size_t>(n_out * f), rng);
  const auto scale = random_f32(static_cast<size_t>(n_out), rng, 1e-3f, 1e-2f);
  DeviceBuffer<uint16_t> d_gu(gate_up), d_act(static_cast<size_t>(n * f));
  DeviceBuffer<uint16_t> d_fused(static_cast<size_t>(n * n_out)), d_plain(static_cast<size_t>(n * n_out));
  DeviceBuffer<uint8_t> d_w(w);
  DeviceBuffer<float> d_s(scale);
  cuda::silu_mul(d_gu.bf16(), d_act.bf16(), n, f, nullptr);
  cuda::SkinnyFp8Args a;
  a.x = d_act.bf16();
  a.x_stride = f;
  a.n_tokens = n;
  a.n_in = f;
  a.n_out = n_out;
  a.w8 = d_w.get();
  a.w_scale = d_s.get();
  a.y = d_plain.get();
  cuda::skinny_gemm_fp8(a, nullptr);
  a.x = d_gu.bf16();
  a.x_stride = 2 * f;
  a.swiglu = true;
  a.y = d_fused.get();
  cuda::skinny_gemm_fp8(a, nullptr);
  EXPECT_EQ(d_fused.download(), d_plain.download());
}

// scale_fp8_product (the second half of run_fp8 up to kFp8UnscaledMaxTokens): every output
// scaled once, as bf16(y * (x_scale[t] * w_scale[o])) in f32, bit for bit; n_out spans more than
// one block of 2,048 outputs, and (on a GPU) the rows span more than one grid; a width that is no
// multiple of 8 is an error.
TEST(CudaFp8, ScaleFp8ProductScalesEveryOutputOnce) {
  KESTREL_REQUIRE_CUDA();
  std::mt19937 rng(7);
  const auto w_scale = random_f32(2056, rng, 1e-4f, 1e-2f);
  DeviceBuffer<float> d_ws(w_scale);
  // n_tokens x n_out random products scaled in place, each output against the host's rounding.
  const auto expect_scaled = [&](int64_t n_tokens, int64_t n_out) {
    const auto y = random_bf16(static_cast<size_t>(n_tokens * n_out), rng, -300.0f, 300.0f);
    const auto x_scale = random_f32(static_cast<size_t>(n_tokens), rng, 1e-3f, 1e-1f);
    DeviceBuffer<uint16_t> d_y(y);
    DeviceBuffer<float> d_xs(x_scale);
    cuda::scale_fp8_product(d_y.bf16(), d_xs.get(), d_ws.get(), n_tokens, n_out, nullptr);
    const auto got = d_y.download();
    for (int64_t t = 0; t < n_tokens; ++t)
      for (int64_t o = 0; o < n_out; ++o) {
        const size_t i = static_cast<size_t>(t * n_out + o);
        const float want = from_bf16(y[i]) * (x_scale[static_cast<size_t>(t)] * w_scale[static_cast<size_t>(o)]);
        ASSERT_EQ(got[i], to_bf16(want)) << "t " << t << ", o " << o;
      }
  };
  expect_scaled(3, 2056);
  DeviceBuffer<uint16_t> d_y(static_cast<size_t>(3 * 2056));
  DeviceBuffer<float> d_xs(3);
  EXPECT_THROW(cuda::scale_fp8_product(d_y.bf16(), d_xs.get(), d_ws.get(), 3, 2052, nullptr), Error);
  // More rows than a grid's y dimension holds (65,535): the rows past it by striding, each once. On
  // a GPU only: the emulation runs the 65,535 blocks one thread at a time.
  if (!kCudaEmulated) expect_scaled(65535 + 70, 8);
}

// The fused producers of a W8A8 GEMM's input against their unfused sequences (scale_fp8_product
// when the input is an unscaled product, add_rms_norm or silu_mul, quantize_rows_fp8): the same
// residual, codes and scales bit for bit, at widths that take one to eight chunks a thread, with
// the x scale array read and written in place as the runner passes it.
TEST(CudaFp8, AddRmsNormFp8IsTheUnfusedSequenceBitForBit) {
  KESTREL_REQUIRE_CUDA();
  std::mt19937 rng(31);
  const int64_t n_tokens = 3;
  for (const int64_t dim : {576, 4096, 5120, 16384, 32768})
    for (const int mode : {0, 1, 2}) {  // add: none, a scaled bf16 row, an unscaled product
      SCOPED_TRACE("dim " + std::to_string(dim) + " mode " + std::to_string(mode));
      const size_t nd = static_cast<size_t>(n_tokens * dim);
      const auto residual = random_f32(nd, rng, -3.0f, 3.0f);
      const auto add = random_bf16(nd, rng, mode == 2 ? -400.0f : -2.0f, mode == 2 ? 400.0f : 2.0f);
      const auto weight = random_bf16(static_cast<size_t>(dim), rng, 0.5f, 1.5f);
      const auto x_scale = random_f32(static_cast<size_t>(n_tokens), rng, 1e-3f, 1e-2f);
      const auto w_scale = random_f32(static_cast<size_t>(dim), rng, 1e-3f, 1e-2f);
      DeviceBuffer<float> r1(residual), r2(residual), s1(static_cast<size_t>(n_tokens)), s2(x_scale), ws(w_scale);
      DeviceBuffer<uint16_t> a1(add), a2(add), w(weight), normed(nd);
      DeviceBuffer<uint8_t> q1(nd), q2(nd);
      const cuda::bf16* add1 = mode == 0 ? nullptr : a1.bf16();
      if (mode == 2) cuda::scale_fp8_product(a1.bf16(), s2.get(), ws.get(), n_tokens, dim, nullptr);
      cuda::add_rms_norm(r1.get(), add1, w.bf16(), normed.bf16(), n_tokens, dim, 1e-5f, nullptr);
      cuda::quantize_rows_fp8(normed.bf16(), dim, n_tokens, dim, q1.get(), s1.get(), nullptr);
      // Fused, the product's x scale and the codes' scale one array (s2), as the runner has them.
      cuda::add_rms_norm_fp8(r2.get(), mode == 0 ? nullptr : a2.bf16(), mode == 2 ? s2.get() : nullptr,
                             mode == 2 ? ws.get() : nullptr, w.bf16(), q2.get(), s2.get(), n_tokens, dim, 1e-5f,
                             nullptr);
      const auto res1 = r1.download(), res2 = r2.download();
      ASSERT_EQ(0, std::memcmp(res1.data(), res2.data(), nd * sizeof(float)));
      ASSERT_EQ(q1.download(), q2.download());
      const auto sc1 = s1.download(), sc2 = s2.download();
      ASSERT_EQ(0, std::memcmp(sc1.data(), sc2.data(), sc1.size() * sizeof(float)));
    }
  DeviceBuffer<float> r(16);
  DeviceBuffer<uint16_t> w(16);
  DeviceBuffer<uint8_t> q(16);
  DeviceBuffer<float> s(2);
  EXPECT_THROW(cuda::add_rms_norm_fp8(r.get(), nullptr, nullptr, nullptr, w.bf16(), q.get(), s.get(), 2, 12, 1e-5f,
                                      nullptr),
               Error);
  EXPECT_THROW(cuda::add_rms_norm_fp8(r.get(), w.bf16(), s.get(), nullptr, w.bf16(), q.get(), s.get(), 2, 8, 1e-5f,
                                      nullptr),
               Error);
}

TEST(CudaFp8, SiluMulFp8IsTheUnfusedSequenceBitForBit) {
  KESTREL_REQUIRE_CUDA();
  std::mt19937 rng(32);
  const int64_t n_tokens = 3;
  for (const int64_t n_ff : {1536, 8192, 14336, 30720})
    for (const bool unscaled : {false, true}) {
      SCOPED_TRACE("n_ff " + std::to_string(n_ff) + (unscaled ? " unscaled" : ""));
      const size_t n_gu = static_cast<size_t>(n_tokens * 2 * n_ff), n_h = static_cast<size_t>(n_tokens * n_ff);
      const auto gate_up = random_bf16(n_gu, rng, unscaled ? -900.0f : -6.0f, unscaled ? 900.0f : 6.0f);
      const auto x_scale = random_f32(static_cast<size_t>(n_tokens), rng, 1e-3f, 1e-2f);
      const auto w_scale = random_f32(static_cast<size_t>(2 * n_ff), rng, 1e-3f, 1e-2f);
      DeviceBuffer<uint16_t> gu1(gate_up), gu2(gate_up), h(n_h);
      DeviceBuffer<float> s1(static_cast<size_t>(n_tokens)), s2(x_scale), ws(w_scale);
      DeviceBuffer<uint8_t> q1(n_h), q2(n_h);
      if (unscaled) cuda::scale_fp8_product(gu1.bf16(), s2.get(), ws.get(), n_tokens, 2 * n_ff, nullptr);
      cuda::silu_mul(gu1.bf16(), h.bf16(), n_tokens, n_ff, nullptr);
      cuda::quantize_rows_fp8(h.bf16(), n_ff, n_tokens, n_ff, q1.get(), s1.get(), nullptr);
      cuda::silu_mul_fp8(gu2.bf16(), unscaled ? s2.get() : nullptr, unscaled ? ws.get() : nullptr, q2.get(), s2.get(),
                         n_tokens, n_ff, nullptr);
      ASSERT_EQ(q1.download(), q2.download());
      const auto sc1 = s1.download(), sc2 = s2.download();
      ASSERT_EQ(0, std::memcmp(sc1.data(), sc2.data(), sc1.size() * sizeof(float)));
    }
  DeviceBuffer<uint16_t> gu(64);
  DeviceBuffer<uint8_t> q(32);
  DeviceBuffer<float> s(2);
  EXPECT_THROW(cuda::silu_mul_fp8(gu.bf16(), nullptr, nullptr, q.get(), s.get(), 2, 12, nullptr), Error);
  EXPECT_THROW(cuda::silu_mul_fp8(gu.bf16(), nullptr, nullptr, q.get(), s.get(), 2, 32776, nullptr), Error);
}

// Activations quantized per token by quantize_rows_fp8, then the W8A8 GEMM, against float64 over
// the same codes and scales.
TEST(CudaFp8, W8A8GemmMatchesFloat64ReferenceOverTheSameCodes) {
  KESTREL_REQUIRE_CUDA();
  std::mt19937 rng(24);
  struct Case {
    int64_t n_tokens, n_in, n_out;
  };
  // Up to 128 tokens the product is computed unscaled and then scaled (two bf16 roundings), above
  // with cuBLASLt's outer-vector scales (one): both within the bound.
  std::vector<Case> cases = {{17, 64, 48}, {40, 256, 96}, {130, 64, 48}};
  if (!kCudaEmulated) cases.insert(cases.end(), {{64, 1024, 768}, {256, 1024, 768}});
  cuda::Gemm gemm;
  for (const Case& c : cases) {
    SCOPED_TRACE("tokens " + std::to_string(c.n_tokens) + " n_in " + std::to_string(c.n_in));
    const auto x = random_bf16(static_cast<size_t>(c.n_tokens * c.n_in), rng, -4.0f, 4.0f);
    const auto w = random_codes(static_cast<size_t>(c.n_out * c.n_in), rng);
    const auto w_scale = random_f32(static_cast<size_t>(c.n_out), rng, 1e-3f, 1e-2f);
    DeviceBuffer<uint16_t> d_x(x), d_y(static_cast<size_t>(c.n_tokens * c.n_out));
    DeviceBuffer<uint8_t> d_xq(static_cast<size_t>(c.n_tokens * c.n_in)), d_w(w);
    DeviceBuffer<float> d_xs(static_cast<size_t>(c.n_tokens)), d_ws(w_scale);
    d_y.poison();
    cuda::quantize_rows_fp8(d_x.bf16(), c.n_in, c.n_tokens, c.n_in, d_xq.get(), d_xs.get(), nullptr);
    gemm.run_fp8(d_xq.get(), d_xs.get(), d_w.get(), d_ws.get(), d_y.bf16(), c.n_tokens, c.n_in, c.n_out, nullptr);
    const auto xq = d_xq.download();
    const auto xs = d_xs.download();
    std::vector<float> a(xq.size());
    for (size_t i = 0; i < xq.size(); ++i) a[i] = e4m3_to_float(xq[i]) * xs[i / static_cast<size_t>(c.n_in)];
    EXPECT_LE(rel_error(bf16_to_f32(d_y.download()), fp8_reference(a, c.n_in, w, w_scale, c.n_tokens, c.n_in, c.n_out)),
              4e-3);
  }
}

}  // namespace
}  // namespace kestrel::test
