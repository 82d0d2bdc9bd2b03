// The AVX2 kernels of the 32-element block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) bit for bit
// against a scalar model of their arithmetic: activations rounded by quantize_block_q16; per block
// eight exact integer lane sums (lane j: elements 4j..4j+3 of sum(u Q)), each added to its lane's
// f32 accumulator with one fused multiply-add by d_w * d_x; then, for the types with an offset, the
// offsets c (8 blocks per step, zero-padded) times the activation block sums s; then the lanes
// summed as ((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7)). The kernels may change how they reach
// these numbers (instruction choice, rows or blocks handled together), not the numbers: a token's
// outputs stay what they were, in the GEMV and in the GEMM.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "backend/cpu/matmul.h"
#include "backend/cpu/matmul_kernels.h"
#include "core/cpu_features.h"
#include "core/dtype.h"
#include "core/thread_pool.h"

namespace kestrel::cpu {
namespace {

float fp16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return fp16_to_fp32(h);
}

// Block quants as the kernels multiply them (unsigned with an offset c, or Q8_0's signed values),
// d and c of one block.
struct Decoded {
  int q[32];
  float d, c;
};

Decoded decode(GgmlType type, const uint8_t* blk) {
  Decoded r{};
  r.d = fp16(blk);
  uint8_t u[32];
  switch (type) {
    case GgmlType::Q8_0:
      for (int i = 0; i < 32; ++i) r.q[i] = reinterpret_cast<const int8_t*>(blk + 2)[i];
      return r;
    case GgmlType::Q4_0:
    case GgmlType::Q4_1: {
      const uint8_t* qs = blk + (type == GgmlType::Q4_0 ? 2 : 4);
      for (int i = 0; i < 16; ++i) {
        r.q[i] = qs[i] & 15;
        r.q[i + 16] = qs[i] >> 4;
      }
      r.c = type == GgmlType::Q4_0 ? -8.0f * r.d : fp16(blk + 2);
      return r;
    }
    case GgmlType::Q5_0:
      detail::q5_unpack(blk + 2, blk + 6, u);
      for (int i = 0; i < 32; ++i) r.q[i] = u[i];
      r.c = -16.0f * r.d;
      return r;
    case GgmlType::Q5_1:
      detail::q5_unpack(blk + 4, blk + 8, u);
      for (int i = 0; i < 32; ++i) r.q[i] = u[i];
      r.c = fp16(blk + 2);
      return r;
    default: break;
  }
  ADD_FAILURE() << "type";
  return r;
}

float model(GgmlType type, const uint8_t* row, const float* x, int64_t n_in) {
  const int64_t nb = n_in / 32, n_ch = (nb + 7) / 8;
  float acc[8] = {};
  std::vector<float> c(static_cast<size_t>(n_ch * 8), 0.0f), s(c.size(), 0.0f);
  for (int64_t b = 0; b < nb; ++b) {
    int8_t q1[32], q2[32];
    float dx;
    const int32_t sum = detail::quantize_block_q16(x + 32 * b, 32, false, q1, q2, &dx);
    const Decoded w = decode(type, row + b * static_cast<int64_t>(type_traits(type).block_bytes));
    for (int j = 0; j < 8; ++j) {
      int32_t lane = 0;
      for (int e = 4 * j; e < 4 * j + 4; ++e) lane += w.q[e] * (detail::kActSplit * q1[e] + q2[e]);
      acc[j] = std::fmaf(static_cast<float>(lane), w.d * dx, acc[j]);
    }
    c[static_cast<size_t>(b)] = w.c;
    s[static_cast<size_t>(b)] = dx * static_cast<float>(sum);
  }
  if (type != GgmlType::Q8_0)
    for (int64_t ch = 0; ch < n_ch; ++ch)
      for (int j = 0; j < 8; ++j) acc[j] = std::fmaf(c[8 * ch + j], s[8 * ch + j], acc[j]);
  return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
}

TEST(MatmulLanes, Avx2Blocks32EqualTheirScalarModel) {
  if (simd_level() < SimdLevel::Avx2) GTEST_SKIP() << "no AVX2";
  set_simd_level_for_testing(SimdLevel::Avx2);
  ThreadPool pool(2);
  MatmulWorkspace ws;
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<float> scale(0.002f, 0.03f);
  // n_in 640 (20 blocks: groups of 8, then 4) and 416 (13 blocks: 8, then 5 one by one); n_out 11
  // (4-row groups and single rows); 1 token (GEMV) and 5 (GEMM).
  for (GgmlType type : {GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q5_1})
    for (int64_t n_in : {640, 416}) {
      constexpr int64_t kOut = 11;
      const size_t bb = type_traits(type).block_bytes, rb = row_bytes(type, n_in);
      std::vector<uint8_t> w(rb * kOut);
      for (auto& byte : w) byte = static_cast<uint8_t>(rng());
      for (size_t blk = 0; blk < w.size() / bb; ++blk) {
        const uint16_t d = fp32_to_fp16(scale(rng)), m = fp32_to_fp16(-12.0f * scale(rng));
        std::memcpy(&w[blk * bb], &d, 2);
        if (type == GgmlType::Q4_1 || type == GgmlType::Q5_1) std::memcpy(&w[blk * bb + 2], &m, 2);
      }
      for (int64_t n_tok : {1, 5}) {
        std::vector<float> x(static_cast<size_t>(n_in * n_tok)), y(static_cast<size_t>(kOut * n_tok));
        for (float& v : x) v = nd(rng) * (rng() % 9 == 0 ? 30.0f : 1.0f);
        matmul({type, n_in, kOut, w.data()}, x.data(), n_tok, y.data(), ws, pool);
        for (int64_t t = 0; t < n_tok; ++t)
          for (int64_t r = 0; r < kOut; ++r) {
            const float want = model(type, w.data() + r * rb, x.data() + t * n_in, n_in);
            const float got = y[static_cast<size_t>(t * kOut + r)];
            EXPECT_EQ(std::memcmp(&got, &want, 4), 0)
                << type_name(type) << " n_in " << n_in << " tokens " << n_tok << " token " << t << " row " << r
                << ": " << got << " vs " << want;
          }
      }
    }
  set_simd_level_for_testing(SimdLevel::Avx512);
}

}  // namespace
}  // namespace kestrel::cpu
