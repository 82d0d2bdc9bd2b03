// KV planner arithmetic and the size/bandwidth parser. The expected values are worked out by hand
// in the comment next to each.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>

#include "core/error.h"
#include "core/units.h"
#include "memory/kv_planner.h"
#include "test_util.h"

using namespace kestrel;
using kestrel::test::error_of;

namespace {

const KvGeometry kLlama2_70b{80, 8, 128, 0, 0};
const KvGeometry kLlama2_7b{32, 32, 128, 0, 0};
const KvGeometry kDeepSeekV2{60, 0, 0, 512, 64};

KvPlanRequest request(KvGeometry g, int64_t context, int64_t weights, int64_t memory) {
  KvPlanRequest r;
  r.geometry = g;
  r.context = context;
  r.weight_bytes = weights;
  r.memory_bytes = memory;
  r.bandwidth_bytes_per_s = 4.8e12;
  return r;
}

}  // namespace

TEST(KvPlanner, Llama2_70bBytesPerToken) {
  // 2 x 80 layers x 8 KV heads x 128 x 2 bytes = 327,680.
  EXPECT_EQ(kv_bytes_per_token(kLlama2_70b, KvDtype::F16), 327680);
  EXPECT_EQ(kv_bytes_per_token(kLlama2_70b, KvDtype::F32), 655360);
  // fp8: 2 x 80 x 8 x (128 x 1 + 4 bytes of row scale) = 168,960.
  EXPECT_EQ(kv_bytes_per_token(kLlama2_70b, KvDtype::FP8), 168960);
  EXPECT_EQ(kv_bytes_per_token(kLlama2_70b, KvDtype::INT8), 168960);
}

TEST(KvPlanner, Llama2_7bBytesPerSequenceAt4096) {
  // 2 x 32 x 32 x 128 x 2 = 524,288 bytes per token; x 4,096 = 2^31 = 2,147,483,648.
  const KvPlan p = plan_kv(request(kLlama2_7b, 4096, 0, int64_t{80'000'000'000}));
  EXPECT_EQ(p.kv_bytes_per_token, 524288);
  EXPECT_EQ(p.kv_bytes_per_seq, 2147483648);
}

TEST(KvPlanner, DeepSeekV2MlaHasNoFactorTwo) {
  // 60 layers x (512 + 64) x 2 bytes (bf16) = 69,120: one latent shared by K and V.
  EXPECT_TRUE(kDeepSeekV2.is_mla());
  EXPECT_EQ(kv_bytes_per_token(kDeepSeekV2, KvDtype::BF16), 69120);
  // int8: 60 x ((512 + 64) x 1 + 2 x 4 bytes of scales: latent and RoPE key) = 35,040.
  EXPECT_EQ(kv_bytes_per_token(kDeepSeekV2, KvDtype::INT8), 35040);
}

TEST(KvPlanner, FitsAndCeilingArithmetic) {
  // LLaMA-2-7B, 13.5e9 bytes of weights in 80e9: budget 66.5e9;
  // tokens 66,500,000,000 / 524,288 = 126,838.68 -> 126,838;
  // sequences 66,500,000,000 / 2,147,483,648 = 30.97 -> 30;
  // ceiling 4.8e12 / (13.5e9 + 2,147,483,648) = 4.8e12 / 15,647,483,648 = 306.76 tok/s.
  const KvPlan p = plan_kv(request(kLlama2_7b, 4096, 13'500'000'000, 80'000'000'000));
  EXPECT_TRUE(p.weights_fit);
  EXPECT_EQ(p.kv_budget_bytes, 66'500'000'000);
  EXPECT_EQ(p.max_tokens, 126838);
  EXPECT_EQ(p.max_seqs, 30);
  EXPECT_EQ(p.weight_shortfall_bytes, 0);
  EXPECT_DOUBLE_EQ(p.decode_tok_per_s_ceiling, 4.8e12 / 15647483648.0);
  EXPECT_NEAR(p.decode_tok_per_s_ceiling, 306.76, 0.01);
}

TEST(KvPlanner, WeightsThatDoNotFitGiveZerosNotNegatives) {
  // LLaMA-2-70B in f16 is 137,953,296,384 bytes: 57,953,296,384 more than 80e9.
  const KvPlan p = plan_kv(request(kLlama2_70b, 4096, 137'953'296'384, 80'000'000'000));
  EXPECT_FALSE(p.weights_fit);
  EXPECT_EQ(p.kv_budget_bytes, 0);
  EXPECT_EQ(p.max_tokens, 0);
  EXPECT_EQ(p.max_seqs, 0);
  EXPECT_EQ(p.weight_shortfall_bytes, 57'953'296'384);
  // The ceiling is a bandwidth bound and is still reported: 4.8e12 / (137,953,296,384 + 4,096 x 327,680).
  EXPECT_DOUBLE_EQ(p.decode_tok_per_s_ceiling, 4.8e12 / (137953296384.0 + 1342177280.0));
}

TEST(KvPlanner, WeightsFillingMemoryExactlyLeaveNoKv) {
  const KvPlan p = plan_kv(request(kLlama2_7b, 4096, 1000, 1000));
  EXPECT_TRUE(p.weights_fit);
  EXPECT_EQ(p.kv_budget_bytes, 0);
  EXPECT_EQ(p.max_tokens, 0);
  EXPECT_EQ(p.max_seqs, 0);
}

TEST(KvPlanner, RejectsOutOfRangeRequests) {
  EXPECT_NE(error_of([] { plan_kv(request(kLlama2_7b, 0, 0, 1000)); }).find("context"), std::string::npos);
  EXPECT_NE(error_of([] { plan_kv(request(kLlama2_7b, 16, -1, 1000)); }).find("weight"), std::string::npos);
  EXPECT_NE(error_of([] { plan_kv(request(kLlama2_7b, 16, 0, 0)); }).find("memory"), std::string::npos);
  for (double bw : {0.0, -1.0, std::nan(""), std::numeric_limits<double>::infinity()}) {
    KvPlanRequest r = request(kLlama2_7b, 16, 0, 1000);
    r.bandwidth_bytes_per_s = bw;
    EXPECT_NE(error_of([&] { plan_kv(r); }).find("bandwidth"), std::string::npos) << bw;
  }
  EXPECT_NE(error_of([] {
              kv_bytes_per_token({0, 8, 128, 0, 0}, KvDtype::F16);
            }).find("n_layer"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              kv_bytes_per_token({8, 0, 128, 0, 0}, KvDtype::F16);
            }).find("n_head_kv"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              kv_bytes_per_token({8, 8, -2, 0, 0}, KvDtype::F16);
            }).find("head_dim"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              kv_bytes_per_token({8, 0, 0, 512, 0}, KvDtype::F16);
            }).find("rope_dim"),
            std::string::npos);
}

TEST(KvPlanner, OverflowIsAnErrorNotAWrappedNumber) {
  const std::string e = error_of([] { plan_kv(request(kLlama2_70b, int64_t{1} << 50, 0, 1000)); });
  EXPECT_NE(e.find("overflows"), std::string::npos) << e;
}

TEST(KvPlanner, KvDtypeNamesAndSizes) {
  EXPECT_EQ(parse_kv_dtype("f16", "--kv-dtype"), KvDtype::F16);
  EXPECT_EQ(parse_kv_dtype("FP16", "--kv-dtype"), KvDtype::F16);
  EXPECT_EQ(parse_kv_dtype("bf16", "--kv-dtype"), KvDtype::BF16);
  EXPECT_EQ(parse_kv_dtype("fp8", "--kv-dtype"), KvDtype::FP8);
  EXPECT_EQ(parse_kv_dtype("int8", "--kv-dtype"), KvDtype::INT8);
  EXPECT_EQ(parse_kv_dtype("f32", "--kv-dtype"), KvDtype::F32);
  EXPECT_EQ(kv_dtype_bytes(KvDtype::F32), 4);
  EXPECT_EQ(kv_dtype_bytes(KvDtype::BF16), 2);
  EXPECT_EQ(kv_dtype_bytes(KvDtype::FP8), 1);
  EXPECT_EQ(kv_dtype_name(KvDtype::INT8), "int8");
  const std::string e = error_of([] { parse_kv_dtype("f12", "--kv-dtype"); });
  EXPECT_NE(e.find("--kv-dtype"), std::string::npos) << e;
  EXPECT_NE(e.find("f12"), std::string::npos) << e;
}

TEST(KvPlannerUnits, ParsesByteSizes) {
  EXPECT_EQ(parse_byte_size("80GB", "--memory"), 80'000'000'000);
  EXPECT_EQ(parse_byte_size("80 gb", "--memory"), 80'000'000'000);
  EXPECT_EQ(parse_byte_size("64GiB", "--memory"), 68'719'476'736);  // 64 x 2^30
  EXPECT_EQ(parse_byte_size("1500000000", "--memory"), 1'500'000'000);
  EXPECT_EQ(parse_byte_size("1.5GB", "--memory"), 1'500'000'000);
  EXPECT_EQ(parse_byte_size("2e9", "--memory"), 2'000'000'000);
  EXPECT_EQ(parse_byte_size(" 7 MiB ", "--memory"), 7 * 1024 * 1024);
  EXPECT_EQ(parse_byte_size("1KB", "--memory"), 1000);
  EXPECT_EQ(parse_byte_size("1KiB", "--memory"), 1024);
  EXPECT_EQ(parse_byte_size("2MB", "--memory"), 2'000'000);
  EXPECT_EQ(parse_byte_size("1TB", "--memory"), 1'000'000'000'000);
  EXPECT_EQ(parse_byte_size("1TiB", "--memory"), 1'099'511'627'776);
  EXPECT_EQ(parse_byte_size("512B", "--memory"), 512);
  EXPECT_EQ(parse_byte_size("9223372036854775807", "--memory"), std::numeric_limits<int64_t>::max());
}

TEST(KvPlannerUnits, RejectsBadByteSizes) {
  for (const char* bad : {"", "GB", "80XB", "80 G B", "-1GB", "0", "0GB", "0.1", "abc", "1e30", "nan", "inf",
                          "80GB/s", "0x10", "9223372036854775807KB", "10000000PB"}) {
    const std::string e = error_of([&] { parse_byte_size(bad, "--memory"); });
    EXPECT_NE(e.find("--memory"), std::string::npos) << "'" << bad << "' -> " << e;
    EXPECT_NE(e.find("'" + std::string(bad) + "'"), std::string::npos) << "'" << bad << "' -> " << e;
  }
}

TEST(KvPlannerUnits, ParsesBandwidths) {
  EXPECT_DOUBLE_EQ(parse_bandwidth("4.8TB/s", "--bandwidth"), 4.8e12);
  EXPECT_DOUBLE_EQ(parse_bandwidth("4.8 TB/s", "--bandwidth"), 4.8e12);
  EXPECT_DOUBLE_EQ(parse_bandwidth("3.35e12", "--bandwidth"), 3.35e12);
  EXPECT_DOUBLE_EQ(parse_bandwidth("900GB/s", "--bandwidth"), 9e11);
  EXPECT_DOUBLE_EQ(parse_bandwidth("900GB", "--bandwidth"), 9e11);
  EXPECT_DOUBLE_EQ(parse_bandwidth("2TiB/s", "--bandwidth"), 2.0 * 1099511627776.0);
}

TEST(KvPlannerUnits, RejectsBadBandwidths) {
  for (const char* bad : {"", "fast", "0", "-1TB/s", "TB/s", "inf", "nan", "4.8TB/h", "4.8XB/s", "1e400"}) {
    const std::string e = error_of([&] { parse_bandwidth(bad, "--bandwidth"); });
    EXPECT_NE(e.find("--bandwidth"), std::string::npos) << "'" << bad << "' -> " << e;
    EXPECT_NE(e.find("'" + std::string(bad) + "'"), std::string::npos) << "'" << bad << "' -> " << e;
  }
}

TEST(KvPlannerUnits, FormatsForTheTable) {
  EXPECT_EQ(format_thousands(327680), "327,680");
  EXPECT_EQ(format_thousands(0), "0");
  EXPECT_EQ(format_thousands(999), "999");
  EXPECT_EQ(format_thousands(-1234567), "-1,234,567");
  EXPECT_EQ(format_bytes_binary(512), "512 B");
  EXPECT_EQ(format_bytes_binary(1536), "1.50 KiB");
  EXPECT_EQ(format_bytes_binary(188743680), "180.00 MiB");
  EXPECT_EQ(format_bytes_binary(2147483648.0), "2.00 GiB");
  EXPECT_EQ(format_bandwidth(4.8e12), "4.80 TB/s");
  EXPECT_EQ(format_bandwidth(9e11), "900.00 GB/s");
}
