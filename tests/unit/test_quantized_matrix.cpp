// The quantized-checkpoint dequantizer (model/quantized_matrix.h) on hand-built tensors, each
// expected value computed from the unpacked integers and scales by the formulas of the layouts
// (hf-tiny README: GPTQ v1, AWQ GEMM, FP8), and the errors for inconsistent metadata in the
// tensors (read_quantized_matrix) and in config.json (QuantConfig::from_json).
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/fp8.h"
#include "hf_configs.h"
#include "io/safetensors_checkpoint.h"
#include "model/quant_config.h"
#include "core/fp8.h"
#include "model/quantized_matrix.h"
#include "safetensors_builder.h"
#include "test_util.h"

namespace kestrel {
namespace {

using json = nlohmann::json;
using test::SafetensorsBuilder;
using test::TempDir;

std::vector<uint8_t> words(const std::vector<uint32_t>& w) {
  std::vector<uint8_t> b(w.size() * 4);
  std::memcpy(b.data(), w.data(), b.size());
  return b;
}

QuantConfig config_of(const json& qc) { return QuantConfig::from_json(json{{"quantization_config", qc}}, "config.json"); }

json gptq_config(int bits, int group, bool desc_act) {
  return {{"quant_method", "gptq"}, {"bits", bits}, {"group_size", group}, {"desc_act", desc_act}, {"sym", false}};
}

// A folder holding one model.safetensors; the matrix views point into its mapping.
struct Checkpoint {
  TempDir dir;
  SafetensorsCheckpoint ckpt;
  explicit Checkpoint(const SafetensorsBuilder& b)
      : ckpt((test::write_file(dir.path() + "/model.safetensors", b.build()), SafetensorsCheckpoint::open_dir(dir.path()))) {}
  QuantizedMatrix read(const QuantConfig& cfg, int64_t K, int64_t N) const {
    std::vector<std::string> used;
    uint64_t bytes = 0;
    return read_quantized_matrix(ckpt, "m", cfg, K, N, used, bytes);
  }
  std::vector<float> dequantize(const QuantConfig& cfg, int64_t K, int64_t N) const {
    const QuantizedMatrix m = read(cfg, K, N);
    std::vector<float> out(static_cast<size_t>(K * N));
    dequantize_rows(m, 0, N, out.data());
    // Any row range gives the same rows.
    std::vector<float> last(static_cast<size_t>(K));
    dequantize_rows(m, N - 1, 1, last.data());
    EXPECT_TRUE(std::equal(last.begin(), last.end(), out.end() - K));
    return out;
  }
};

// Integer weights q [K, N], zeros z [n_groups, N] and scales s [n_groups, N] (fp16 values) with a
// group map g [K]; the expected W [N, K] = s[g[k], n] * (q[k, n] - z[g[k], n]).
struct IntGroups {
  int64_t K, N, n_groups;
  std::vector<uint32_t> q, z;
  std::vector<float> s;
  std::vector<int32_t> g;
  IntGroups(int64_t K_, int64_t N_, int bits, std::vector<int32_t> g_, int64_t n_groups_, uint32_t seed)
      : K(K_), N(N_), n_groups(n_groups_), g(std::move(g_)) {
    std::mt19937 rng(seed);
    const uint32_t top = (1u << bits) - 1;
    for (int64_t i = 0; i < K * N; ++i) q.push_back(rng() % (top + 1));
    for (int64_t i = 0; i < n_groups * N; ++i) z.push_back(1 + rng() % top);  // >= 1: GPTQ stores z - 1
    for (int64_t i = 0; i < n_groups * N; ++i) s.push_back(fp16_to_fp32(fp32_to_fp16(0.001f + 0.01f * (rng() % 97))));
  }
  std::vector<float> expected() const {
    std::vector<float> w(static_cast<size_t>(K * N));
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k) {
        const int64_t gi = g[static_cast<size_t>(k)];
        w[static_cast<size_t>(n * K + k)] =
            s[static_cast<size_t>(gi * N + n)] * (static_cast<float>(q[static_cast<size_t>(k * N + n)]) -
                                                  static_cast<float>(z[static_cast<size_t>(gi * N + n)]));
      }
    return w;
  }
  // GPTQ v1: qweight [K / P, N] packing along k, qzeros [n_groups, N / P] packing along n, zeros minus one.
  SafetensorsBuilder gptq(int bits) const {
    const int64_t P = 32 / bits;
    std::vector<uint32_t> qw(static_cast<size_t>(K / P * N)), qz(static_cast<size_t>(n_groups * N / P));
    for (int64_t k = 0; k < K; ++k)
      for (int64_t n = 0; n < N; ++n) qw[static_cast<size_t>(k / P * N + n)] |= q[static_cast<size_t>(k * N + n)] << (bits * (k % P));
    for (int64_t gi = 0; gi < n_groups; ++gi)
      for (int64_t n = 0; n < N; ++n)
        qz[static_cast<size_t>(gi * N / P + n / P)] |= (z[static_cast<size_t>(gi * N + n)] - 1) << (bits * (n % P));
    std::vector<uint32_t> gw(g.begin(), g.end());
    return SafetensorsBuilder()
        .tensor("m.qweight", "I32", {K / P, N}, words(qw))
        .tensor("m.qzeros", "I32", {n_groups, N / P}, words(qz))
        .half("m.scales", "F16", {n_groups, N}, s)
        .tensor("m.g_idx", "I32", {K}, words(gw));
  }
  // AutoAWQ GEMM: nibble i of word [., c] holds column 8c + ORDER[i], zeros as they are.
  SafetensorsBuilder awq() const {
    static constexpr int kOrder[8] = {0, 2, 4, 6, 1, 3, 5, 7};
    std::vector<uint32_t> qw(static_cast<size_t>(K * N / 8)), qz(static_cast<size_t>(n_groups * N / 8));
    for (int64_t c = 0; c < N / 8; ++c)
      for (int i = 0; i < 8; ++i) {
        const int64_t n = 8 * c + kOrder[i];
        for (int64_t k = 0; k < K; ++k) qw[static_cast<size_t>(k * N / 8 + c)] |= q[static_cast<size_t>(k * N + n)] << (4 * i);
        for (int64_t gi = 0; gi < n_groups; ++gi)
          qz[static_cast<size_t>(gi * N / 8 + c)] |= z[static_cast<size_t>(gi * N + n)] << (4 * i);
      }
    return SafetensorsBuilder()
        .tensor("m.qweight", "I32", {K, N / 8}, words(qw))
        .tensor("m.qzeros", "I32", {n_groups, N / 8}, words(qz))
        .half("m.scales", "F16", {n_groups, N}, s);
  }
};

std::vector<int32_t> consecutive_groups(int64_t K, int64_t G) {
  std::vector<int32_t> g;
  for (int64_t k = 0; k < K; ++k) g.push_back(static_cast<int32_t>(k / G));
  return g;
}

TEST(QuantizedMatrix, Fp8E4m3fnValues) {
  EXPECT_EQ(e4m3_to_float(0x38), 1.0f);    // exponent 7 = bias
  EXPECT_EQ(e4m3_to_float(0x3C), 1.5f);    // mantissa 4 / 8
  EXPECT_EQ(e4m3_to_float(0xC0), -2.0f);
  EXPECT_EQ(e4m3_to_float(0x7E), 448.0f);  // the largest finite value
  EXPECT_EQ(e4m3_to_float(0x08), 0.015625f);                  // the smallest normal, 2^-6
  EXPECT_EQ(e4m3_to_float(0x01), 0.001953125f);               // the smallest subnormal, 2^-9
  EXPECT_EQ(e4m3_to_float(0x07), 7 * 0.001953125f);
  EXPECT_EQ(e4m3_to_float(0x00), 0.0f);
  EXPECT_TRUE(std::signbit(e4m3_to_float(0x80)));
  EXPECT_TRUE(std::isnan(e4m3_to_float(0x7F)));
  EXPECT_TRUE(std::isnan(e4m3_to_float(0xFF)));
  EXPECT_EQ(e4m3_to_float(0x77), 240.0f);  // no infinities: exponent 15 is a normal binade
}

TEST(QuantizedMatrix, Gptq4BitAsymmetricZeros) {
  const IntGroups t(32, 16, 4, consecutive_groups(32, 8), 4, 1);
  const Checkpoint c(t.gptq(4));
  EXPECT_EQ(c.dequantize(config_of(gptq_config(4, 8, false)), 32, 16), t.expected());
}

TEST(QuantizedMatrix, Gptq8Bit) {
  const IntGroups t(16, 8, 8, consecutive_groups(16, 4), 4, 2);
  const Checkpoint c(t.gptq(8));
  const QuantConfig cfg = config_of(gptq_config(8, 4, false));
  EXPECT_EQ(c.read(cfg, 16, 8).bits, 8);
  EXPECT_EQ(c.dequantize(cfg, 16, 8), t.expected());
}

// desc_act: groups are an arbitrary map (here 8 inputs each, shuffled); qweight rows stay in input order.
TEST(QuantizedMatrix, GptqActOrderFollowsGIdx) {
  std::vector<int32_t> g = consecutive_groups(32, 8);
  std::shuffle(g.begin(), g.end(), std::mt19937(7));
  const IntGroups t(32, 8, 4, g, 4, 3);
  const Checkpoint c(t.gptq(4));
  const std::vector<float> got = c.dequantize(config_of(gptq_config(4, 8, true)), 32, 8);
  EXPECT_EQ(got, t.expected());
  // Indexing by k / G instead would differ.
  IntGroups plain = t;
  plain.g = consecutive_groups(32, 8);
  EXPECT_NE(got, plain.expected());
}

// group_size -1: one group of the whole row.
TEST(QuantizedMatrix, GptqOneGroupPerRow) {
  const IntGroups t(16, 8, 4, std::vector<int32_t>(16, 0), 1, 4);
  const Checkpoint c(t.gptq(4));
  EXPECT_EQ(c.dequantize(config_of(gptq_config(4, -1, false)), 16, 8), t.expected());
}

TEST(QuantizedMatrix, AwqNibbleOrder) {
  const IntGroups t(16, 16, 4, consecutive_groups(16, 4), 4, 5);
  const Checkpoint c(t.awq());
  const json cfg = {{"quant_method", "awq"}, {"bits", 4}, {"group_size", 4}, {"version", "gemm"}, {"zero_point", true}};
  EXPECT_EQ(c.dequantize(config_of(cfg), 16, 16), t.expected());
  // Column 1 sits in nibble 4 of word 0: a word holding only nibble 4 = 3 gives q[0, 1] = 3.
  std::vector<uint32_t> qw(16 * 2, 0), qz(4 * 2, 0);
  qw[0] = 3u << 16;
  const Checkpoint one(SafetensorsBuilder()
                           .tensor("m.qweight", "I32", {16, 2}, words(qw))
                           .tensor("m.qzeros", "I32", {4, 2}, words(qz))
                           .half("m.scales", "F16", {4, 16}, std::vector<float>(64, 1.0f)));
  const std::vector<float> w = one.dequantize(config_of(cfg), 16, 16);
  EXPECT_EQ(w[1 * 16 + 0], 3.0f);
  EXPECT_EQ(std::count(w.begin(), w.end(), 0.0f), 255);
}

// fp8 codes of known values: 1, 1.5, -2, 0.5, 0, 448, 2^-9, -1.
constexpr uint8_t kCodes[] = {0x38, 0x3C, 0xC0, 0x30, 0x00, 0x7E, 0x01, 0xB8};
constexpr float kValues[] = {1.0f, 1.5f, -2.0f, 0.5f, 0.0f, 448.0f, 0.001953125f, -1.0f};

std::vector<uint8_t> fp8_codes(int64_t n) {
  std::vector<uint8_t> b;
  for (int64_t i = 0; i < n; ++i) b.push_back(kCodes[(i * 5 + i / 3) % 8]);
  return b;
}
float fp8_value(int64_t i) { return kValues[(i * 5 + i / 3) % 8]; }

TEST(QuantizedMatrix, Fp8PerTensorBf16Scale) {
  const float scale = bf16_to_fp32(fp32_to_bf16(0.0123f));
  const Checkpoint c(SafetensorsBuilder()
                         .tensor("m.weight", "F8_E4M3", {4, 8}, fp8_codes(32))
                         .half("m.weight_scale", "BF16", {1}, {scale}));
  const json cfg = {{"quant_method", "compressed-tensors"},
                    {"format", "float-quantized"},
                    {"config_groups",
                     {{"group_0", {{"weights", {{"type", "float"}, {"num_bits", 8}, {"strategy", "tensor"}}}}}}}};
  const QuantConfig q = config_of(cfg);
  EXPECT_EQ(c.read(q, 8, 4).scale_type, GgmlType::BF16);
  const std::vector<float> w = c.dequantize(q, 8, 4);
  for (int64_t i = 0; i < 32; ++i) EXPECT_EQ(w[static_cast<size_t>(i)], fp8_value(i) * scale) << i;
}

TEST(QuantizedMatrix, Fp8PerChannelF16Scale) {
  const std::vector<float> scales = {0.5f, 0.25f, 3.0f};
  const Checkpoint c(SafetensorsBuilder()
                         .tensor("m.weight", "F8_E4M3", {3, 4}, fp8_codes(12))
                         .half("m.weight_scale", "F16", {3, 1}, scales));
  const json cfg = {{"quant_method", "compressed-tensors"},
                    {"format", "float-quantized"},
                    {"ignore", {"lm_head"}},
                    {"config_groups",
                     {{"group_0", {{"weights", {{"type", "float"}, {"num_bits", 8}, {"strategy", "channel"}}}}}}}};
  const std::vector<float> w = c.dequantize(config_of(cfg), 4, 3);
  for (int64_t i = 0; i < 12; ++i) EXPECT_EQ(w[static_cast<size_t>(i)], fp8_value(i) * scales[static_cast<size_t>(i / 4)]) << i;
}

// Blocks of 2 x 4 over a 3 x 6 matrix: the last block row has 1 row, the last block column 2 inputs.
TEST(QuantizedMatrix, Fp8BlocksWithPartialEdges) {
  const std::vector<float> s = {1.0f, 2.0f, 4.0f, 0.125f};  // [2, 2]
  const Checkpoint c(SafetensorsBuilder()
                         .tensor("m.weight", "F8_E4M3", {3, 6}, fp8_codes(18))
                         .tensor("m.pad", "U8", {2})
                         .f32("m.weight_scale_inv", {2, 2}, s));
  const QuantConfig q =
      config_of({{"quant_method", "fp8"}, {"activation_scheme", "dynamic"}, {"weight_block_size", {2, 4}}});
  const std::vector<float> w = c.dequantize(q, 6, 3);
  for (int64_t n = 0; n < 3; ++n)
    for (int64_t k = 0; k < 6; ++k)
      EXPECT_EQ(w[static_cast<size_t>(n * 6 + k)], fp8_value(n * 6 + k) * s[static_cast<size_t>((n / 2) * 2 + k / 4)])
          << n << ", " << k;
}

// --- errors: inconsistent tensors name the tensor ---

std::string read_error(const SafetensorsBuilder& b, const QuantConfig& cfg, int64_t K, int64_t N) {
  const Checkpoint c(b);
  return test::error_of([&] { c.read(cfg, K, N); });
}

TEST(QuantizedMatrixErrors, MissingOrMisshapedTensorsAreNamed) {
  const IntGroups t(32, 16, 4, consecutive_groups(32, 8), 4, 9);
  const QuantConfig cfg = config_of(gptq_config(4, 8, false));
  SafetensorsBuilder no_zeros = SafetensorsBuilder()
                                    .tensor("m.qweight", "I32", {4, 16})
                                    .half("m.scales", "F16", {4, 16}, std::vector<float>(64, 1.0f))
                                    .tensor("m.g_idx", "I32", {32}, words(std::vector<uint32_t>(32, 0)));
  EXPECT_NE(read_error(no_zeros, cfg, 32, 16).find("missing tensor 'm.qzeros' (GPTQ packed zero points)"), std::string::npos);
  // Scales for groups of 16 where the config says 8.
  SafetensorsBuilder groups16 = SafetensorsBuilder()
                                    .tensor("m.qweight", "I32", {4, 16})
                                    .half("m.scales", "F16", {2, 16}, std::vector<float>(32, 1.0f));
  EXPECT_NE(read_error(groups16, cfg, 32, 16).find("tensor 'm.scales' has shape [2, 16], expected [4, 16] (one row per group of 8 inputs)"),
            std::string::npos);
  SafetensorsBuilder f32_words = SafetensorsBuilder().f32("m.qweight", {4, 16}, std::vector<float>(64, 0.0f));
  EXPECT_NE(read_error(f32_words, cfg, 32, 16).find("tensor 'm.qweight' has dtype F32, expected I32"), std::string::npos);
  EXPECT_NE(read_error(t.gptq(4), cfg, 36, 16).find("tensor 'm.qweight' packs in_features 36, which is not a multiple of the 8"),
            std::string::npos);
}

TEST(QuantizedMatrixErrors, GIdxOutOfRangeOrInconsistent) {
  std::vector<int32_t> g = consecutive_groups(32, 8);
  g[5] = 4;  // 4 groups: [0, 4)
  const IntGroups bad(32, 8, 4, g, 4, 10);
  EXPECT_NE(read_error(bad.gptq(4), config_of(gptq_config(4, 8, true)), 32, 8).find("tensor 'm.g_idx' holds group 4 at input 5, outside [0, 4)"),
            std::string::npos);
  g[5] = -1;
  const IntGroups negative(32, 8, 4, g, 4, 10);
  EXPECT_NE(read_error(negative.gptq(4), config_of(gptq_config(4, 8, true)), 32, 8).find("holds group -1 at input 5"),
            std::string::npos);
  std::vector<int32_t> shuffled = consecutive_groups(32, 8);
  std::swap(shuffled[0], shuffled[31]);
  const IntGroups act(32, 8, 4, shuffled, 4, 11);
  EXPECT_NE(read_error(act.gptq(4), config_of(gptq_config(4, 8, false)), 32, 8).find("but desc_act is false"),
            std::string::npos);
}

TEST(QuantizedMatrixErrors, Fp8DtypeAndScaleShape) {
  const QuantConfig channel = config_of(
      {{"quant_method", "compressed-tensors"},
       {"format", "float-quantized"},
       {"config_groups", {{"g", {{"weights", {{"type", "float"}, {"num_bits", 8}, {"strategy", "channel"}}}}}}}});
  EXPECT_NE(read_error(SafetensorsBuilder().tensor("m.weight", "F8_E5M2", {4, 4}).f32("m.weight_scale", {4, 1}, {1, 1, 1, 1}),
                       channel, 4, 4)
                .find("tensor 'm.weight' has dtype F8_E5M2, expected F8_E4M3"),
            std::string::npos);
  EXPECT_NE(read_error(SafetensorsBuilder().tensor("m.weight", "F8_E4M3", {4, 4}).f32("m.weight_scale", {2, 1}, {1, 1}),
                       channel, 4, 4)
                .find("tensor 'm.weight_scale' has shape [2, 1], expected [1] (per tensor) or [4, 1]"),
            std::string::npos);
  EXPECT_NE(read_error(SafetensorsBuilder().tensor("m.weight", "F8_E4M3", {4, 4}).tensor("m.weight_scale", "I32", {4, 1}),
                       channel, 4, 4)
                .find("tensor 'm.weight_scale' has dtype I32, expected F32, F16 or BF16 scales"),
            std::string::npos);
  const QuantConfig block = config_of({{"quant_method", "fp8"}, {"weight_block_size", {128, 128}}});
  EXPECT_NE(read_error(SafetensorsBuilder().tensor("m.weight", "F8_E4M3", {200, 4}).f32("m.weight_scale_inv", {1, 1}, {1}),
                       block, 4, 200)
                .find("tensor 'm.weight_scale_inv' has shape [1, 1], expected [2, 1] (one scale per 128 x 128 block)"),
            std::string::npos);
  EXPECT_NE(read_error(SafetensorsBuilder().tensor("m.weight", "F8_E4M3", {4, 4}), block, 4, 4)
                .find("missing tensor 'm.weight_scale_inv'"),
            std::string::npos);
}

// --- errors: config.json's quantization_config ---

std::string config_error(const json& qc) { return test::error_of([&] { config_of(qc); }); }

TEST(QuantConfigErrors, UnsupportedMetadataIsNamed) {
  EXPECT_EQ(config_error({{"quant_method", "bitsandbytes"}}),
            "config.json: quantization_config: quant_method 'bitsandbytes' is not supported (supported: gptq, awq, fp8, "
            "compressed-tensors)");
  json g = gptq_config(3, 128, false);
  EXPECT_EQ(config_error(g), "config.json: quantization_config: bits 3 is not supported (4 or 8)");
  for (const char* format : {"gptq_v2", "marlin"}) {
    g = gptq_config(4, 128, false);
    g["checkpoint_format"] = format;
    EXPECT_NE(config_error(g).find("checkpoint_format '" + std::string(format) + "' is not supported"), std::string::npos);
  }
  g = gptq_config(4, 128, false);
  g.erase("group_size");
  EXPECT_NE(config_error(g).find("missing field 'group_size'"), std::string::npos);
  EXPECT_NE(config_error({{"quant_method", "awq"}, {"bits", 4}, {"version", "gemm"}}).find("missing field 'q_group_size'"),
            std::string::npos);
  g = gptq_config(4, 0, false);
  EXPECT_NE(config_error(g).find("field 'group_size' must be positive or -1, got 0"), std::string::npos);
  EXPECT_NE(config_error({{"quant_method", "awq"}, {"bits", 4}, {"group_size", 128}, {"version", "gemv"}})
                .find("AWQ version 'gemv' is not supported"),
            std::string::npos);
  EXPECT_NE(config_error({{"quant_method", "awq"}, {"bits", 8}, {"group_size", 128}}).find("bits 8 is not supported"),
            std::string::npos);
  EXPECT_NE(config_error({{"quant_method", "fp8"}, {"fmt", "e5m2"}}).find("fmt 'e5m2' is not supported"), std::string::npos);
  EXPECT_NE(config_error({{"quant_method", "fp8"}, {"activation_scheme", "static"}}).find("activation_scheme 'static'"),
            std::string::npos);
  EXPECT_NE(config_error({{"quant_method", "fp8"}, {"weight_block_size", {128}}}).find("field 'weight_block_size' must be"),
            std::string::npos);
  EXPECT_NE(config_error({{"quant_method", "compressed-tensors"},
                          {"format", "float-quantized"},
                          {"config_groups", {{"g", {{"weights", {{"type", "int"}, {"num_bits", 4}}}}}}}})
                .find("weights of type 'int' and num_bits 4 are not supported"),
            std::string::npos);
  EXPECT_NE(config_error({{"quant_method", "compressed-tensors"}, {"format", "pack-quantized"}}).find("format 'pack-quantized'"),
            std::string::npos);
}

TEST(QuantConfig, ReadsMethodsAndIgnoreLists) {
  EXPECT_FALSE(QuantConfig::from_json(json{{"hidden_size", 8}}, "c").quantized());
  EXPECT_FALSE(QuantConfig::from_json(json{{"quantization_config", nullptr}}, "c").quantized());
  const QuantConfig g = config_of(gptq_config(8, 64, true));
  EXPECT_EQ(g.method, QuantMethod::Gptq);
  EXPECT_EQ(g.bits, 8);
  EXPECT_EQ(g.group_size, 64);
  EXPECT_TRUE(g.desc_act);
  const QuantConfig f = config_of({{"quant_method", "fp8"},
                                   {"weight_block_size", {128, 64}},
                                   {"modules_to_not_convert", {"lm_head", "mlp.gate", "re:.*layers\\.1\\.self_attn\\..*"}}});
  EXPECT_EQ(f.block_n, 128);
  EXPECT_EQ(f.block_k, 64);
  EXPECT_TRUE(f.is_not_converted("lm_head"));
  EXPECT_TRUE(f.is_not_converted("model.layers.0.mlp.gate"));
  EXPECT_FALSE(f.is_not_converted("model.layers.0.mlp.gate_proj"));
  EXPECT_TRUE(f.is_not_converted("model.layers.1.self_attn.q_proj"));
  EXPECT_FALSE(f.is_not_converted("model.layers.2.self_attn.q_proj"));
  EXPECT_EQ(parse_quantization("compressed-tensors"), Quantization::Fp8);
  EXPECT_EQ(test::error_of([] { parse_quantization("int4"); }),
            "unknown quantization 'int4' (supported: auto, none, fp8, awq, gptq, rtn)");
}

// Hostile metadata fails with an error, never a crash or a hang: block sizes whose ceil division
// would overflow, values nested deeper than a recursive dump survives, ignore patterns nested past
// PCRE2's parenthesis limit, and a catastrophically backtracking ignore pattern.
TEST(QuantConfigErrors, HostileMetadataIsAnErrorNotACrash) {
  const int64_t big = INT64_MAX;
  EXPECT_NE(config_error({{"quant_method", "fp8"}, {"weight_block_size", {big, big}}})
                .find("field 'weight_block_size' must be [rows, columns] of two integers in [1, 1073741824]"),
            std::string::npos);
  // Parsed in place (nlohmann's parser and destructor do not recurse; copying the value would).
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  const std::string text = R"({"quantization_config": {"quant_method": "gptq", "group_size": 128, "bits": )" + deep + "}}";
  EXPECT_NE(test::error_of([&] { QuantConfig::from_json(json::parse(text), "config.json"); }).find("an array of 1 elements"),
            std::string::npos);
  const json nested = {{"quant_method", "fp8"}, {"modules_to_not_convert", {"re:" + std::string(20000, '(') + std::string(20000, ')')}}};
  EXPECT_NE(config_error(nested).find("not a valid regular expression"), std::string::npos);
  // (a|a)+ before a failing tail tries 2^32 splits of the a's (the subject holds every code unit
  // the pattern requires, so PCRE2's quick rejections do not apply).
  const QuantConfig f =
      config_of({{"quant_method", "fp8"}, {"modules_to_not_convert", {"lm_head", "re:(a|a)+bc", "re:(.*)*x"}}});
  EXPECT_NE(test::error_of([&] { (void)f.is_not_converted(std::string(32, 'a') + "cbc"); })
                .find("backtracks past PCRE2's limits"),
            std::string::npos);
  EXPECT_TRUE(f.is_not_converted("lm_head"));
}

}  // namespace
}  // namespace kestrel
