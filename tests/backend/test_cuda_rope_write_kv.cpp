// CUDA RoPE + KV cache write against a float64 reference (ops.cpp's rope, in plain loops).
// Tolerance: q and k are rounded to bf16 after an f32 rotation: relative L2 error <= 4e-3.
// The cache must hold exactly the rotated k and the given v at each token's slot, and every other
// element must keep its poison (no stray writes; a negative slot writes nothing).
// The FP8 form (rope_write_kv_fused_fp8) must write, at the same slots, the codes and scales of those
// bf16 rows quantized on the host with core/fp8.h (scale = amax / 448, code = e4m3(x / scale)),
// exactly, and nothing elsewhere.
#include <algorithm>
#include <cstring>
#include <numeric>

#include "cuda_test_util.h"
#include "kv_fp8_reference.h"

namespace kestrel::test {
namespace {

struct RopeCase {
  int64_t n_tokens, n_head, n_head_kv, head_dim, rope_dim;
  bool rotate_half;
  int32_t block_size;
  float position_scale;
  double theta;
};

void rope_reference(std::vector<double>& x, const std::vector<int32_t>& pos, const RopeCase& c, int64_t n_heads,
                    const std::vector<float>& inv_freq) {
  const int64_t half = c.rope_dim / 2;
  for (int64_t t = 0; t < c.n_tokens; ++t)
    for (int64_t h = 0; h < n_heads; ++h)
      for (int64_t i = 0; i < half; ++i) {
        const double angle = static_cast<double>(pos[static_cast<size_t>(t)]) / c.position_scale * inv_freq[static_cast<size_t>(i)];
        const int64_t i0 = c.rotate_half ? i : 2 * i, i1 = c.rotate_half ? i + half : 2 * i + 1;
        double* hp = x.data() + (t * n_heads + h) * c.head_dim;
        const double x0 = hp[i0], x1 = hp[i1];
        hp[i0] = x0 * std::cos(angle) - x1 * std::sin(angle);
        hp[i1] = x0 * std::sin(angle) + x1 * std::cos(angle);
      }
}

// One cache row of n bf16 values as E4M3 codes and its scale's bits.
void quantize_row(const uint16_t* x, int64_t n, uint8_t* codes, uint32_t* scale_bits) {
  float s = 0.0f;
  quantize_row_e4m3(x, n, codes, &s);
  std::memcpy(scale_bits, &s, 4);
}

TEST(CudaRopeWriteKv, MatchesFloat64ReferenceAndWritesOnlyItsSlots) {
  KESTREL_REQUIRE_CUDA();
  std::mt19937 rng(4);
  const RopeCase cases[] = {
      {7, 9, 3, 64, 64, true, 16, 1.0f, 100000.0},     // SmolLM2 shape (HF layout), odd n_tokens
      {33, 32, 8, 128, 128, false, 16, 1.0f, 500000.0},  // Llama-3.1-8B from GGUF (adjacent pairs)
      {5, 4, 4, 128, 64, true, 32, 4.0f, 10000.0},     // partial rotary, linear position scaling
      {6, 6, 2, 80, 80, true, 7, 1.0f, 10000.0},       // head_dim 80, block size 7
      {4, 3, 1, 64, 20, false, 16, 1.0f, 10000.0},     // rope_dim not a multiple of 8: scalar kernel
      {3, 2, 1, 6, 4, true, 4, 1.0f, 10000.0},         // tiny head: scalar kernel
      {9, 8, 4, 8, 8, false, 16, 1.0f, 10000.0},       // stories260K (GGUF, adjacent pairs): one 16-byte item
      {9, 8, 4, 8, 8, true, 16, 1.0f, 10000.0},        // head_dim 8 rotate-half: scalar kernel
      {4, 4, 2, 8, 4, false, 3, 1.0f, 10000.0},        // head_dim 8, partial rotary
      {5, 8, 1, 256, 256, true, 16, 1.0f, 10000.0},    // Gemma (head_dim 256)
      {5, 4, 4, 80, 32, true, 16, 1.0f, 10000.0},      // Phi-2 (partial rotary 32 of 80)
      {5, 4, 4, 96, 96, true, 16, 1.0f, 10000.0},      // Phi-3 (head_dim 96)
  };
  for (const RopeCase& c : cases) {
    SCOPED_TRACE("n_tokens " + std::to_string(c.n_tokens) + " heads " + std::to_string(c.n_head) + "/" +
                 std::to_string(c.n_head_kv) + " head_dim " + std::to_string(c.head_dim) + " rope_dim " +
                 std::to_string(c.rope_dim) + (c.rotate_half ? " rotate-half" : " adjacent"));
    const int32_t n_blocks = static_cast<int32_t>(c.n_tokens / c.block_size + 3);
    const int64_t n_slots = static_cast<int64_t>(n_blocks) * c.block_size;
    const size_t q_n = static_cast<size_t>(c.n_tokens * c.n_head * c.head_dim);
    const size_t kv_n = static_cast<size_t>(c.n_tokens * c.n_head_kv * c.head_dim);
    const size_t cache_n = static_cast<size_t>(n_slots * c.n_head_kv * c.head_dim);
    const auto q = random_bf16(q_n, rng), k = random_bf16(kv_n, rng), v = random_bf16(kv_n, rng);
    std::vector<int32_t> pos(static_cast<size_t>(c.n_tokens));
    std::uniform_int_distribution<int32_t> pick_pos(0, 131071);
    for (auto& p : pos) p = pick_pos(rng);
    std::vector<int64_t> all_slots(static_cast<size_t>(n_slots));
    std::iota(all_slots.begin(), all_slots.end(), 0);
    std::shuffle(all_slots.begin(), all_slots.end(), rng);
    std::vector<int64_t> slots(all_slots.begin(), all_slots.begin() + c.n_tokens);
    if (c.n_tokens > 2) slots[1] = -1;  // a padding token
    std::vector<float> inv_freq(static_cast<size_t>(c.rope_dim / 2));
    for (size_t i = 0; i < inv_freq.size(); ++i)
      inv_freq[i] = static_cast<float>(std::pow(c.theta, -2.0 * static_cast<double>(i) / static_cast<double>(c.rope_dim)));

    DeviceBuffer<uint16_t> d_q(q), d_k(k), d_v(v), d_kc(cache_n), d_vc(cache_n);
    DeviceBuffer<int32_t> d_pos(pos);
    DeviceBuffer<int64_t> d_slots(slots);
    DeviceBuffer<float> d_inv(inv_freq);
    d_kc.poison();
    d_vc.poison();
    cuda::rope_write_kv(d_q.bf16(), d_k.bf16(), d_v.bf16(), d_pos.get(), d_slots.get(), d_inv.get(), c.position_scale,
                        c.n_tokens, c.n_head, c.n_head_kv, c.head_dim, c.rope_dim, c.rotate_half, d_kc.bf16(),
                        d_vc.bf16(), c.block_size, nullptr);
    const auto q_out = d_q.download(), k_out = d_k.download(), kc = d_kc.download(), vc = d_vc.download();

    std::vector<double> q_ref(q_n), k_ref(kv_n);
    for (size_t i = 0; i < q_n; ++i) q_ref[i] = from_bf16(q[i]);
    for (size_t i = 0; i < kv_n; ++i) k_ref[i] = from_bf16(k[i]);
    rope_reference(q_ref, pos, c, c.n_head, inv_freq);
    rope_reference(k_ref, pos, c, c.n_head_kv, inv_freq);
    EXPECT_LE(rel_error(bf16_to_f32(q_out), q_ref), 4e-3);
    EXPECT_LE(rel_error(bf16_to_f32(k_out), k_ref), 4e-3);

    std::vector<uint16_t> kc_want(cache_n, 0xFFFF), vc_want(cache_n, 0xFFFF);
    for (int64_t t = 0; t < c.n_tokens; ++t) {
      const int64_t slot = slots[static_cast<size_t>(t)];
      if (slot < 0) continue;
      for (int64_t h = 0; h < c.n_head_kv; ++h)
        for (int64_t i = 0; i < c.head_dim; ++i) {
          const size_t off = static_cast<size_t>(
              ((slot / c.block_size * c.n_head_kv + h) * c.block_size + slot % c.block_size) * c.head_dim + i);
          const size_t src = static_cast<size_t>((t * c.n_head_kv + h) * c.head_dim + i);
          kc_want[off] = k_out[src];
          vc_want[off] = v[src];
        }
    }
    EXPECT_TRUE(kc == kc_want) << "K cache differs from the rotated k at the slots (or was written elsewhere)";
    EXPECT_TRUE(vc == vc_want) << "V cache differs from v at the slots (or was written elsewhere)";

    // The fused-QKV form on the same data, packed into rows of one wider buffer (8 spare columns,
    // as a padded GEMM output would have): the same bits in q and both caches, and qkv untouched.
    const int64_t qd = c.n_head * c.head_dim, kvd = c.n_head_kv * c.head_dim, stride = qd + 2 * kvd + 8;
    std::vector<uint16_t> qkv(static_cast<size_t>(c.n_tokens * stride), 0x7FC0);
    for (int64_t t = 0; t < c.n_tokens; ++t) {
      std::copy_n(q.begin() + t * qd, qd, qkv.begin() + t * stride);
      std::copy_n(k.begin() + t * kvd, kvd, qkv.begin() + t * stride + qd);
      std::copy_n(v.begin() + t * kvd, kvd, qkv.begin() + t * stride + qd + kvd);
    }
    DeviceBuffer<uint16_t> d_qkv(qkv), d_qf(q_n), d_kc2(cache_n), d_vc2(cache_n);
    d_qf.poison();
    d_kc2.poison();
    d_vc2.poison();
    cuda::rope_write_kv_fused(d_qkv.bf16(), stride, d_qf.bf16(), d_pos.get(), d_slots.get(), d_inv.get(),
                              c.position_scale, c.n_tokens, c.n_head, c.n_head_kv, c.head_dim, c.rope_dim,
                              c.rotate_half, d_kc2.bf16(), d_vc2.bf16(), c.block_size, nullptr);
    EXPECT_TRUE(d_qf.download() == q_out) << "fused form: q differs from the in-place form";
    EXPECT_TRUE(d_kc2.download() == kc) << "fused form: K cache differs";
    EXPECT_TRUE(d_vc2.download() == vc) << "fused form: V cache differs";
    EXPECT_TRUE(d_qkv.download() == qkv) << "fused form: the qkv input was modified";

    // The FP8 cache: q as above; each written row the bf16 row above quantized on the host.
    const size_t scales_n = static_cast<size_t>(n_slots * c.n_head_kv);
    DeviceBuffer<uint8_t> d_kq(cache_n), d_vq(cache_n);
    DeviceBuffer<uint32_t> d_ks(scales_n), d_vs(scales_n);
    for (auto* b : {&d_kq, &d_vq}) b->poison();
    for (auto* b : {&d_ks, &d_vs}) b->poison();
    d_qf.poison();
    const cuda::Fp8KvCache fp8{d_kq.get(), d_vq.get(), reinterpret_cast<float*>(d_ks.get()),
                               reinterpret_cast<float*>(d_vs.get())};
    cuda::rope_write_kv_fused_fp8(d_qkv.bf16(), stride, d_qf.bf16(), d_pos.get(), d_slots.get(), d_inv.get(),
                                  c.position_scale, c.n_tokens, c.n_head, c.n_head_kv, c.head_dim, c.rope_dim,
                                  c.rotate_half, fp8, c.block_size, nullptr);
    EXPECT_TRUE(d_qf.download() == q_out) << "FP8 form: q differs from the in-place form";
    std::vector<uint8_t> kq_want(cache_n, 0xFF), vq_want(cache_n, 0xFF);
    std::vector<uint32_t> ks_want(scales_n, 0xFFFFFFFFu), vs_want(scales_n, 0xFFFFFFFFu);
    for (int64_t t = 0; t < c.n_tokens; ++t) {
      const int64_t slot = slots[static_cast<size_t>(t)];
      if (slot < 0) continue;
      for (int64_t h = 0; h < c.n_head_kv; ++h) {
        const auto row = static_cast<size_t>((slot / c.block_size * c.n_head_kv + h) * c.block_size + slot % c.block_size);
        const size_t off = row * static_cast<size_t>(c.head_dim);
        quantize_row(kc_want.data() + off, c.head_dim, kq_want.data() + off, &ks_want[row]);
        quantize_row(vc_want.data() + off, c.head_dim, vq_want.data() + off, &vs_want[row]);
      }
    }
    EXPECT_TRUE(d_kq.download() == kq_want) << "FP8 form: K codes differ from the host quantization";
    EXPECT_TRUE(d_vq.download() == vq_want) << "FP8 form: V codes differ from the host quantization";
    EXPECT_TRUE(d_ks.download() == ks_want) << "FP8 form: K scales differ from the host quantization";
    EXPECT_TRUE(d_vs.download() == vs_want) << "FP8 form: V scales differ from the host quantization";
  }
}

}  // namespace
}  // namespace kestrel::test
