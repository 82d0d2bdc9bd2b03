// A tiny random Gemma3ForCausalLM folder (6 layers of width 32, 2 query heads and 1 KV head of
// 16, window 4 in the five local layers, the sixth global; transformers' names and config fields,
// norm weights stored as w meaning 1 + w), written by tests that check Gemma 3 paths against each
// other: its GGUF twin (tests/unit/test_gemma3.cpp) and the CUDA backend against the CPU one.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "hf_configs.h"
#include "safetensors_builder.h"
#include "test_util.h"

namespace kestrel::test::gemma3_tiny {

using json = nlohmann::json;

constexpr int kLayers = 6, kEmbd = 32, kHeads = 2, kHeadDim = 16, kFf = 48, kVocab = 50, kWindow = 4;

struct Tensor {
  std::vector<int64_t> shape;  // HF order [out, in]
  std::vector<float> values;
};

inline std::map<std::string, Tensor> random_tensors() {
  std::mt19937 rng(3);
  std::map<std::string, Tensor> t;
  auto add = [&](const std::string& name, std::vector<int64_t> shape, float scale) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    std::uniform_real_distribution<float> u(-scale, scale);
    Tensor x{std::move(shape), std::vector<float>(static_cast<size_t>(n))};
    for (float& v : x.values) v = u(rng);
    t[name] = std::move(x);
  };
  add("model.embed_tokens.weight", {kVocab, kEmbd}, 0.3f);
  add("model.norm.weight", {kEmbd}, 0.3f);
  for (int l = 0; l < kLayers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    for (const char* n : {"input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                          "post_feedforward_layernorm"})
      add(p + n + ".weight", {kEmbd}, 0.3f);
    add(p + "self_attn.q_norm.weight", {kHeadDim}, 0.3f);
    add(p + "self_attn.k_norm.weight", {kHeadDim}, 0.3f);
    add(p + "self_attn.q_proj.weight", {kHeads * kHeadDim, kEmbd}, 0.3f);
    add(p + "self_attn.k_proj.weight", {kHeadDim, kEmbd}, 0.3f);
    add(p + "self_attn.v_proj.weight", {kHeadDim, kEmbd}, 0.3f);
    add(p + "self_attn.o_proj.weight", {kEmbd, kHeads * kHeadDim}, 0.3f);
    add(p + "mlp.gate_proj.weight", {kFf, kEmbd}, 0.3f);
    add(p + "mlp.up_proj.weight", {kFf, kEmbd}, 0.3f);
    add(p + "mlp.down_proj.weight", {kEmbd, kFf}, 0.3f);
  }
  return t;
}

inline json hf_config() {
  json types = json::array();
  for (int l = 0; l < kLayers; ++l) types.push_back(l == kLayers - 1 ? "full_attention" : "sliding_attention");
  return {{"architectures", {"Gemma3ForCausalLM"}}, {"model_type", "gemma3_text"}, {"hidden_size", kEmbd},
          {"intermediate_size", kFf}, {"num_hidden_layers", kLayers}, {"num_attention_heads", kHeads},
          {"num_key_value_heads", 1}, {"head_dim", kHeadDim}, {"vocab_size", kVocab},
          {"max_position_embeddings", 128}, {"rms_norm_eps", 1e-6}, {"rope_theta", 1000000.0},
          {"rope_local_base_freq", 10000.0}, {"sliding_window", kWindow}, {"layer_types", types},
          {"query_pre_attn_scalar", kHeadDim}, {"hidden_activation", "gelu_pytorch_tanh"},
          {"tie_word_embeddings", true}};
}

inline std::string write_hf(const test::TempDir& dir, const std::map<std::string, Tensor>& t, const json& config) {
  test::SafetensorsBuilder b;
  for (const auto& [name, x] : t) b.f32(name, x.shape, x.values);
  dir.write_config(config);
  dir.write("model.safetensors", test::bytes_of(b.build()));
  return dir.path();
}

}  // namespace kestrel::test::gemma3_tiny
