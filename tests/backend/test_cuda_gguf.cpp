// GGUF blocks in place on the GPU (gguf_ops.h), every type, against cpu::dequantize_row: random
// blocks (random quant and scale bytes, f16 scales drawn from a sane range) repacked with
// gguf_repack_rows; the reference weights are the CPU's f32 values rounded to bf16 (the bf16
// upload's values), the products summed in float64.
// Tolerances: the dequantization and the embedding are exact (bit for bit); the GEMV forms the
// same bf16 weights, exact products and f32 sums, then rounds once: |y - ref| <= 2^-8 |ref| +
// 1e-5 sum_k |x_k w_k| for bf16 output (half a bf16 ulp plus the f32 sums), 1e-5 sum_k |x_k w_k|
// for f32 output.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/matmul.h"
#include "backend/cuda/cuda_runner.h"
#include "backend/cuda/gguf_ops.h"
#include "core/dtype.h"
#include "cuda_test_util.h"
#include "engine/engine.h"
#include "gguf_builder.h"
#include "hf_configs.h"
#include "test_util.h"

namespace kestrel::test {
namespace {

using cuda::GgufQuant;

const GgufQuant kAll[] = {GgufQuant::Q4_0, GgufQuant::Q4_1, GgufQuant::Q5_0, GgufQuant::Q8_0,
                          GgufQuant::Q4_K, GgufQuant::Q5_K, GgufQuant::Q6_K};

std::string name_of(GgufQuant t) { return std::string(type_name(static_cast<GgmlType>(t))); }

// n_rows GGUF rows of random blocks: random bytes, then each f16 field set to a value of
// magnitude 2^-9 .. 2^-4 with a random sign (K-quant mins positive, as llama.cpp writes them).
std::vector<uint8_t> random_rows(GgufQuant t, int64_t n_rows, int64_t n_in, std::mt19937& rng) {
  const int64_t bb = cuda::gguf_block_bytes(t), nb = n_rows * n_in / cuda::gguf_block_elems(t);
  std::vector<uint8_t> v(static_cast<size_t>(nb * bb));
  std::uniform_int_distribution<int> byte(0, 255);
  for (uint8_t& b : v) b = static_cast<uint8_t>(byte(rng));
  std::uniform_real_distribution<float> mag(-9.0f, -4.0f);
  auto put = [&](uint8_t* p, bool positive) {
    const float f = std::exp2(mag(rng)) * (positive || byte(rng) < 128 ? 1.0f : -1.0f);
    const uint16_t h = fp32_to_fp16(f);
    std::memcpy(p, &h, 2);
  };
  for (int64_t i = 0; i < nb; ++i) {
    uint8_t* blk = v.data() + i * bb;
    switch (t) {
      case GgufQuant::Q6_K: put(blk + 208, false); break;
      case GgufQuant::Q4_1: put(blk, false), put(blk + 2, false); break;
      case GgufQuant::Q4_K: case GgufQuant::Q5_K: put(blk, true), put(blk + 2, true); break;
      default: put(blk, false);
    }
  }
  return v;
}

// The CPU's values of the rows, rounded to bf16, as f32.
std::vector<float> reference_weights(GgufQuant t, const std::vector<uint8_t>& rows, int64_t n_rows, int64_t n_in) {
  std::vector<float> w(static_cast<size_t>(n_rows * n_in));
  const size_t row_b = row_bytes(static_cast<GgmlType>(t), n_in);
  for (int64_t r = 0; r < n_rows; ++r)
    cpu::dequantize_row(static_cast<GgmlType>(t), rows.data() + r * row_b, w.data() + r * n_in, n_in);
  for (float& f : w) f = from_bf16(to_bf16(f));
  return w;
}

// A matrix in the device layout.
struct DeviceGguf {
  DeviceBuffer<uint8_t> body;
  DeviceBuffer<uint16_t> d;
  cuda::GgufMatrix m;
  DeviceGguf(GgufQuant t, const std::vector<uint8_t>& rows, int64_t n_rows, int64_t n_in)
      : body(static_cast<size_t>(n_rows * n_in / cuda::gguf_block_elems(t) * cuda::gguf_body_bytes(t))),
        d(cuda::gguf_d_apart(t) ? static_cast<size_t>(n_rows * n_in / cuda::gguf_block_elems(t)) : 0) {
    std::vector<uint8_t> hb(body.size());
    std::vector<uint16_t> hd(d.size());
    cuda::gguf_repack_rows(t, rows.data(), n_rows, n_in, hb.data(), hd.data());
    body.upload(hb);
    if (d.size() > 0) d.upload(hd);
    m.type = t;
    m.body = body.get();
    m.d = d.size() > 0 ? d.get() : nullptr;
    m.n_in = n_in;
    m.n_out = n_rows;
  }
};

TEST(CudaGguf, LayoutKeepsTheBlockBytes) {
  for (const GgufQuant t : kAll) {
    EXPECT_EQ(cuda::gguf_block_bytes(t), static_cast<int64_t>(type_traits(static_cast<GgmlType>(t)).block_bytes));
    EXPECT_EQ(cuda::gguf_block_elems(t), type_traits(static_cast<GgmlType>(t)).block_size);
    EXPECT_EQ(cuda::gguf_body_bytes(t) % 4, 0) << name_of(t);
    EXPECT_EQ(cuda::gguf_body_bytes(t) + (cuda::gguf_d_apart(t) ? 2 : 0), cuda::gguf_block_bytes(t)) << name_of(t);
  }
  EXPECT_TRUE(cuda::gguf_layout_supports(GgufQuant::Q4_0, 96));
  EXPECT_FALSE(cuda::gguf_layout_supports(GgufQuant::Q4_K, 640));  // not whole super-blocks
  EXPECT_FALSE(cuda::gguf_quant_supported(static_cast<int32_t>(GgmlType::Q5_1)));
}

TEST(CudaGguf, DequantizeAndEmbeddingEqualTheBf16Upload) {
  KESTREL_REQUIRE_CUDA();
  std::mt19937 rng(7);
  for (const GgufQuant t : kAll) {
    SCOPED_TRACE(name_of(t));
    const int64_t n_in = 512, n_out = 6, stride = n_in + 8;
    const auto rows = random_rows(t, n_out, n_in, rng);
    const std::vector<float> want = reference_weights(t, rows, n_out, n_in);
    DeviceGguf w(t, rows, n_out, n_in);
    DeviceBuffer<uint16_t> out(static_cast<size_t>(n_out * stride));
    out.poison();
    cuda::dequantize_gguf(w.m, out.bf16(), stride, nullptr);
    const auto got = out.download();
    int bad = 0;
    for (int64_t r = 0; r < n_out; ++r)
      for (int64_t k = 0; k < n_in; ++k) bad += got[r * stride + k] != to_bf16(want[r * n_in + k]);
    EXPECT_EQ(bad, 0);
    const std::vector<int32_t> ids = {3, 0, 5, 3};
    DeviceBuffer<int32_t> d_ids(ids);
    DeviceBuffer<float> emb(ids.size() * n_in);
    emb.poison();
    cuda::gguf_embedding(w.m, d_ids.get(), static_cast<int64_t>(ids.size()), 1.5f, emb.get(), nullptr);
    const auto e = emb.download();
    bad = 0;
    for (size_t i = 0; i < ids.size(); ++i)
      for (int64_t k = 0; k < n_in; ++k) bad += e[i * n_in + k] != want[ids[i] * n_in + k] * 1.5f;
    EXPECT_EQ(bad, 0);
    // As a tensor-parallel rank's slice of the vocabulary [10, 16): other ids give zero rows.
    const std::vector<int32_t> slice_ids = {13, 9, 10, 16, 15, 0};
    DeviceBuffer<int32_t> d_slice_ids(slice_ids);
    DeviceBuffer<float> emb2(slice_ids.size() * n_in);
    emb2.poison();
    cuda::gguf_embedding(w.m, d_slice_ids.get(), static_cast<int64_t>(slice_ids.size()), 1.0f, emb2.get(), nullptr, 10);
    const auto e2 = emb2.download();
    bad = 0;
    for (size_t i = 0; i < slice_ids.size(); ++i) {
      const int64_t row = slice_ids[i] - 10;
      for (int64_t k = 0; k < n_in; ++k)
        bad += e2[i * n_in + k] != (row < 0 || row >= n_out ? 0.0f : want[row * n_in + k]);
    }
    EXPECT_EQ(bad, 0);
  }
}

TEST(CudaGguf, GemvMatchesFloat64Reference) {
  KESTREL_REQUIRE_CUDA();
  std::mt19937 rng(11);
  struct Shape {
    int64_t n_tokens, n_in, n_out;
    bool swiglu, f32_out;
    int64_t y_pad;  // y_stride = n_out + y_pad
  };
  std::vector<Shape> shapes = {{1, 512, 40, false, false, 0}, {3, 256, 17, true, false, 0},
                               {8, 768, 33, false, true, 0},  {5, 256, 20, false, false, 12}};
  if (!kCudaEmulated) shapes.push_back({8, 4096, 6144, true, false, 0});
  for (const GgufQuant t : kAll)
    for (const Shape& sh : shapes) {
      SCOPED_TRACE(name_of(t) + " tokens " + std::to_string(sh.n_tokens) + " n_in " + std::to_string(sh.n_in) +
                   " n_out " + std::to_string(sh.n_out) + (sh.swiglu ? " swiglu" : "") + (sh.f32_out ? " f32" : ""));
      const auto rows = random_rows(t, sh.n_out, sh.n_in, rng);
      const std::vector<float> w = reference_weights(t, rows, sh.n_out, sh.n_in);
      DeviceGguf dw(t, rows, sh.n_out, sh.n_in);
      const int64_t x_stride = (sh.swiglu ? 2 : 1) * sh.n_in + 8, y_stride = sh.n_out + sh.y_pad;
      const auto x = random_bf16(static_cast<size_t>(sh.n_tokens * x_stride), rng, -2.0f, 2.0f);
      DeviceBuffer<uint16_t> d_x(x);
      DeviceBuffer<float> y32(sh.f32_out ? static_cast<size_t>(sh.n_tokens * y_stride) : 0);
      DeviceBuffer<uint16_t> y16(sh.f32_out ? 0 : static_cast<size_t>(sh.n_tokens * y_stride));
      sh.f32_out ? y32.poison() : y16.poison();
      cuda::GgufGemvArgs a;
      static_cast<cuda::ProjectionOperands&>(a) = {d_x.bf16(), x_stride, nullptr,
                                                   sh.f32_out ? static_cast<void*>(y32.get()) : y16.get(),
                                                   sh.n_tokens, sh.n_in, sh.n_out, sh.swiglu, sh.f32_out};
      a.wq = dw.m;
      a.y_stride = y_stride;
      cuda::gguf_gemv(a, nullptr);
      const std::vector<float> got = sh.f32_out ? y32.download() : bf16_to_f32(y16.download());
      int bad = 0;
      double worst = 0;
      for (int64_t tok = 0; tok < sh.n_tokens; ++tok) {
        std::vector<double> act(static_cast<size_t>(sh.n_in));
        for (int64_t k = 0; k < sh.n_in; ++k) {
          const float g = from_bf16(x[static_cast<size_t>(tok * x_stride + k)]);
          act[static_cast<size_t>(k)] =
              sh.swiglu ? from_bf16(to_bf16(g / (1.0f + std::exp(-g)) * from_bf16(x[static_cast<size_t>(tok * x_stride + sh.n_in + k)])))
                        : g;
        }
        for (int64_t o = 0; o < sh.n_out; ++o) {
          double ref = 0, mag = 0;
          for (int64_t k = 0; k < sh.n_in; ++k) {
            const double p = act[static_cast<size_t>(k)] * w[static_cast<size_t>(o * sh.n_in + k)];
            ref += p;
            mag += std::fabs(p);
          }
          const double y = got[static_cast<size_t>(tok * y_stride + o)];
          const double tol = (sh.f32_out ? 0.0 : std::ldexp(std::fabs(ref), -8)) + 1e-5 * mag;
          worst = std::max(worst, std::fabs(y - ref) / (mag > 0 ? mag : 1.0));
          bad += !(std::fabs(y - ref) <= tol);
        }
      }
      EXPECT_EQ(bad, 0) << "worst |y - ref| / sum |x w| " << worst;
    }
}

TEST(CudaGguf, UnsupportedShapesAreClearErrors) {
  cuda::GgufGemvArgs a;
  a.n_tokens = 9;
  a.n_in = a.wq.n_in = 64;
  a.n_out = a.wq.n_out = 4;
  EXPECT_THROW(cuda::gguf_gemv(a, nullptr), Error);  // more tokens than the GEMV takes
  cuda::GgufMatrix m;
  m.type = GgufQuant::Q6_K;
  m.n_in = 96;
  m.n_out = 2;
  EXPECT_THROW(cuda::dequantize_gguf(m, nullptr, 96, nullptr), Error);
}

// A tiny random Llama GGUF whose matrices are quantized blocks of every kept type: 2 layers of
// width 256, MLP 512, 4 query heads and 2 KV heads of 64, 64 tokens, an untied Q6_K LM head and a
// Q8_0 embedding. Layer 0: q, k Q4_0 and v Q8_0 (a stacked QKV of two types), o Q4_1, gate and
// up Q5_0, down Q4_K; layer 1: q, k, v Q5_K, o Q6_K, gate Q4_K and up Q6_K, down Q8_0.
std::string write_quantized_llama(TempDir& dir) {
  constexpr int64_t kEmbd = 256, kFf = 512, kHeads = 4, kHeadsKv = 2, kHeadDim = 64, kVocab = 64;
  std::mt19937 rng(3);
  GgufBuilder g;
  using B = GgufBuilder;
  g.kv("general.architecture", B::str("llama"))
      .kv("llama.embedding_length", B::u32(kEmbd))
      .kv("llama.feed_forward_length", B::u32(kFf))
      .kv("llama.block_count", B::u32(2))
      .kv("llama.attention.head_count", B::u32(kHeads))
      .kv("llama.attention.head_count_kv", B::u32(kHeadsKv))
      .kv("llama.context_length", B::u32(128))
      .kv("llama.vocab_size", B::u32(kVocab))
      .kv("llama.attention.layer_norm_rms_epsilon", B::f32(1e-5f));
  auto quant = [&](const std::string& name, GgufQuant t, int64_t n_out, int64_t n_in) {
    g.tensor(name, {n_in, n_out}, static_cast<GgmlType>(t), random_rows(t, n_out, n_in, rng));
  };
  auto norm = [&](const std::string& name) {
    std::uniform_real_distribution<float> u(0.8f, 1.2f);
    std::vector<float> v(static_cast<size_t>(kEmbd));
    for (float& x : v) x = u(rng);
    g.tensor(name, {kEmbd}, GgmlType::F32, f32_bytes(v));
  };
  quant("token_embd.weight", GgufQuant::Q8_0, kVocab, kEmbd);
  norm("output_norm.weight");
  quant("output.weight", GgufQuant::Q6_K, kVocab, kEmbd);
  const GgufQuant types[2][7] = {
      {GgufQuant::Q4_0, GgufQuant::Q4_0, GgufQuant::Q8_0, GgufQuant::Q4_1, GgufQuant::Q5_0, GgufQuant::Q5_0, GgufQuant::Q4_K},
      {GgufQuant::Q5_K, GgufQuant::Q5_K, GgufQuant::Q5_K, GgufQuant::Q6_K, GgufQuant::Q4_K, GgufQuant::Q6_K, GgufQuant::Q8_0}};
  for (int l = 0; l < 2; ++l) {
    const std::string b = "blk." + std::to_string(l) + ".";
    const GgufQuant* ty = types[l];
    norm(b + "attn_norm.weight");
    quant(b + "attn_q.weight", ty[0], kHeads * kHeadDim, kEmbd);
    quant(b + "attn_k.weight", ty[1], kHeadsKv * kHeadDim, kEmbd);
    quant(b + "attn_v.weight", ty[2], kHeadsKv * kHeadDim, kEmbd);
    quant(b + "attn_output.weight", ty[3], kEmbd, kHeads * kHeadDim);
    norm(b + "ffn_norm.weight");
    quant(b + "ffn_gate.weight", ty[4], kFf, kEmbd);
    quant(b + "ffn_up.weight", ty[5], kFf, kEmbd);
    quant(b + "ffn_down.weight", ty[6], kEmbd, kFf);
  }
  return dir.write("quantized.gguf", bytes_of(g.build()));
}

// The worst |got - want| of a row of n_vocab logits over its largest |want|, over all rows.
double worst_row_rel(const std::vector<float>& got, const std::vector<float>& want, int64_t n_vocab) {
  EXPECT_EQ(got.size(), want.size());
  double worst = 0;
  for (size_t r = 0; (r + 1) * n_vocab <= std::min(got.size(), want.size()); ++r) {
    float scale = 0, diff = 0;
    for (int64_t v = 0; v < n_vocab; ++v) {
      scale = std::max(scale, std::fabs(want[r * n_vocab + v]));
      diff = std::max(diff, std::fabs(got[r * n_vocab + v] - want[r * n_vocab + v]));
    }
    worst = std::max(worst, static_cast<double>(diff / scale));
  }
  return worst;
}

// The weights' KiB a runner's description reports ("weights N KiB").
int64_t weight_kib(const std::string& description) {
  const size_t at = description.find("weights ");
  if (at == std::string::npos) return -1;
  return std::stoll(description.substr(at + 8));
}

// The prompt's logits from the CUDA runner with GGUF blocks in place or as bf16, the prompt in
// chunks of `chunk` tokens (at most 8: every projection on the GEMV; more: dequantized + GEMM).
std::vector<float> cuda_prompt_logits(const LlamaModel& m, const std::vector<int32_t>& prompt, bool in_place,
                                      int64_t chunk, std::string* description = nullptr) {
  RunnerOptions o;
  o.block_size = 16;
  o.n_kv_blocks = 8;
  o.cuda.gguf_in_place = in_place;
  auto runner = make_cuda_model_runner(m, o);
  if (description != nullptr) *description = runner->description();
  EngineConfig c;
  c.kv_dtype = KvDtype::BF16;
  c.block_size = 16;
  c.n_kv_blocks = 8;
  c.max_model_len = 128;
  c.max_num_batched_tokens = chunk;
  Engine e(m, nullptr, c, std::move(runner));
  return prompt_logits(e, prompt);
}

// In place against the bf16 upload on the same model: the same bf16 weights, so what differs is
// the order of the GEMV's f32 sums (and the bf16 activations rounded after them, where a sum lands
// on the other side of a rounding boundary). Measured on the CPU emulation: 1.8e-7 (chunks of 8,
// the GEMV) and 3.3e-7 (chunks of 16: the projections dequantized + GEMM, the head on the GEMV) of
// the row's largest logit; bound 1e-2 (a GPU's sums in another order may flip activation roundings).
// The device holds the file's bytes: less than half of the bf16 upload's.
TEST(CudaGguf, InPlaceModelMatchesTheBf16Upload) {
  KESTREL_REQUIRE_CUDA();
  TempDir dir;
  const auto m = LlamaModel::load(write_quantized_llama(dir));
  const std::vector<int32_t> prompt = {1, 17, 42, 5, 63, 8, 8, 30, 12, 51, 2, 44, 19, 27, 33, 6, 60, 14, 9, 38};
  for (const int64_t chunk : {int64_t{8}, int64_t{16}}) {
    std::string desc;
    const auto got = cuda_prompt_logits(*m, prompt, true, chunk, &desc);
    EXPECT_NE(desc.find("GGUF blocks in place (12 matrices)"), std::string::npos) << desc;
    std::string bf16_desc;
    const auto want = cuda_prompt_logits(*m, prompt, false, chunk, &bf16_desc);
    EXPECT_LT(2 * weight_kib(desc), weight_kib(bf16_desc)) << desc << "\n" << bf16_desc;
    const double worst = worst_row_rel(got, want, 64);
    std::printf("  chunks of %lld: in place vs bf16 upload %.3g\n", static_cast<long long>(chunk), worst);
    EXPECT_LE(worst, 1e-2);
    EXPECT_GT(worst_row_rel(want, std::vector<float>(want.size(), 0.0f), 64), 0.0);  // not all zeros
  }
}

// SmolLM2-135M-Instruct Q4_1 (a GPU only: the emulation would take minutes): in place vs bf16.
TEST(CudaGguf, SmolLm2InPlaceMatchesTheBf16Upload) {
  KESTREL_REQUIRE_CUDA();
  if (kCudaEmulated) GTEST_SKIP() << "30 layers of 576: run on a GPU";
  const std::string path = model_dir() + "/SmolLM2-135M-Instruct.Q4_1.gguf";
  KESTREL_REQUIRE_FILE(path);
  const auto m = LlamaModel::load(path);
  const std::vector<int32_t> prompt = {1, 504, 3458, 282, 4649, 314, 7042, 28, 284, 260, 3458, 282, 3838, 314};
  const auto got = cuda_prompt_logits(*m, prompt, true, 8);
  const auto want = cuda_prompt_logits(*m, prompt, false, 8);
  const double worst = worst_row_rel(got, want, m->hparams().n_vocab);
  std::printf("  SmolLM2 Q4_1: in place vs bf16 upload %.3g\n", worst);
  EXPECT_LE(worst, 5e-2);
}

}  // namespace
}  // namespace kestrel::test
