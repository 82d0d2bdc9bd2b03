// CUDA streaming GEMV (one or two tokens) against a float64 reference, over block counts that give
// one row per block, uneven last blocks and many lines per block, 4 and 6 stages, bf16 and f32
// output; its SwiGLU input against silu_mul + the plain GEMV (bit for bit); repeatability; and the
// shapes it refuses. Tolerances as for skinny_gemm: bf16 output, one rounding of an f32 sum:
// relative L2 error <= 4e-3 (half a bf16 ulp is 2^-9 = 2e-3); f32 output: 1e-5 (f32 accumulation
// over at most 14336 products, relative error ~ sqrt(n_in) * 2^-24 < 1e-5).
#include "cuda_test_util.h"

namespace kestrel::test {
namespace {

struct Case {
  int64_t n_tokens, n_in, n_out;
  int blocks;  // 0: the SM count
};

cuda::StreamGemvArgs args(const DeviceBuffer<uint16_t>& x, int64_t x_stride, const DeviceBuffer<uint16_t>& w,
                          void* y, const Case& c) {
  cuda::StreamGemvArgs a{};
  a.x = x.bf16();
  a.x_stride = x_stride;
  a.w = w.bf16();
  a.y = y;
  a.n_tokens = c.n_tokens;
  a.n_in = c.n_in;
  a.n_out = c.n_out;
  a.blocks = c.blocks;
  return a;
}

TEST(CudaStreamGemv, MatchesFloat64Reference) {
  KESTREL_REQUIRE_CUDA();
  std::mt19937 rng(21);
  // One line per row (2048), two (4096, the 8B's n_embd), three, eight (the most); 1 row; rows per block 1, 3 with a
  // short last block (7 rows over 3 blocks), many (40 rows in 2 blocks: 20 x 3 = 60 lines, over
  // several 8-line stages and ring turns).
  std::vector<Case> cases = {{1, 2048, 1, 0},  {2, 2048, 7, 3},  {1, 4096, 5, 5},
                             {1, 6144, 40, 2}, {2, 4096, 40, 2}, {1, 2048, 33, 0},
                             {2, 16384, 3, 0}};
  if (!kCudaEmulated) {
    cases.push_back({1, 4096, 6144, 0});
    cases.push_back({2, 14336, 4096, 0});
    cases.push_back({1, 4096, 28672, 0});
  }
  for (const Case& c : cases) {
    // The default 4 stages fit every case; 6 do not fit with two tokens at n_in 14336 (250 KB).
    ASSERT_TRUE(cuda::stream_gemv_supports(c.n_tokens, c.n_in, c.n_out, c.blocks, 4));
    for (const int stages : {3, 4, 6}) {
      if (!cuda::stream_gemv_supports(c.n_tokens, c.n_in, c.n_out, c.blocks, stages)) continue;
      for (const bool f32_out : {false, true}) {
        SCOPED_TRACE("tokens " + std::to_string(c.n_tokens) + " n_in " + std::to_string(c.n_in) + " n_out " +
                     std::to_string(c.n_out) + " blocks " + std::to_string(c.blocks) + " stages " +
                     std::to_string(stages) + (f32_out ? " f32" : " bf16"));
        const int64_t x_stride = c.n_in + 8;  // rows not packed: the stride is honoured
        const auto x = random_bf16(static_cast<size_t>(c.n_tokens * x_stride), rng);
        const auto w = random_bf16(static_cast<size_t>(c.n_out * c.n_in), rng);
        DeviceBuffer<uint16_t> d_x(x), d_w(w);
        const size_t n_y = static_cast<size_t>(c.n_tokens * c.n_out);
        const auto out = run_to_f32(n_y, f32_out, [&](void* y) {
          cuda::StreamGemvArgs a = args(d_x, x_stride, d_w, y, c);
          a.f32_out = f32_out;
          a.stages = stages;
          cuda::stream_gemv(a, nullptr);
        });
        EXPECT_LE(rel_error(out, gemv_reference(x, x_stride, w, c.n_tokens, c.n_in, c.n_out)), f32_out ? 1e-5 : 4e-3);
      }
    }
  }
}

TEST(CudaStreamGemv, SwigluInputIsBitIdenticalToSiluMulThenGemvAndRepeats) {
  KESTREL_REQUIRE_CUDA();
  std::mt19937 rng(22);
  std::vector<Case> cases = {{1, 2048, 9, 4}, {2, 4096, 5, 0}};
  if (!kCudaEmulated) cases.push_back({1, 14336, 4096, 0});
  for (const Case& c : cases) {
    SCOPED_TRACE("tokens " + std::to_string(c.n_tokens) + " n_ff " + std::to_string(c.n_in));
    const auto gate_up = random_bf16(static_cast<size_t>(c.n_tokens * 2 * c.n_in), rng, -6.0f, 6.0f);
    const auto w = random_bf16(static_cast<size_t>(c.n_out * c.n_in), rng);
    DeviceBuffer<uint16_t> d_gu(gate_up), d_w(w), d_act(static_cast<size_t>(c.n_tokens * c.n_in));
    const size_t n_y = static_cast<size_t>(c.n_tokens * c.n_out);
    DeviceBuffer<uint16_t> d_fused(n_y), d_plain(n_y), d_again(n_y);
    d_fused.poison();
    d_plain.poison();
    d_again.poison();
    cuda::silu_mul(d_gu.bf16(), d_act.bf16(), c.n_tokens, c.n_in, nullptr);
    cuda::stream_gemv(args(d_act, c.n_in, d_w, d_plain.get(), c), nullptr);
    cuda::StreamGemvArgs a = args(d_gu, 2 * c.n_in, d_w, d_fused.get(), c);
    a.swiglu = true;
    cuda::stream_gemv(a, nullptr);
    a.y = d_again.get();
    cuda::stream_gemv(a, nullptr);
    const auto fused = d_fused.download();
    EXPECT_EQ(fused, d_plain.download());
    EXPECT_EQ(fused, d_again.download());
  }
}

// The fused input norm: h = RMSNorm(residual + add) * weight computed inside the GEMV, against
// add_rms_norm followed by the plain GEMV (the same arithmetic but the order of the sum of squares:
// relative L2 difference <= 1e-3) and against float64 (4e-3, as above); the summed residual is
// written bit for bit as add_rms_norm writes it, to the other buffer, and the input is untouched.
TEST(CudaStreamGemv, FusedNormMatchesAddRmsNormThenGemv) {
  KESTREL_REQUIRE_CUDA();
  std::mt19937 rng(23);
  std::vector<Case> cases = {{1, 2048, 9, 3}, {2, 4096, 20, 4}, {1, 6144, 5, 0}};
  if (!kCudaEmulated) cases.push_back({1, 4096, 6144, 0});
  for (const Case& c : cases) {
    for (const int stages : {0, 3}) {
      for (const bool with_add : {true, false}) {
        SCOPED_TRACE("tokens " + std::to_string(c.n_tokens) + " n_in " + std::to_string(c.n_in) + " n_out " +
                     std::to_string(c.n_out) + (with_add ? " with add" : " no add") + " stages " +
                     std::to_string(stages));
        const size_t n_x = static_cast<size_t>(c.n_tokens * c.n_in);
        std::vector<float> residual(n_x);
        std::uniform_real_distribution<float> dist(-3.0f, 3.0f);
        for (float& v : residual) v = dist(rng);
        const auto add = random_bf16(n_x, rng, -2.0f, 2.0f);
        const auto norm_w = random_bf16(static_cast<size_t>(c.n_in), rng, 0.5f, 1.5f);
        const auto w = random_bf16(static_cast<size_t>(c.n_out * c.n_in), rng);
        DeviceBuffer<float> d_res(residual), d_res_out(n_x), d_res_ref(residual);
        DeviceBuffer<uint16_t> d_add(add), d_norm(norm_w), d_w(w), d_h(n_x);
        const size_t n_y = static_cast<size_t>(c.n_tokens * c.n_out);
        DeviceBuffer<uint16_t> d_fused(n_y), d_plain(n_y);
        d_res_out.poison();
        d_fused.poison();
        d_plain.poison();
        const float eps = 1e-5f;
        cuda::StreamGemvArgs a = args(d_h, c.n_in, d_w, d_fused.get(), c);
        a.stages = stages;
        a.x = nullptr;
        a.norm_residual_in = d_res.get();
        a.norm_add = with_add ? d_add.bf16() : nullptr;
        a.norm_weight = d_norm.bf16();
        a.norm_residual_out = d_res_out.get();
        a.norm_eps = eps;
        cuda::stream_gemv(a, nullptr);
        // The unfused path on a copy of the residual.
        cuda::add_rms_norm(d_res_ref.get(), with_add ? d_add.bf16() : nullptr, d_norm.bf16(), d_h.bf16(),
                           c.n_tokens, c.n_in, eps, nullptr);
        cuda::StreamGemvArgs unfused = args(d_h, c.n_in, d_w, d_plain.get(), c);
        unfused.stages = stages;
        cuda::stream_gemv(unfused, nullptr);

        EXPECT_EQ(d_res.download(), residual);  // the input is not written
        const auto res_out = d_res_out.download();
        EXPECT_EQ(res_out, d_res_ref.download());
        const auto fused = bf16_to_f32(d_fused.download());
        const auto plain = bf16_to_f32(d_plain.download());
        EXPECT_LE(rel_error(fused, std::vector<double>(plain.begin(), plain.end())), 1e-3);
        // float64: h from the summed residual, rounded to bf16 as the kernel's input is, then the
        // product.
        std::vector<double> ref(n_y);
        for (int64_t t = 0; t < c.n_tokens; ++t) {
          double ss = 0.0;
          for (int64_t k = 0; k < c.n_in; ++k) {
            const double r = res_out[static_cast<size_t>(t * c.n_in + k)];
            ss += r * r;
          }
          const double inv = 1.0 / std::sqrt(ss / static_cast<double>(c.n_in) + eps);
          std::vector<double> h(static_cast<size_t>(c.n_in));
          for (int64_t k = 0; k < c.n_in; ++k)
            h[static_cast<size_t>(k)] = from_bf16(to_bf16(static_cast<float>(
                res_out[static_cast<size_t>(t * c.n_in + k)] * inv * from_bf16(norm_w[static_cast<size_t>(k)]))));
          for (int64_t o = 0; o < c.n_out; ++o) {
            double y = 0.0;
            for (int64_t k = 0; k < c.n_in; ++k)
              y += h[static_cast<size_t>(k)] * from_bf16(w[static_cast<size_t>(o * c.n_in + k)]);
            ref[static_cast<size_t>(t * c.n_out + o)] = y;
          }
        }
        EXPECT_LE(rel_error(fused, ref), 4e-3);
      }
    }
  }
}

TEST(CudaStreamGemv, RejectsWhatItCannotRun) {
  KESTREL_REQUIRE_CUDA();
  EXPECT_FALSE(cuda::stream_gemv_supports(0, 2048, 16));
  EXPECT_FALSE(cuda::stream_gemv_supports(3, 2048, 16));     // more than two tokens
  EXPECT_FALSE(cuda::stream_gemv_supports(1, 1024, 16));     // n_in not a multiple of 2048
  EXPECT_FALSE(cuda::stream_gemv_supports(1, 2048 * 9, 16));  // n_in above kStreamGemvMaxIn
  EXPECT_FALSE(cuda::stream_gemv_supports(1, 2048, 1000, 2));  // 500 rows per block
  EXPECT_FALSE(cuda::stream_gemv_supports(1, 2048, 16, 0, 5));  // no 5-stage kernel
  EXPECT_TRUE(cuda::stream_gemv_supports(2, 16384, 512, 2, 4));   // 208 KB of shared memory
  EXPECT_FALSE(cuda::stream_gemv_supports(2, 16384, 512, 2, 6));  // 272 KB: more than a block may have
  DeviceBuffer<uint16_t> d(2048 * 16);
  const Case c{1, 2048, 16, 0};
  cuda::StreamGemvArgs a = args(d, 2040, d, d.get(), c);  // x_stride shorter than a row
  EXPECT_THROW(cuda::stream_gemv(a, nullptr), Error);
  a = args(d, 2048, d, d.get(), c);
  a.n_tokens = 3;
  EXPECT_THROW(cuda::stream_gemv(a, nullptr), Error);
  a.n_tokens = 1;
  a.swiglu = true;
  a.f32_out = true;  // SwiGLU input with f32 output is not built
  EXPECT_THROW(cuda::stream_gemv(a, nullptr), Error);
  // The fused norm: no weight; the residual written over its input; f32 output.
  DeviceBuffer<float> res(2048);
  a = args(d, 2048, d, d.get(), c);
  a.norm_residual_in = res.get();
  a.norm_residual_out = res.get() + 0;
  a.norm_weight = nullptr;
  EXPECT_THROW(cuda::stream_gemv(a, nullptr), Error);
  a.norm_weight = d.bf16();
  EXPECT_THROW(cuda::stream_gemv(a, nullptr), Error);  // residual_out == residual_in
  DeviceBuffer<float> res2(2048);
  a.norm_residual_out = res2.get();
  a.f32_out = true;
  EXPECT_THROW(cuda::stream_gemv(a, nullptr), Error);
}

}  // namespace
}  // namespace kestrel::test
