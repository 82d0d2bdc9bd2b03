// LlamaModel::load_hf_dir on tiny random HF folders written here: weights viewed in place in each
// dtype, tied and untied outputs, the chat template sources, one named error per bad tensor, and
// forward passes that must match an equivalent model: a Qwen2 folder against the same tensors in a
// GGUF "qwen2" file (same RoPE pairing, so bit-identical logits), and a Llama o_proj bias against
// the v_proj bias it is equivalent to (attention weights sum to 1, so o(v + b) = o(v) + W_o b).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "test_util.h"
#include "engine/engine.h"
#include "gguf_builder.h"
#include "hf_configs.h"
#include "model/llama_weights.h"
#include "safetensors_builder.h"

using namespace kestrel;
using kestrel::test::bytes_of;
using kestrel::test::error_of;
using kestrel::test::SafetensorsBuilder;
using kestrel::test::TempDir;
using json = nlohmann::json;

namespace {

// A tiny Llama-family model: its config and its tensors by HF name ([out, in] shapes).
struct TinyModel {
  json config = {{"architectures", {"LlamaForCausalLM"}},
                 {"hidden_size", 16},
                 {"intermediate_size", 24},
                 {"num_hidden_layers", 2},
                 {"num_attention_heads", 4},
                 {"num_key_value_heads", 2},
                 {"max_position_embeddings", 64},
                 {"rms_norm_eps", 1e-6},
                 {"vocab_size", 40},
                 {"tie_word_embeddings", true}};
  struct Tensor {
    std::vector<int64_t> shape;
    std::vector<float> values;
  };
  std::map<std::string, Tensor> tensors;
  std::string dtype = "F32";

  explicit TinyModel(uint32_t seed = 1, bool qkv_bias = false, bool o_bias = false) {
    std::mt19937 rng(seed);
    auto add = [&](const std::string& name, std::vector<int64_t> shape, float scale, float offset = 0) {
      int64_t n = 1;
      for (int64_t d : shape) n *= d;
      std::uniform_real_distribution<float> u(-scale, scale);
      Tensor t{std::move(shape), std::vector<float>(static_cast<size_t>(n))};
      for (float& v : t.values) v = offset + u(rng);
      tensors[name] = std::move(t);
    };
    add("model.embed_tokens.weight", {40, 16}, 1.0f);
    add("model.norm.weight", {16}, 0.2f, 1.0f);
    for (int l = 0; l < 2; ++l) {
      const std::string p = "model.layers." + std::to_string(l) + ".";
      add(p + "input_layernorm.weight", {16}, 0.2f, 1.0f);
      add(p + "post_attention_layernorm.weight", {16}, 0.2f, 1.0f);
      add(p + "self_attn.q_proj.weight", {16, 16}, 0.4f);
      add(p + "self_attn.k_proj.weight", {8, 16}, 0.4f);
      add(p + "self_attn.v_proj.weight", {8, 16}, 0.4f);
      add(p + "self_attn.o_proj.weight", {16, 16}, 0.4f);
      add(p + "mlp.gate_proj.weight", {24, 16}, 0.4f);
      add(p + "mlp.up_proj.weight", {24, 16}, 0.4f);
      add(p + "mlp.down_proj.weight", {16, 24}, 0.4f);
      if (qkv_bias) {
        add(p + "self_attn.q_proj.bias", {16}, 0.3f);
        add(p + "self_attn.k_proj.bias", {8}, 0.3f);
        add(p + "self_attn.v_proj.bias", {8}, 0.3f);
      }
      if (o_bias) add(p + "self_attn.o_proj.bias", {16}, 0.3f);
    }
  }

  SafetensorsBuilder builder() const {
    SafetensorsBuilder b;
    for (const auto& [name, t] : tensors) {
      if (dtype == "F32")
        b.f32(name, t.shape, t.values);
      else
        b.half(name, dtype, t.shape, t.values);
    }
    return b;
  }

  // Writes config.json and model.safetensors into dir; returns dir.
  std::string write(const TempDir& dir) const {
    dir.write_config(config);
    const auto img = builder().build();
    dir.write("model.safetensors", bytes_of(img));
    return dir.path();
  }
};

std::string load_error(const TinyModel& m) {
  TempDir dir;
  m.write(dir);
  return error_of([&] { LlamaModel::load_hf_dir(dir.path()); });
}

float f32_at(const WeightView& w, int64_t row, int64_t col) {
  float v;
  std::memcpy(&v, w.row(row) + 4 * col, 4);
  return v;
}

std::vector<float> logits(const LlamaModel& m, const std::vector<int32_t>& ids) {
  EngineConfig c;
  c.kv_dtype = KvDtype::F32;
  c.n_threads = 2;
  return test::prompt_logits(m, ids, c);
}

const std::vector<int32_t> kIds = {1, 7, 22, 39, 3, 3, 15, 0, 28, 11};

}  // namespace

TEST(HfLoader, ViewsF32WeightsInPlace) {
  TempDir dir;
  const TinyModel tm;
  tm.write(dir);
  const auto m = LlamaModel::load_hf_dir(dir.path());
  EXPECT_EQ(m->format(), ModelFormat::HfFolder);
  EXPECT_EQ(m->path(), dir.path());
  EXPECT_EQ(m->hparams().name, std::filesystem::path(dir.path()).filename().string());
  EXPECT_EQ(m->hparams().arch, "llama");
  EXPECT_EQ(m->hparams().rope_style, RopeStyle::RotateHalf);
  EXPECT_EQ(m->chat_template(), "");
  const ModelWeights& w = m->weights();
  EXPECT_TRUE(w.tied_output);
  EXPECT_EQ(w.at({-1, WeightRole::Output}).matrix.data, w.at({-1, WeightRole::TokenEmbd}).matrix.data);
  ASSERT_EQ(w.n_layer(), 2);
  const WeightView& wk = w.at({1, WeightRole::K}).matrix;
  EXPECT_EQ(wk.type, GgmlType::F32);
  EXPECT_EQ(wk.n_in, 16);
  EXPECT_EQ(wk.n_out, 8);
  EXPECT_EQ(w.at({1, WeightRole::Down}).matrix.n_in, 24);
  EXPECT_EQ(w.at({1, WeightRole::Down}).matrix.n_out, 16);
  // Row r of the view is row r of the [out, in] tensor.
  const auto& k = tm.tensors.at("model.layers.1.self_attn.k_proj.weight").values;
  EXPECT_EQ(f32_at(wk, 5, 3), k[5 * 16 + 3]);
  EXPECT_EQ(w.at({1, WeightRole::FfnNorm}).vector, tm.tensors.at("model.layers.1.post_attention_layernorm.weight").values);
  EXPECT_TRUE(w.at({1, WeightRole::Q}).bias.empty());
  EXPECT_TRUE(w.at({1, WeightRole::AttnOut}).bias.empty());
  EXPECT_EQ(w.find({1, WeightRole::Qkv}), nullptr);  // a group is not stored
  EXPECT_NE(error_of([&] { w.at({2, WeightRole::Q}); }).find("no 'q' tensor in layer 2"), std::string::npos);
  EXPECT_TRUE(w.rope_freq_factors.empty());
  uint64_t bytes = 0;
  for (const auto& [name, t] : tm.tensors) bytes += 4 * t.values.size();
  EXPECT_EQ(m->weight_bytes(), bytes);
  EXPECT_NE(error_of([&] { m->file(); }).find("has no GGUF metadata"), std::string::npos);
  // LlamaModel::load picks the loader from the path.
  EXPECT_EQ(LlamaModel::load(dir.path())->format(), ModelFormat::HfFolder);
  EXPECT_NE(error_of([&] { LlamaModel::load(dir.path() + "/model.safetensors"); }).find("pass the folder"),
            std::string::npos);
}

TEST(HfLoader, HalfPrecisionDtypesStayInTheirType) {
  for (const char* dtype : {"F16", "BF16"}) {
    SCOPED_TRACE(dtype);
    TempDir dir;
    TinyModel tm;
    tm.dtype = dtype;
    tm.write(dir);
    const auto m = LlamaModel::load_hf_dir(dir.path());
    const GgmlType want = std::string(dtype) == "F16" ? GgmlType::F16 : GgmlType::BF16;
    EXPECT_EQ(m->weights().at({-1, WeightRole::TokenEmbd}).matrix.type, want);
    EXPECT_EQ(m->weights().at({0, WeightRole::Q}).matrix.type, want);
    const float norm0 = tm.tensors.at("model.norm.weight").values[0];
    const float rounded = want == GgmlType::F16 ? fp16_to_fp32(fp32_to_fp16(norm0)) : bf16_to_fp32(fp32_to_bf16(norm0));
    EXPECT_EQ(m->weights().at({-1, WeightRole::OutputNorm}).vector[0], rounded);  // converted to f32 exactly
    const auto out = logits(*m, kIds);
    for (float v : out) ASSERT_TRUE(std::isfinite(v));
  }
}

TEST(HfLoader, UntiedOutputNeedsLmHead) {
  TinyModel tm;
  tm.config["tie_word_embeddings"] = false;
  tm.tensors["lm_head.weight"] = {{40, 16}, std::vector<float>(640, 0.25f)};
  TempDir dir;
  tm.write(dir);
  const auto m = LlamaModel::load_hf_dir(dir.path());
  EXPECT_FALSE(m->weights().tied_output);
  const WeightView& head = m->weights().at({-1, WeightRole::Output}).matrix;
  EXPECT_NE(head.data, m->weights().at({-1, WeightRole::TokenEmbd}).matrix.data);
  EXPECT_EQ(f32_at(head, 39, 15), 0.25f);

  tm.tensors.erase("lm_head.weight");
  EXPECT_NE(load_error(tm).find("missing tensor 'lm_head.weight' (config.json has tie_word_embeddings false)"),
            std::string::npos);
  // Tied: a stored lm_head.weight is ignored, as transformers does.
  tm.config["tie_word_embeddings"] = true;
  tm.tensors["lm_head.weight"] = {{40, 16}, std::vector<float>(640, 0.25f)};
  EXPECT_EQ(load_error(tm), "");
}

TEST(HfLoader, TensorErrorsNameTheTensor) {
  TinyModel tm;
  tm.tensors.erase("model.layers.1.mlp.up_proj.weight");
  std::string e = load_error(tm);
  EXPECT_NE(e.find(": missing tensor 'model.layers.1.mlp.up_proj.weight'"), std::string::npos) << e;

  tm = TinyModel();
  tm.tensors["model.layers.0.self_attn.k_proj.weight"].shape = {16, 8};  // transposed
  e = load_error(tm);
  EXPECT_NE(e.find("model.safetensors: tensor 'model.layers.0.self_attn.k_proj.weight' has shape [16, 8], "
                   "expected [8, 16]"),
            std::string::npos)
      << e;

  tm = TinyModel();
  tm.tensors["model.norm.weight"].shape = {1, 16};
  e = load_error(tm);
  EXPECT_NE(e.find("tensor 'model.norm.weight' has shape [1, 16], expected [16]"), std::string::npos) << e;

  tm = TinyModel();
  tm.tensors["model.layers.0.self_attn.v_proj.bias"] = {{8}, std::vector<float>(8, 1.0f)};
  e = load_error(tm);
  EXPECT_NE(e.find("tensor 'model.layers.0.self_attn.v_proj.bias' is not part of a llama model"), std::string::npos)
      << e;

  tm = TinyModel();
  tm.config["attention_bias"] = true;  // announced but absent
  e = load_error(tm);
  EXPECT_NE(e.find("missing tensor 'model.layers.0.self_attn.q_proj.bias'"), std::string::npos) << e;
}

TEST(HfLoader, UnsupportedDtypeAndMisalignedData) {
  TempDir dir;
  const TinyModel tm;
  dir.write_config(tm.config);
  nlohmann::ordered_json h = tm.builder().header();
  std::vector<uint8_t> data = tm.builder().data();
  h["model.layers.0.self_attn.q_proj.weight"]["dtype"] = "I32";
  auto img = SafetensorsBuilder::image(h.dump() + std::string((8 - h.dump().size() % 8) % 8, ' '), data);
  dir.write("model.safetensors", bytes_of(img));
  std::string e = error_of([&] { LlamaModel::load_hf_dir(dir.path()); });
  EXPECT_NE(e.find("tensor 'model.layers.0.self_attn.q_proj.weight' has dtype I32, expected F32, F16 or BF16"),
            std::string::npos)
      << e;

  // A header length that is not a multiple of 4 leaves the F32 data misaligned.
  h = tm.builder().header();
  std::string text = h.dump();
  text.append((8 - text.size() % 8) % 8 + 1, ' ');
  img = SafetensorsBuilder::image(text, data);
  dir.write("model.safetensors", bytes_of(img));
  e = error_of([&] { LlamaModel::load_hf_dir(dir.path()); });
  EXPECT_NE(e.find("is not aligned to its 4-byte elements"), std::string::npos) << e;
}

TEST(HfLoader, MissingConfigOrWeights) {
  TempDir dir;
  std::string e = error_of([&] { LlamaModel::load_hf_dir(dir.path()); });
  EXPECT_NE(e.find("config.json: cannot open"), std::string::npos) << e;
  dir.write_config(TinyModel().config);
  e = error_of([&] { LlamaModel::load_hf_dir(dir.path()); });
  EXPECT_NE(e.find("no model.safetensors or model.safetensors.index.json"), std::string::npos) << e;
}

TEST(HfLoader, RopeScalingReachesTheWeights) {
  TinyModel tm;
  tm.config["rope_scaling"] = {{"rope_type", "llama3"},
                               {"factor", 8.0},
                               {"low_freq_factor", 1.0},
                               {"high_freq_factor", 4.0},
                               {"original_max_position_embeddings", 32}};
  TempDir dir;
  tm.write(dir);
  const auto m = LlamaModel::load_hf_dir(dir.path());
  const auto& f = m->weights().rope_freq_factors;
  ASSERT_EQ(f.size(), 2u);  // head_dim 4: two pairs
  // theta 10000, d = 4: wavelen 2 pi (kept: < 32 / 4) and 2 pi x 100 = 628 (> 32 / 1: divided by 8).
  EXPECT_EQ(f[0], 1.0f);
  EXPECT_EQ(f[1], 8.0f);
}

TEST(HfLoader, ChatTemplateSources) {
  TempDir dir;
  TinyModel().write(dir);
  dir.write("chat_template.jinja", "{{ jinja file }}");
  EXPECT_EQ(LlamaModel::load_hf_dir(dir.path())->chat_template(), "{{ jinja file }}");
  dir.write("tokenizer_config.json", json{{"chat_template", "<|im_start|>{{ x }}"}}.dump());
  EXPECT_EQ(LlamaModel::load_hf_dir(dir.path())->chat_template(), "<|im_start|>{{ x }}");
  dir.write("tokenizer_config.json",
            json{{"chat_template", json::array({json{{"name", "tool_use"}, {"template", "T"}},
                                                json{{"name", "default"}, {"template", "D"}}})}}
                .dump());
  EXPECT_EQ(LlamaModel::load_hf_dir(dir.path())->chat_template(), "D");
  dir.write("tokenizer_config.json", json{{"chat_template", 3}}.dump());
  const std::string e = error_of([&] { LlamaModel::load_hf_dir(dir.path()); });
  EXPECT_NE(e.find("tokenizer_config.json: field 'chat_template' must be a string or a list"), std::string::npos) << e;
}

// The window is applied by attention (HfTiny.MistralSlidingWindowMatchesTransformers), not by a
// shorter context.
TEST(HfLoader, MistralWindowKeepsTheEngineContext) {
  TinyModel tm;
  tm.config["architectures"] = {"MistralForCausalLM"};
  tm.config["sliding_window"] = 32;
  TempDir dir;
  tm.write(dir);
  const auto m = LlamaModel::load_hf_dir(dir.path());
  EXPECT_EQ(m->hparams().sliding_window, 32);
  EXPECT_EQ(m->hparams().n_ctx_train, 64);
  Engine e(*m, nullptr, EngineConfig{});
  EXPECT_EQ(e.config().max_model_len, 64);
}

// The same tensors as an HF Qwen2 folder and as a GGUF "qwen2" file (llama.cpp stores Qwen2 q/k
// unpermuted and rotates halves, as HF does), so the two loaders must give bit-identical logits.
TEST(HfLoader, Qwen2FolderMatchesTheSameTensorsInGguf) {
  TinyModel tm(7, /*qkv_bias=*/true);
  tm.config["architectures"] = {"Qwen2ForCausalLM"};
  tm.config["tie_word_embeddings"] = false;
  tm.config["rope_theta"] = 1000000.0;
  tm.tensors["lm_head.weight"] = tm.tensors.at("model.embed_tokens.weight");
  for (float& v : tm.tensors["lm_head.weight"].values) v *= -0.5f;
  TempDir dir;
  tm.write(dir);
  const auto hf = LlamaModel::load_hf_dir(dir.path());

  using B = kestrel::test::GgufBuilder;
  B g;
  g.kv("general.architecture", B::str("qwen2"))
      .kv("qwen2.embedding_length", B::u32(16))
      .kv("qwen2.feed_forward_length", B::u32(24))
      .kv("qwen2.block_count", B::u32(2))
      .kv("qwen2.attention.head_count", B::u32(4))
      .kv("qwen2.attention.head_count_kv", B::u32(2))
      .kv("qwen2.context_length", B::u32(64))
      .kv("qwen2.vocab_size", B::u32(40))
      .kv("qwen2.rope.freq_base", B::f32(1000000.0f))
      .kv("qwen2.attention.layer_norm_rms_epsilon", B::f32(1e-6f));
  auto put = [&](const std::string& gguf_name, const std::string& hf_name) {
    const auto& t = tm.tensors.at(hf_name);
    std::vector<int64_t> ne(t.shape.rbegin(), t.shape.rend());  // GGUF lists the row length first
    g.tensor(gguf_name, ne, GgmlType::F32, kestrel::test::f32_bytes(t.values));
  };
  put("token_embd.weight", "model.embed_tokens.weight");
  put("output.weight", "lm_head.weight");
  put("output_norm.weight", "model.norm.weight");
  for (int l = 0; l < 2; ++l) {
    const std::string b = "blk." + std::to_string(l) + ".", p = "model.layers." + std::to_string(l) + ".";
    put(b + "attn_norm.weight", p + "input_layernorm.weight");
    put(b + "ffn_norm.weight", p + "post_attention_layernorm.weight");
    put(b + "attn_q.weight", p + "self_attn.q_proj.weight");
    put(b + "attn_k.weight", p + "self_attn.k_proj.weight");
    put(b + "attn_v.weight", p + "self_attn.v_proj.weight");
    put(b + "attn_q.bias", p + "self_attn.q_proj.bias");
    put(b + "attn_k.bias", p + "self_attn.k_proj.bias");
    put(b + "attn_v.bias", p + "self_attn.v_proj.bias");
    put(b + "attn_output.weight", p + "self_attn.o_proj.weight");
    put(b + "ffn_gate.weight", p + "mlp.gate_proj.weight");
    put(b + "ffn_up.weight", p + "mlp.up_proj.weight");
    put(b + "ffn_down.weight", p + "mlp.down_proj.weight");
  }
  const auto img = g.build();
  const std::string gguf_path = dir.write("same.gguf", bytes_of(img));
  const auto gguf = LlamaModel::load_gguf(gguf_path);
  ASSERT_EQ(gguf->hparams().rope_style, RopeStyle::RotateHalf);
  EXPECT_FALSE(hf->weights().at({0, WeightRole::Q}).bias.empty());

  const auto a = logits(*hf, kIds);
  const auto b = logits(*gguf, kIds);
  ASSERT_EQ(a.size(), kIds.size() * 40);
  EXPECT_EQ(a, b);
}

// HF Llama with attention_bias: an o_proj bias W_o r gives the same output as a v_proj bias r.
TEST(HfLoader, LlamaOutputBiasEqualsTheValueBiasItRepresents) {
  TinyModel with_v(11, /*qkv_bias=*/true, /*o_bias=*/true);
  with_v.config["attention_bias"] = true;
  TinyModel with_o = with_v;
  for (int l = 0; l < 2; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".self_attn.";
    for (const char* zero : {"q_proj.bias", "k_proj.bias"}) {
      std::fill(with_v.tensors[p + zero].values.begin(), with_v.tensors[p + zero].values.end(), 0.0f);
      std::fill(with_o.tensors[p + zero].values.begin(), with_o.tensors[p + zero].values.end(), 0.0f);
    }
    std::fill(with_v.tensors[p + "o_proj.bias"].values.begin(), with_v.tensors[p + "o_proj.bias"].values.end(), 0.0f);
    // r per KV head, repeated for the query heads that share it: o gets W_o [r_kv(h / group)].
    const auto& r = with_v.tensors[p + "v_proj.bias"].values;  // [8] = 2 KV heads x 4
    const auto& wo = with_o.tensors[p + "o_proj.weight"].values;  // [16, 16]
    auto& bo = with_o.tensors[p + "o_proj.bias"].values;
    for (int i = 0; i < 16; ++i) {
      double s = 0;
      for (int j = 0; j < 16; ++j) s += static_cast<double>(wo[i * 16 + j]) * r[(j / 4) / 2 * 4 + j % 4];
      bo[i] = static_cast<float>(s);
    }
    std::fill(with_o.tensors[p + "v_proj.bias"].values.begin(), with_o.tensors[p + "v_proj.bias"].values.end(), 0.0f);
  }
  TempDir d1, d2;
  with_v.write(d1);
  with_o.write(d2);
  const auto a = logits(*LlamaModel::load_hf_dir(d1.path()), kIds);
  const auto b = logits(*LlamaModel::load_hf_dir(d2.path()), kIds);
  ASSERT_EQ(a.size(), b.size());
  float max_abs = 0, max_diff = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    max_abs = std::max(max_abs, std::fabs(a[i]));
    max_diff = std::max(max_diff, std::fabs(a[i] - b[i]));
  }
  EXPECT_LT(max_diff, 1e-5f * max_abs) << "max |diff| " << max_diff << " of max |logit| " << max_abs;
  EXPECT_GT(max_abs, 0.1f);
}
