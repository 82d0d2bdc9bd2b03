// Hugging Face config.json contents of well-known models (the fields the KV planner reads, with
// the values of the published configs), and a temporary folder to write them into.
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <string>

namespace kestrel::test {

// meta-llama/Llama-2-7b-hf: 32 layers, 32 heads (MHA), head_dim 4096 / 32 = 128.
inline nlohmann::json llama2_7b_config() {
  return {{"model_type", "llama"},           {"hidden_size", 4096},       {"intermediate_size", 11008},
          {"num_hidden_layers", 32},         {"num_attention_heads", 32}, {"num_key_value_heads", 32},
          {"max_position_embeddings", 4096}, {"vocab_size", 32000},       {"torch_dtype", "float16"},
          {"tie_word_embeddings", false}};
}

// meta-llama/Llama-2-70b-hf: 80 layers, 64 query heads, 8 KV heads (GQA), head_dim 128.
inline nlohmann::json llama2_70b_config() {
  return {{"model_type", "llama"},           {"hidden_size", 8192},       {"intermediate_size", 28672},
          {"num_hidden_layers", 80},         {"num_attention_heads", 64}, {"num_key_value_heads", 8},
          {"max_position_embeddings", 4096}, {"vocab_size", 32000},       {"torch_dtype", "float16"},
          {"tie_word_embeddings", false}};
}

// deepseek-ai/DeepSeek-V2: MLA (kv_lora_rank 512, qk_rope_head_dim 64), 160 routed experts.
inline nlohmann::json deepseek_v2_config() {
  return {{"model_type", "deepseek_v2"},
          {"hidden_size", 5120},
          {"intermediate_size", 12288},
          {"moe_intermediate_size", 1536},
          {"num_hidden_layers", 60},
          {"num_attention_heads", 128},
          {"num_key_value_heads", 128},
          {"n_routed_experts", 160},
          {"n_shared_experts", 2},
          {"first_k_dense_replace", 1},
          {"moe_layer_freq", 1},
          {"q_lora_rank", 1536},
          {"kv_lora_rank", 512},
          {"qk_nope_head_dim", 128},
          {"qk_rope_head_dim", 64},
          {"v_head_dim", 128},
          {"max_position_embeddings", 163840},
          {"vocab_size", 102400},
          {"torch_dtype", "bfloat16"},
          {"tie_word_embeddings", false}};
}

// A fresh folder under /tmp, removed with everything in it when the object dies.
class TempDir {
 public:
  TempDir() {
    char name[] = "/tmp/kestrel_plan_XXXXXX";
    const char* made = ::mkdtemp(name);
    EXPECT_NE(made, nullptr);
    path_ = made != nullptr ? made : "/tmp";
  }
  ~TempDir() {
    std::error_code ec;
    if (path_ != "/tmp") std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::string& path() const { return path_; }
  // Writes text to <dir>/<name> and returns that path.
  std::string write(const std::string& name, const std::string& text) const {
    const std::string p = path_ + "/" + name;
    std::ofstream(p, std::ios::binary) << text;
    return p;
  }
  std::string write_config(const nlohmann::json& config) const {
    return write("config.json", config.dump(2));
  }

 private:
  std::string path_;
};

}  // namespace kestrel::test
