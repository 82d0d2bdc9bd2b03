// A random INT4 matrix for the CUDA int4 tests (test_cuda_int4.cpp, test_cuda_stream_gemv_narrow.cpp):
// codes, scales and zeros as a GPTQ / AWQ checkpoint describes them, the float64 dequantized
// weights W[n, k] = s (q - z) of the reference, and the device layout (int4_ops.h).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <vector>

#include "backend/cuda/int4_ops.h"
#include "cuda_test_util.h"

namespace kestrel::test {

inline uint16_t f32_to_f16_bits(float f) {  // normal values only (the scales drawn here)
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
inline float f16_bits_to_f32(uint16_t h) {
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

inline Int4Case make_case(int64_t n_in, int64_t n_out, int64_t group, bool f16, bool act_order, bool sym,
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

}  // namespace kestrel::test
