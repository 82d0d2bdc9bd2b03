// HF config.json -> ModelHparams: the fields and defaults of transformers' Llama/Mistral/Qwen2
// configs, rope scaling (llama3 divisors against values computed by hand from transformers'
// _compute_llama3_parameters), and one named error per bad field.
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <string>

#include "core/error.h"
#include "hf_configs.h"
#include "model/hf_config.h"

using namespace kestrel;
using nlohmann::json;

namespace {

// meta-llama/Llama-3.1-8B config.json (the fields kestrel reads, published values).
json llama31_8b() {
  return {{"architectures", {"LlamaForCausalLM"}},
          {"model_type", "llama"},
          {"hidden_size", 4096},
          {"intermediate_size", 14336},
          {"num_hidden_layers", 32},
          {"num_attention_heads", 32},
          {"num_key_value_heads", 8},
          {"max_position_embeddings", 131072},
          {"rms_norm_eps", 1e-5},
          {"rope_theta", 500000.0},
          {"rope_scaling",
           {{"factor", 8.0},
            {"low_freq_factor", 1.0},
            {"high_freq_factor", 4.0},
            {"original_max_position_embeddings", 8192},
            {"rope_type", "llama3"}}},
          {"vocab_size", 128256},
          {"tie_word_embeddings", false},
          {"attention_bias", false},
          {"mlp_bias", false},
          {"hidden_act", "silu"},
          {"torch_dtype", "bfloat16"}};
}

// Qwen/Qwen2.5-0.5B config.json.
json qwen25_05b() {
  return {{"architectures", {"Qwen2ForCausalLM"}},
          {"model_type", "qwen2"},
          {"hidden_size", 896},
          {"intermediate_size", 4864},
          {"num_hidden_layers", 24},
          {"num_attention_heads", 14},
          {"num_key_value_heads", 2},
          {"max_position_embeddings", 32768},
          {"max_window_layers", 24},
          {"rms_norm_eps", 1e-6},
          {"rope_theta", 1000000.0},
          {"sliding_window", 32768},
          {"use_sliding_window", false},
          {"tie_word_embeddings", true},
          {"vocab_size", 151936},
          {"hidden_act", "silu"},
          {"torch_dtype", "bfloat16"}};
}

// mistralai/Mistral-7B-v0.1 config.json.
json mistral_7b_v01() {
  return {{"architectures", {"MistralForCausalLM"}},
          {"model_type", "mistral"},
          {"hidden_size", 4096},
          {"intermediate_size", 14336},
          {"num_hidden_layers", 32},
          {"num_attention_heads", 32},
          {"num_key_value_heads", 8},
          {"max_position_embeddings", 32768},
          {"rms_norm_eps", 1e-5},
          {"rope_theta", 10000.0},
          {"sliding_window", 4096},
          {"tie_word_embeddings", false},
          {"vocab_size", 32000},
          {"hidden_act", "silu"}};
}

HfModelConfig parse(const json& j) { return HfModelConfig::from_json(j, "config.json"); }

// The message of the Error parsing j throws ("" when none).
std::string error_of(const json& j) {
  try {
    parse(j);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

#define EXPECT_CONFIG_ERROR(j, phrase)                                          \
  do {                                                                          \
    const std::string msg_ = error_of(j);                                       \
    EXPECT_EQ(msg_.rfind("config.json: ", 0), 0u) << msg_;                      \
    EXPECT_NE(msg_.find(phrase), std::string::npos) << "got: " << msg_;         \
  } while (0)

}  // namespace

TEST(HfConfig, Llama31) {
  const HfModelConfig c = parse(llama31_8b());
  const ModelHparams& hp = c.hparams;
  EXPECT_EQ(hp.arch, "llama");
  EXPECT_EQ(hp.n_embd, 4096);
  EXPECT_EQ(hp.n_ff, 14336);
  EXPECT_EQ(hp.n_layer, 32);
  EXPECT_EQ(hp.n_head, 32);
  EXPECT_EQ(hp.n_head_kv, 8);
  EXPECT_EQ(hp.head_dim, 128);
  EXPECT_EQ(hp.rope_dim, 128);
  EXPECT_EQ(hp.n_vocab, 128256);
  EXPECT_EQ(hp.n_ctx_train, 131072);
  EXPECT_FLOAT_EQ(hp.rms_eps, 1e-5f);
  EXPECT_FLOAT_EQ(hp.rope_theta, 500000.0f);
  EXPECT_EQ(hp.rope_style, RopeStyle::RotateHalf);
  EXPECT_EQ(hp.rope_linear_scale, 1.0f);
  EXPECT_EQ(hp.sliding_window, 0);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_FALSE(c.qkv_bias);
  EXPECT_FALSE(c.o_bias);
  EXPECT_EQ(c.torch_dtype, "bfloat16");
  EXPECT_EQ(hp.name, "");
}

// Hand-computed with transformers' steps in float64: inv_freq = 500000^(-2i/128); wavelen =
// 2 pi / inv_freq; low/high wavelength bounds 8192 / 1 and 8192 / 4; pairs 0..28 have wavelen <
// 2048 (kept, divisor 1), 35..63 have wavelen > 8192 (divisor 8), 29..34 are smoothed with
// s = (8192 / wavelen - 1) / 3, divisor 1 / ((1 - s) / 8 + s). E.g. i = 30: wavelen = 2 pi x
// 500000^(30/64) = 2949.8, s = 0.59238, divisor 1 / (0.050952 + 0.59238) = 1.55341.
TEST(HfConfig, Llama3RopeScalingDivisors) {
  const HfModelConfig c = parse(llama31_8b());
  ASSERT_EQ(c.rope_freq_factors.size(), 64u);
  const std::pair<int, double> expected[] = {
      {0, 1.0},
      {28, 1.0},
      {29, 1.207483871283662},
      {30, 1.5534146285049255},
      {31, 2.0263132059050553},
      {32, 2.694529687894733},
      {33, 3.6842525277457185},
      {34, 5.257326588708467},
      {35, 8.0},
      {63, 8.0},
  };
  for (const auto& [i, want] : expected) EXPECT_NEAR(c.rope_freq_factors[i], want, want * 1e-6) << "pair " << i;
  for (int i = 1; i < 64; ++i) EXPECT_GE(c.rope_freq_factors[i], c.rope_freq_factors[i - 1]);  // monotone

  // Llama 3.2 1B: head_dim 64, factor 32: only pairs 15..17 are smoothed.
  json j = llama31_8b();
  j["hidden_size"] = 2048;
  j["num_attention_heads"] = 32;
  j["head_dim"] = 64;
  j["rope_scaling"]["factor"] = 32.0;
  const auto f = parse(j).rope_freq_factors;
  ASSERT_EQ(f.size(), 32u);
  EXPECT_EQ(f[14], 1.0f);
  EXPECT_NEAR(f[15], 1.6513292457638982, 1e-6);
  EXPECT_NEAR(f[16], 3.2922621029408843, 1e-6);
  EXPECT_NEAR(f[17], 9.66672897875329, 1e-5);
  EXPECT_EQ(f[18], 32.0f);
}

TEST(HfConfig, RopeScalingTypes) {
  json j = llama31_8b();
  j["rope_scaling"] = {{"type", "linear"}, {"factor", 4.0}};  // the older key name
  HfModelConfig c = parse(j);
  EXPECT_EQ(c.hparams.rope_linear_scale, 4.0f);
  EXPECT_TRUE(c.rope_freq_factors.empty());
  j["rope_scaling"] = nullptr;
  EXPECT_TRUE(parse(j).rope_freq_factors.empty());
  j["rope_scaling"] = {{"rope_type", "default"}};
  EXPECT_TRUE(parse(j).rope_freq_factors.empty());
  j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}};
  // YaRN's cos/sin attention factor mscale(4) = 1.139 (no mscale fields) is not applied.
  EXPECT_CONFIG_ERROR(j, "rope_scaling: a yarn attention factor of 1.138629 is not supported");
  j["rope_scaling"] = {{"rope_type", "dynamic"}, {"factor", 4.0}};
  EXPECT_CONFIG_ERROR(j, "rope_scaling: rope type 'dynamic' is not supported (supported: default, linear, llama3, yarn)");
  j["rope_scaling"] = {{"rope_type", "linear"}};
  EXPECT_CONFIG_ERROR(j, "rope_scaling: missing required field 'factor'");
  j["rope_scaling"] = {{"rope_type", "linear"}, {"factor", -2}};
  EXPECT_CONFIG_ERROR(j, "field 'factor' must be positive");
  j = llama31_8b();
  j["rope_scaling"].erase("low_freq_factor");
  EXPECT_CONFIG_ERROR(j, "missing required field 'low_freq_factor'");
  j = llama31_8b();
  j["rope_scaling"]["low_freq_factor"] = 4.0;
  EXPECT_CONFIG_ERROR(j, "low_freq_factor 4.000000 must be below high_freq_factor 4.000000");
  j["rope_scaling"] = "linear";
  EXPECT_CONFIG_ERROR(j, "field 'rope_scaling' must be an object or null");
}

TEST(HfConfig, Qwen2HasQkvBiasAndAnUnusedWindow) {
  const HfModelConfig c = parse(qwen25_05b());
  EXPECT_EQ(c.hparams.arch, "qwen2");
  EXPECT_EQ(c.hparams.head_dim, 64);
  EXPECT_EQ(c.hparams.n_head_kv, 2);
  EXPECT_TRUE(c.qkv_bias);
  EXPECT_FALSE(c.o_bias);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.hparams.sliding_window, 0);  // use_sliding_window false
  EXPECT_EQ(c.hparams.n_ctx_train, 32768);
  json j = qwen25_05b();
  j["use_sliding_window"] = true;  // windows only some layers (max_window_layers): the context is capped
  j["sliding_window"] = 4096;
  EXPECT_EQ(parse(j).hparams.sliding_window, 4096);
  EXPECT_EQ(parse(j).hparams.n_ctx_train, 4096);
}

TEST(HfConfig, LlamaAttentionBiasMeansAllFourProjections) {
  json j = llama31_8b();
  j["attention_bias"] = true;
  const HfModelConfig c = parse(j);
  EXPECT_TRUE(c.qkv_bias);
  EXPECT_TRUE(c.o_bias);
  j["attention_bias"] = "yes";
  EXPECT_CONFIG_ERROR(j, "field 'attention_bias' must be true or false");
  j["attention_bias"] = false;
  j["mlp_bias"] = true;
  EXPECT_CONFIG_ERROR(j, "mlp_bias true is not supported");
}

TEST(HfConfig, MistralSlidingWindowKeepsTheContext) {
  const HfModelConfig c = parse(mistral_7b_v01());
  EXPECT_EQ(c.hparams.arch, "mistral");
  EXPECT_EQ(c.hparams.sliding_window, 4096);
  EXPECT_EQ(c.hparams.n_ctx_train, 32768);
  EXPECT_NE(c.hparams.summary().find("context 32768, sliding window 4096"), std::string::npos);
  json j = mistral_7b_v01();
  j["sliding_window"] = nullptr;  // Mistral v0.2 and later
  EXPECT_EQ(parse(j).hparams.sliding_window, 0);
  EXPECT_EQ(parse(j).hparams.n_ctx_train, 32768);
  j["sliding_window"] = 65536;  // longer than the context: no effect
  EXPECT_EQ(parse(j).hparams.sliding_window, 0);
  j["sliding_window"] = 0;
  EXPECT_CONFIG_ERROR(j, "field 'sliding_window' must be in [1,");
}

// Mixtral-8x7B-v0.1's and Qwen1.5-MoE-A2.7B's config.json fields (as published on the Hub).
TEST(HfConfig, MixtureOfExpertsFields) {
  const json mixtral = {{"architectures", {"MixtralForCausalLM"}}, {"hidden_size", 4096}, {"intermediate_size", 14336},
                        {"num_hidden_layers", 32}, {"num_attention_heads", 32}, {"num_key_value_heads", 8},
                        {"num_local_experts", 8}, {"num_experts_per_tok", 2}, {"vocab_size", 32000},
                        {"max_position_embeddings", 32768}, {"rope_theta", 1e6}, {"sliding_window", nullptr}};
  const HfModelConfig m = parse(mixtral);
  EXPECT_EQ(m.hparams.arch, "mixtral");
  EXPECT_EQ(m.hparams.moe.routing.n_expert, 8);
  EXPECT_EQ(m.hparams.moe.routing.n_expert_used, 2);
  EXPECT_TRUE(m.hparams.moe.routing.norm_topk);
  EXPECT_EQ(m.hparams.moe.n_ff_expert, 14336);
  EXPECT_EQ(m.hparams.moe.n_ff_shared, 0);
  EXPECT_TRUE(m.hparams.moe.is_moe_layer(0) && m.hparams.moe.is_moe_layer(31));
  EXPECT_NE(m.hparams.summary().find("MoE 8 experts top-2 (FFN 14336)"), std::string::npos) << m.hparams.summary();
  json bad = mixtral;
  bad["num_experts_per_tok"] = 9;
  EXPECT_CONFIG_ERROR(bad, "num_experts_per_tok 9 exceeds the 8 experts");

  const json qwen = {{"architectures", {"Qwen2MoeForCausalLM"}}, {"hidden_size", 2048}, {"intermediate_size", 5632},
                     {"moe_intermediate_size", 1408}, {"shared_expert_intermediate_size", 5632},
                     {"num_experts", 60}, {"num_experts_per_tok", 4}, {"num_hidden_layers", 24},
                     {"num_attention_heads", 16}, {"num_key_value_heads", 16}, {"vocab_size", 151936},
                     {"norm_topk_prob", false}, {"decoder_sparse_step", 1}, {"mlp_only_layers", json::array()},
                     {"use_sliding_window", false}, {"sliding_window", 32768}};
  const HfModelConfig q = parse(qwen);
  EXPECT_EQ(q.hparams.arch, "qwen2moe");
  EXPECT_TRUE(q.qkv_bias);
  EXPECT_EQ(q.hparams.rope_style, RopeStyle::RotateHalf);
  EXPECT_EQ(q.hparams.moe.routing.n_expert, 60);
  EXPECT_FALSE(q.hparams.moe.routing.norm_topk);
  EXPECT_EQ(q.hparams.moe.n_ff_expert, 1408);
  EXPECT_EQ(q.hparams.moe.n_ff_shared, 5632);
  EXPECT_TRUE(q.hparams.moe.shared_gate);
  json step = qwen;
  step["decoder_sparse_step"] = 2;  // layers 1, 3, ... are MoE
  step["mlp_only_layers"] = {3};
  const MoeHparams s = parse(step).hparams.moe;
  EXPECT_FALSE(s.is_moe_layer(0));
  EXPECT_TRUE(s.is_moe_layer(1));
  EXPECT_FALSE(s.is_moe_layer(3));
  EXPECT_TRUE(s.is_moe_layer(5));
  step["mlp_only_layers"] = {24};
  EXPECT_CONFIG_ERROR(step, "field 'mlp_only_layers' holds 24, not a layer index in [0, 24)");
  step["mlp_only_layers"] = "none";
  EXPECT_CONFIG_ERROR(step, "field 'mlp_only_layers' must be an array");
}

// DeepSeek-V2-Lite's config.json fields (as published on the Hub).
TEST(HfConfig, DeepseekV2LiteMlaMoeAndYarn) {
  const json j = {{"architectures", {"DeepseekV2ForCausalLM"}}, {"hidden_size", 2048}, {"intermediate_size", 10944},
                  {"num_hidden_layers", 27}, {"num_attention_heads", 16}, {"num_key_value_heads", 16},
                  {"vocab_size", 102400}, {"max_position_embeddings", 163840}, {"kv_lora_rank", 512},
                  {"q_lora_rank", nullptr}, {"qk_nope_head_dim", 128}, {"qk_rope_head_dim", 64},
                  {"v_head_dim", 128}, {"n_routed_experts", 64}, {"num_experts_per_tok", 6},
                  {"moe_intermediate_size", 1408}, {"n_shared_experts", 2}, {"first_k_dense_replace", 1},
                  {"moe_layer_freq", 1}, {"routed_scaling_factor", 1.0}, {"topk_method", "greedy"},
                  {"n_group", 1}, {"topk_group", 1}, {"norm_topk_prob", false}, {"scoring_func", "softmax"},
                  {"rms_norm_eps", 1e-6}, {"rope_theta", 10000},
                  {"rope_scaling", {{"type", "yarn"}, {"factor", 40}, {"original_max_position_embeddings", 4096},
                                    {"beta_fast", 32}, {"beta_slow", 1}, {"mscale", 0.707},
                                    {"mscale_all_dim", 0.707}}}};
  const HfModelConfig c = parse(j);
  const ModelHparams& hp = c.hparams;
  EXPECT_EQ(hp.arch, "deepseek2");
  EXPECT_EQ(hp.head_dim, 192);
  EXPECT_EQ(hp.rope_dim, 64);
  EXPECT_EQ(hp.rope_style, RopeStyle::AdjacentPairs);
  EXPECT_EQ(hp.mla.q_lora_rank, 0);
  EXPECT_EQ(hp.mla.kv_lora_rank, 512);
  EXPECT_EQ(hp.attn_out_dim(), 16 * 128);
  EXPECT_EQ(hp.moe.n_ff_shared, 2 * 1408);
  EXPECT_FALSE(hp.moe.is_moe_layer(0));
  EXPECT_TRUE(hp.moe.is_moe_layer(26));
  // 192^-0.5 x (0.1 x 0.707 x ln 40 + 1)^2
  EXPECT_NEAR(hp.softmax_scale(), 0.1147213868, 1e-7);
  ASSERT_EQ(c.rope_freq_factors.size(), 32u);
  EXPECT_FLOAT_EQ(c.rope_freq_factors.front(), 1.0f);  // high frequencies kept
  EXPECT_FLOAT_EQ(c.rope_freq_factors.back(), 40.0f);  // low frequencies interpolated by the factor
  EXPECT_NE(hp.summary().find("MLA latent 512 + rope 64"), std::string::npos) << hp.summary();
  json bad = j;
  bad["topk_method"] = "noaux_tc";
  EXPECT_CONFIG_ERROR(bad, "topk_method 'noaux_tc' is not supported (supported: greedy, group_limited_greedy)");
  bad = j;
  bad["moe_layer_freq"] = 2;
  EXPECT_CONFIG_ERROR(bad, "moe_layer_freq other than 1 is not supported");
  bad = j;
  bad["topk_method"] = "group_limited_greedy";
  bad["n_group"] = 8;
  bad["topk_group"] = 3;
  EXPECT_EQ(parse(bad).hparams.moe.routing.select, MoeRouting::Select::GroupLimited);
  bad["n_group"] = 7;  // does not divide 64 experts
  EXPECT_CONFIG_ERROR(bad, "expert groups: n_group 7");
}

// transformers' YaRN inverse frequencies for rope_dim 8, theta 1e4, factor 32 over 128 positions
// (deepseek-v2-tiny's reference.json notes.yarn.inv_freq), as divisors of theta^(-2i/8).
TEST(HfConfig, YarnFrequencies) {
  const std::vector<float> f = yarn_rope_freq_factors(8, 10000.0, 32.0, 128.0, 32.0, 1.0, true);
  const double want_inv[] = {1.0, 0.05156249925494194, 0.0003124999930150807, 3.125000148429535e-05};
  ASSERT_EQ(f.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    const double base = std::pow(10000.0, -2.0 * static_cast<double>(i) / 8.0);
    EXPECT_NEAR(base / f[i], want_inv[i], want_inv[i] * 1e-7) << i;
  }
}

TEST(HfConfig, Defaults) {
  const json j = {{"architectures", {"LlamaForCausalLM"}}, {"hidden_size", 64},   {"intermediate_size", 128},
                  {"num_hidden_layers", 2},                {"num_attention_heads", 4}, {"vocab_size", 100}};
  const HfModelConfig c = parse(j);
  EXPECT_EQ(c.hparams.n_head_kv, 4);
  EXPECT_EQ(c.hparams.head_dim, 16);
  EXPECT_FLOAT_EQ(c.hparams.rms_eps, 1e-6f);
  EXPECT_EQ(c.hparams.rope_theta, 10000.0f);
  EXPECT_EQ(c.hparams.n_ctx_train, 2048);
  EXPECT_FALSE(c.tie_word_embeddings);
  json m = j;
  m["architectures"] = {"MistralForCausalLM"};
  EXPECT_EQ(parse(m).hparams.n_ctx_train, 131072);
  m["architectures"] = {"Qwen2ForCausalLM"};
  EXPECT_EQ(parse(m).hparams.n_ctx_train, 32768);
  json t = j;  // model_type when architectures is absent
  t.erase("architectures");
  t["model_type"] = "qwen2";
  EXPECT_EQ(parse(t).hparams.arch, "qwen2");
  json h = j;
  h["head_dim"] = 32;  // head_dim need not be hidden / heads
  EXPECT_EQ(parse(h).hparams.q_dim(), 128);
}

TEST(HfConfig, MissingAndBadFields) {
  const json base = kestrel::test::llama2_7b_config();
  for (const char* field :
       {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"}) {
    json j = base;
    j.erase(field);
    EXPECT_CONFIG_ERROR(j, std::string("missing required field '") + field + "'");
  }
  json j = base;
  j["hidden_size"] = "4096";
  EXPECT_CONFIG_ERROR(j, "field 'hidden_size' must be an integer, got \"4096\"");
  j = base;
  j["num_attention_heads"] = 0;
  EXPECT_CONFIG_ERROR(j, "field 'num_attention_heads' must be in [1,");
  j = base;
  j["num_key_value_heads"] = 5;
  EXPECT_CONFIG_ERROR(j, "num_key_value_heads 5 does not divide num_attention_heads 32");
  j = base;
  j["num_attention_heads"] = 30;
  j["num_key_value_heads"] = 30;
  EXPECT_CONFIG_ERROR(j, "hidden_size 4096 is not a multiple of num_attention_heads 30");
  j = base;
  j["head_dim"] = 7;
  EXPECT_CONFIG_ERROR(j, "head dimension 7 is odd");
  j = base;
  j["rms_norm_eps"] = "small";
  EXPECT_CONFIG_ERROR(j, "field 'rms_norm_eps' must be a finite number");
  j = base;
  j["rms_norm_eps"] = 0;
  EXPECT_CONFIG_ERROR(j, "field 'rms_norm_eps' must be positive");
  j = base;
  j["rope_theta"] = -1;
  EXPECT_CONFIG_ERROR(j, "field 'rope_theta' must be positive");
  j = base;
  j["hidden_act"] = "gelu";
  EXPECT_CONFIG_ERROR(j, "hidden_act 'gelu' is not supported (only silu)");
  j = base;
  j["tie_word_embeddings"] = 1;
  EXPECT_CONFIG_ERROR(j, "field 'tie_word_embeddings' must be true or false");
  j = base;
  j["architectures"] = {"GPT2LMHeadModel"};
  EXPECT_CONFIG_ERROR(j, "unsupported architectures 'GPT2LMHeadModel' (supported: LlamaForCausalLM, MistralForCausalLM, "
                         "Qwen2ForCausalLM, MixtralForCausalLM, Qwen2MoeForCausalLM, DeepseekV2ForCausalLM, Gemma3ForCausalLM)");
  j["architectures"] = json::array();
  EXPECT_CONFIG_ERROR(j, "field 'architectures' must be a non-empty array of strings");
  j.erase("architectures");
  j["model_type"] = "gemma";
  EXPECT_CONFIG_ERROR(j, "unsupported model_type 'gemma'");
  j.erase("model_type");
  EXPECT_CONFIG_ERROR(j, "missing field 'architectures' (and 'model_type')");
  EXPECT_CONFIG_ERROR(json::array(), "expected a JSON object");
}

TEST(HfConfig, FromFile) {
  kestrel::test::TempDir dir;
  const std::string path = dir.write_config(llama31_8b());
  EXPECT_EQ(HfModelConfig::from_file(path).hparams.n_layer, 32);
  const std::string bad = dir.write("bad.json", "{");
  try {
    HfModelConfig::from_file(bad);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(bad + ": invalid JSON"), std::string::npos) << e.what();
  }
}

// transformers 5 writes rope_theta and the scaling inside one "rope_parameters" object (seen on the
// device machine's transformers 5.17: a saved Llama-3.1-shaped config had no top-level rope_theta).
TEST(HfConfig, Transformers5RopeParameters) {
  json j = llama31_8b();
  const json scaling = j["rope_scaling"];
  j.erase("rope_theta");
  j.erase("rope_scaling");
  j["rope_parameters"] = scaling;
  j["rope_parameters"]["rope_theta"] = 500000.0;
  const HfModelConfig c = parse(j);
  EXPECT_FLOAT_EQ(c.hparams.rope_theta, 500000.0f);
  EXPECT_EQ(c.rope_freq_factors, parse(llama31_8b()).rope_freq_factors);
  EXPECT_FALSE(c.rope_freq_factors.empty());
  json plain = llama31_8b();
  plain.erase("rope_theta");
  plain.erase("rope_scaling");
  plain["rope_parameters"] = {{"rope_theta", 250000.0}, {"rope_type", "default"}};
  const HfModelConfig d = parse(plain);
  EXPECT_FLOAT_EQ(d.hparams.rope_theta, 250000.0f);
  EXPECT_TRUE(d.rope_freq_factors.empty());
}
