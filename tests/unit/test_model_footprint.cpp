// ModelFootprint: KV geometry, training context and weight bytes from HF config.json files and
// GGUF headers (synthetic images and the default model). Parameter counts are checked against the
// published totals of the models.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <string>

#include "core/dtype.h"
#include "core/error.h"
#include "gguf_builder.h"
#include "gguf_test_support.h"
#include "hf_configs.h"
#include "io/gguf.h"
#include "memory/kv_planner.h"
#include "model/model_footprint.h"
#include "test_util.h"

using namespace kestrel;
using kestrel::test::error_of;
using kestrel::test::GgufBuilder;
using kestrel::test::TempDir;
using kestrel::test::gguf::parse;
using B = GgufBuilder;

namespace {

KvGeometry geometry_of(const ModelFootprint& fp) {
  return {fp.n_layer, fp.n_head_kv, fp.head_dim, fp.kv_lora_rank, fp.rope_dim};
}

}  // namespace

TEST(KvPlannerParams, PublishedParameterCounts) {
  // LLaMA-2-7B: 2 x 32000 x 4096 + 32 x (4 x 4096^2 + 3 x 4096 x 11008 + 2 x 4096) + 4096.
  EXPECT_EQ(hf_parameter_count(test::llama2_7b_config(), "cfg"), 6'738'415'616);
  // LLaMA-2-70B: GQA k/v are 8192 x 1024 each.
  EXPECT_EQ(hf_parameter_count(test::llama2_70b_config(), "cfg"), 68'976'648'192);
  // Mixtral-8x7B: 8 experts of 3 x 4096 x 14336 and a 4096 x 8 router per layer.
  const nlohmann::json mixtral = {{"hidden_size", 4096},      {"intermediate_size", 14336},
                                  {"num_hidden_layers", 32},  {"num_attention_heads", 32},
                                  {"num_key_value_heads", 8}, {"num_local_experts", 8},
                                  {"vocab_size", 32000},      {"tie_word_embeddings", false}};
  EXPECT_EQ(hf_parameter_count(mixtral, "cfg"), 46'702'792'704);
  // Qwen2.5-0.5B: tied embeddings and q/k/v biases.
  const nlohmann::json qwen = {{"model_type", "qwen2"},     {"hidden_size", 896},
                               {"intermediate_size", 4864}, {"num_hidden_layers", 24},
                               {"num_attention_heads", 14}, {"num_key_value_heads", 2},
                               {"vocab_size", 151936},      {"tie_word_embeddings", true}};
  EXPECT_EQ(hf_parameter_count(qwen, "cfg"), 494'032'768);
  // DeepSeek-V2: 236B published (the routed experts dominate).
  const int64_t ds = hf_parameter_count(test::deepseek_v2_config(), "cfg");
  EXPECT_GT(ds, 235'000'000'000);
  EXPECT_LT(ds, 237'000'000'000);
}

TEST(KvPlannerHfConfig, Llama2_70bThroughAConfigFile) {
  TempDir dir;
  const ModelFootprint fp = ModelFootprint::from_hf_config(dir.write_config(test::llama2_70b_config()));
  EXPECT_EQ(fp.format, "hf");
  EXPECT_EQ(fp.arch, "llama");
  EXPECT_EQ(fp.n_layer, 80);
  EXPECT_EQ(fp.n_head_kv, 8);
  EXPECT_EQ(fp.head_dim, 128);  // 8192 / 64
  EXPECT_EQ(fp.n_ctx_train, 4096);
  EXPECT_EQ(kv_bytes_per_token(geometry_of(fp), KvDtype::F16), 327680);
  EXPECT_EQ(fp.weight_source, WeightSource::ConfigEstimate);
  EXPECT_EQ(fp.n_params, 68'976'648'192);
  EXPECT_EQ(fp.weight_dtype, "float16");
  EXPECT_EQ(fp.weight_bytes, 2 * int64_t{68'976'648'192});
  // The folder works as well as the file in it.
  EXPECT_EQ(ModelFootprint::from_hf_config(dir.path()).path, dir.path() + "/config.json");
}

TEST(KvPlannerHfConfig, QuantizedCheckpointsCountTheirCodeBytes) {
  // LLaMA-2-7B: 6,738,415,616 parameters, of which 2 x 32,000 x 4,096 embeddings + head and
  // (2 x 32 + 1) x 4,096 norm weights stay f16: 262,410,240 -> 524,820,480 bytes.
  // The other 6,476,005,376 (the projections) in GPTQ 4-bit, group 128: 0.5 + (2 + 0.5) / 128 =
  // 0.51953125 B each -> 3,364,487,168; in FP8 1 B each.
  TempDir dir;
  nlohmann::json c = test::llama2_7b_config();
  c["quantization_config"] = {{"quant_method", "gptq"}, {"bits", 4}, {"group_size", 128}, {"desc_act", false}};
  ModelFootprint fp = ModelFootprint::from_hf_config(dir.write_config(c));
  EXPECT_EQ(fp.n_params, 6'738'415'616);
  EXPECT_EQ(fp.weight_bytes, 524'820'480 + 3'364'487'168);
  EXPECT_EQ(fp.weight_dtype, "gptq 4-bit projections, float16 embeddings");
  c["quantization_config"] = {{"quant_method", "fp8"}, {"activation_scheme", "dynamic"}};
  fp = ModelFootprint::from_hf_config(dir.write_config(c));
  EXPECT_EQ(fp.weight_bytes, 524'820'480 + 6'476'005'376);
}

TEST(KvPlannerHfConfig, DefaultsAndHeadDimField) {
  TempDir dir;
  nlohmann::json c = test::llama2_7b_config();
  c.erase("num_key_value_heads");  // defaults to num_attention_heads
  c["head_dim"] = 256;             // wins over hidden_size / num_attention_heads
  c["torch_dtype"] = "float32";
  const ModelFootprint fp = ModelFootprint::from_hf_config(dir.write_config(c));
  EXPECT_EQ(fp.n_head_kv, 32);
  EXPECT_EQ(fp.head_dim, 256);
  EXPECT_EQ(fp.weight_bytes, 4 * fp.n_params);
}

TEST(KvPlannerHfConfig, DeepSeekV2Mla) {
  TempDir dir;
  const ModelFootprint fp = ModelFootprint::from_hf_config(dir.write_config(test::deepseek_v2_config()));
  EXPECT_EQ(fp.kv_lora_rank, 512);
  EXPECT_EQ(fp.rope_dim, 64);
  EXPECT_EQ(fp.n_ctx_train, 163840);
  // 60 x (512 + 64) x 2 = 69,120.
  EXPECT_EQ(kv_bytes_per_token(geometry_of(fp), KvDtype::BF16), 69120);
}

TEST(KvPlannerHfConfig, SumsSafetensorsFilesWhenPresent) {
  TempDir dir;
  const std::string config = dir.write_config(test::llama2_7b_config());
  dir.write("model-00001-of-00002.safetensors", std::string(1000, 'a'));
  dir.write("model-00002-of-00002.safetensors", std::string(2345, 'b'));
  dir.write("model.safetensors.index.json", std::string(777, 'c'));  // not weights
  const ModelFootprint fp = ModelFootprint::from_hf_config(config);
  EXPECT_EQ(fp.weight_source, WeightSource::SafetensorsFiles);
  EXPECT_EQ(fp.n_weight_items, 2);
  EXPECT_EQ(fp.weight_bytes, 3345);
}

TEST(KvPlannerHfConfig, ErrorsNameTheFileAndField) {
  TempDir dir;
  EXPECT_NE(error_of([&] { ModelFootprint::from_hf_config(dir.path() + "/none.json"); }).find("cannot open"),
            std::string::npos);
  const std::string bad_json = dir.write("bad.json", "{\"num_hidden_layers\": 32,");
  EXPECT_NE(error_of([&] { ModelFootprint::from_hf_config(bad_json); }).find("invalid JSON"),
            std::string::npos);
  const std::string array = dir.write("array.json", "[1, 2]");
  EXPECT_NE(error_of([&] { ModelFootprint::from_hf_config(array); }).find("JSON object"), std::string::npos);

  struct Case {
    const char* field;
    nlohmann::json value;  // null: erase the field
    const char* phrase;
  };
  const Case cases[] = {
      {"num_hidden_layers", nullptr, "missing required field 'num_hidden_layers'"},
      {"num_attention_heads", nullptr, "missing required field 'num_attention_heads'"},
      {"hidden_size", nullptr, "missing required field 'hidden_size'"},
      {"num_key_value_heads", 0, "'num_key_value_heads' must be in [1,"},
      {"num_hidden_layers", -3, "'num_hidden_layers' must be in [1,"},
      {"num_attention_heads", "32", "'num_attention_heads' must be an integer"},
      {"hidden_size", 4097, "not a multiple of num_attention_heads"},
      {"max_position_embeddings", 0, "'max_position_embeddings' must be in [1,"},
      {"torch_dtype", nullptr, "missing field 'torch_dtype'"},
      {"torch_dtype", "float4", "unknown torch_dtype 'float4'"},
      {"vocab_size", nullptr, "missing required field 'vocab_size'"},
  };
  for (const Case& c : cases) {
    nlohmann::json j = test::llama2_7b_config();
    if (c.value.is_null())
      j.erase(c.field);
    else
      j[c.field] = c.value;
    const std::string path = dir.write_config(j);
    const std::string e = error_of([&] { ModelFootprint::from_hf_config(path); });
    EXPECT_EQ(e.rfind(path + ": ", 0), 0u) << e;
    EXPECT_NE(e.find(c.phrase), std::string::npos) << c.field << " -> " << e;
  }
}

TEST(KvPlannerGguf, ReadsGeometryAndTensorBytesFromTheHeader) {
  const auto img = B().kv("general.architecture", B::str("llama"))
                       .kv("llama.block_count", B::u32(4))
                       .kv("llama.embedding_length", B::u32(256))
                       .kv("llama.attention.head_count", B::u32(8))
                       .kv("llama.attention.head_count_kv", B::u32(2))
                       .kv("llama.context_length", B::u32(1024))
                       .tensor("a", {256, 4}, GgmlType::F32)   // 4,096 bytes
                       .tensor("b", {256, 2}, GgmlType::Q4_0)  // 2 rows x 8 blocks x 18 = 288 bytes
                       .build();
  const ModelFootprint fp = ModelFootprint::from_gguf(parse(img));
  EXPECT_EQ(fp.format, "gguf");
  EXPECT_EQ(fp.arch, "llama");
  EXPECT_EQ(fp.n_layer, 4);
  EXPECT_EQ(fp.n_head_kv, 2);
  EXPECT_EQ(fp.head_dim, 32);  // 256 / 8
  EXPECT_EQ(fp.n_ctx_train, 1024);
  EXPECT_EQ(fp.weight_bytes, 4096 + 288);
  EXPECT_EQ(fp.n_weight_items, 2);
}

TEST(KvPlannerGguf, KeyLengthAndHeadCountDefaults) {
  const auto img = B().kv("general.architecture", B::str("qwen2"))
                       .kv("qwen2.block_count", B::u32(2))
                       .kv("qwen2.embedding_length", B::u32(256))
                       .kv("qwen2.attention.head_count", B::u32(4))
                       .kv("qwen2.attention.key_length", B::u32(128))
                       .build();
  const ModelFootprint fp = ModelFootprint::from_gguf(parse(img));
  EXPECT_EQ(fp.n_head_kv, 4);    // head_count_kv absent
  EXPECT_EQ(fp.head_dim, 128);   // key_length, not 256 / 4
  EXPECT_EQ(fp.n_ctx_train, 0);  // context_length absent
  EXPECT_EQ(fp.weight_bytes, 0);
}

TEST(KvPlannerGguf, Deepseek2Mla) {
  const auto img = B().kv("general.architecture", B::str("deepseek2"))
                       .kv("deepseek2.block_count", B::u32(60))
                       .kv("deepseek2.attention.head_count", B::u32(128))
                       .kv("deepseek2.attention.kv_lora_rank", B::u32(512))
                       .kv("deepseek2.rope.dimension_count", B::u32(64))
                       .kv("deepseek2.context_length", B::u32(163840))
                       .build();
  const ModelFootprint fp = ModelFootprint::from_gguf(parse(img));
  EXPECT_EQ(fp.kv_lora_rank, 512);
  EXPECT_EQ(fp.rope_dim, 64);
  EXPECT_EQ(kv_bytes_per_token(geometry_of(fp), KvDtype::BF16), 69120);  // 60 x 576 x 2
}

TEST(KvPlannerGguf, MissingOrNonPositiveKeysAreNamed) {
  const auto no_layers = B().kv("general.architecture", B::str("llama"))
                             .kv("llama.embedding_length", B::u32(256))
                             .kv("llama.attention.head_count", B::u32(8))
                             .build();
  std::string e = error_of([&] { ModelFootprint::from_gguf(parse(no_layers)); });
  EXPECT_NE(e.find("llama.block_count"), std::string::npos) << e;
  const auto zero_kv = B().kv("general.architecture", B::str("llama"))
                           .kv("llama.block_count", B::u32(4))
                           .kv("llama.embedding_length", B::u32(256))
                           .kv("llama.attention.head_count", B::u32(8))
                           .kv("llama.attention.head_count_kv", B::u32(0))
                           .build();
  e = error_of([&] { ModelFootprint::from_gguf(parse(zero_kv)); });
  EXPECT_NE(e.find("llama.attention.head_count_kv"), std::string::npos) << e;
}

TEST(KvPlannerGguf, DefaultModelSmolLM2) {
  const std::string path = test::model_dir() + "/SmolLM2-135M-Instruct.Q4_1.gguf";
  KESTREL_REQUIRE_FILE(path);
  const GgufFile f = GgufFile::open(path);
  const ModelFootprint fp = ModelFootprint::from_gguf(f);
  EXPECT_EQ(fp.n_layer, 30);
  EXPECT_EQ(fp.n_head_kv, 3);
  EXPECT_EQ(fp.head_dim, 64);
  EXPECT_EQ(fp.n_ctx_train, 8192);
  // 2 x 30 x 3 x 64 x 2 = 23,040 bytes per token in f16.
  EXPECT_EQ(kv_bytes_per_token(geometry_of(fp), KvDtype::F16), 23040);
  // The tensor sizes recomputed from each tensor's shape and type.
  int64_t sum = 0;
  for (const GgufTensorInfo& t : f.tensors())
    sum += static_cast<int64_t>(row_bytes(t.type, t.ne[0])) * t.n_rows();
  EXPECT_EQ(fp.weight_bytes, sum);
  EXPECT_EQ(fp.weight_bytes, 96'576'768);

  // 80e9 - 96,576,768 = 79,903,423,232 bytes of KV; / 23,040 = 3,468,030.5 tokens;
  // / (8,192 x 23,040 = 188,743,680) = 423.3 sequences;
  // ceiling 4.8e12 / (96,576,768 + 188,743,680 = 285,320,448) = 16,823.19 tok/s.
  KvPlanRequest r;
  r.geometry = geometry_of(fp);
  r.context = fp.n_ctx_train;
  r.weight_bytes = fp.weight_bytes;
  r.memory_bytes = 80'000'000'000;
  r.bandwidth_bytes_per_s = 4.8e12;
  const KvPlan p = plan_kv(r);
  EXPECT_EQ(p.kv_bytes_per_seq, 188'743'680);
  EXPECT_EQ(p.kv_budget_bytes, 79'903'423'232);
  EXPECT_EQ(p.max_tokens, 3'468'030);
  EXPECT_EQ(p.max_seqs, 423);
  EXPECT_NEAR(p.decode_tok_per_s_ceiling, 16823.19, 0.01);
}
