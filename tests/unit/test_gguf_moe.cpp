// The hf-tiny MoE folders' own tensors written into GGUF files under llama.cpp's names and keys
// (Qwen2-MoE as `qwen2moe`; Mixtral as `llama` with expert_count, its experts as 3-D `*_exps`
// tensors and its q/k rows permuted to adjacent RoPE pairs, as llama.cpp's converter writes them):
// each GGUF must give the logits of the folder it was written from.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "gguf_builder.h"
#include "hf_configs.h"
#include "io/safetensors_checkpoint.h"
#include "model/llama_weights.h"
#include "test_util.h"

namespace kestrel {
namespace {

using B = test::GgufBuilder;

// Copies tensors (BF16 bytes as stored) from a checkpoint into a GGUF image.
struct Converter {
  const SafetensorsCheckpoint& ckpt;
  B& g;

  const SafetensorsTensor& get(const std::string& hf) const {
    const SafetensorsTensor* t = ckpt.find(hf);
    EXPECT_NE(t, nullptr) << hf;
    return *t;
  }
  // A 2-D or 1-D tensor; head_dim > 0 reorders each head's rows from rotate-half pairs
  // (i, i + hd/2) to adjacent pairs (2i, 2i + 1), as llama.cpp's converter permutes q and k.
  void put(const std::string& gguf, const std::string& hf, int64_t head_dim = 0, bool flat = false) {
    const SafetensorsTensor& t = get(hf);
    std::vector<int64_t> ne(t.shape.rbegin(), t.shape.rend());
    if (flat) ne = {t.n_elements()};
    std::vector<uint8_t> data(t.data, t.data + t.n_bytes());
    if (head_dim > 0) {
      const size_t row = t.n_bytes() / static_cast<size_t>(t.shape[0]);
      for (int64_t r = 0; r < t.shape[0]; ++r) {
        const int64_t head = r / head_dim, i = r % head_dim, half = head_dim / 2;
        const int64_t src = head * head_dim + (i % 2 == 0 ? i / 2 : half + i / 2);
        std::memcpy(data.data() + r * row, t.data + src * row, row);
      }
    }
    g.tensor(gguf, ne, GgmlType::BF16, std::move(data));
  }
  // n_expert per-expert matrices [n_out, n_in] as one tensor ne {n_in, n_out, n_expert}.
  void put_experts(const std::string& gguf, const std::string& hf_prefix, const std::string& hf_suffix,
                   int64_t n_expert) {
    std::vector<uint8_t> data;
    std::vector<int64_t> ne;
    for (int64_t e = 0; e < n_expert; ++e) {
      const SafetensorsTensor& t = get(hf_prefix + std::to_string(e) + hf_suffix);
      ne = {t.shape[1], t.shape[0], n_expert};
      data.insert(data.end(), t.data, t.data + t.n_bytes());
    }
    g.tensor(gguf, ne, GgmlType::BF16, std::move(data));
  }
};

std::vector<int32_t> reference_prompt(const std::string& folder, size_t index) {
  std::ifstream f(folder + "/reference.json");
  return nlohmann::json::parse(f).at("prompts").at(index).at("input_ids").get<std::vector<int32_t>>();
}

EngineConfig f32_config() {
  EngineConfig c;
  c.kv_dtype = KvDtype::F32;
  c.max_model_len = 256;
  return c;
}

void common_keys(B& g, const std::string& arch, int64_t n_ff, float eps) {
  const std::string a = arch + ".";
  g.kv("general.architecture", B::str(arch))
      .kv(a + "embedding_length", B::u32(64))
      .kv(a + "feed_forward_length", B::u32(static_cast<uint32_t>(n_ff)))
      .kv(a + "block_count", B::u32(3))
      .kv(a + "attention.head_count", B::u32(4))
      .kv(a + "attention.head_count_kv", B::u32(2))
      .kv(a + "context_length", B::u32(4096))
      .kv(a + "vocab_size", B::u32(32000))
      .kv(a + "rope.freq_base", B::f32(1e6f))
      .kv(a + "attention.layer_norm_rms_epsilon", B::f32(eps))
      .kv(a + "expert_count", B::u32(8));
}

// Same tensors, same kernels, same RoPE pairing: the same bits.
TEST(GgufMoe, Qwen2MoeGgufEqualsTheHfFolder) {
  const std::string folder = test::data_dir() + "/hf-tiny/qwen2-moe-tiny";
  KESTREL_REQUIRE_FILE(folder + "/model.safetensors");
  const auto hf = LlamaModel::load_hf_dir(folder);
  const SafetensorsCheckpoint ckpt = SafetensorsCheckpoint::open_dir(folder);
  B g;
  common_keys(g, "qwen2moe", 96, 1e-6f);
  g.kv("qwen2moe.expert_used_count", B::u32(4))
      .kv("qwen2moe.expert_feed_forward_length", B::u32(32))
      .kv("qwen2moe.expert_shared_feed_forward_length", B::u32(64));
  Converter c{ckpt, g};
  c.put("token_embd.weight", "model.embed_tokens.weight");
  c.put("output_norm.weight", "model.norm.weight");
  for (int l = 0; l < 3; ++l) {
    const std::string b = "blk." + std::to_string(l) + ".", p = "model.layers." + std::to_string(l) + ".";
    c.put(b + "attn_norm.weight", p + "input_layernorm.weight");
    for (const char* x : {"q", "k", "v"}) {
      c.put(b + "attn_" + x + ".weight", p + "self_attn." + x + "_proj.weight");
      c.put(b + "attn_" + x + ".bias", p + "self_attn." + x + "_proj.bias");
    }
    c.put(b + "attn_output.weight", p + "self_attn.o_proj.weight");
    c.put(b + "ffn_norm.weight", p + "post_attention_layernorm.weight");
    c.put(b + "ffn_gate_inp.weight", p + "mlp.gate.weight");
    c.put_experts(b + "ffn_gate_exps.weight", p + "mlp.experts.", ".gate_proj.weight", 8);
    c.put_experts(b + "ffn_up_exps.weight", p + "mlp.experts.", ".up_proj.weight", 8);
    c.put_experts(b + "ffn_down_exps.weight", p + "mlp.experts.", ".down_proj.weight", 8);
    c.put(b + "ffn_gate_shexp.weight", p + "mlp.shared_expert.gate_proj.weight");
    c.put(b + "ffn_up_shexp.weight", p + "mlp.shared_expert.up_proj.weight");
    c.put(b + "ffn_down_shexp.weight", p + "mlp.shared_expert.down_proj.weight");
    // llama.cpp reads the shared expert's gate as a vector [n_embd].
    c.put(b + "ffn_gate_inp_shexp.weight", p + "mlp.shared_expert_gate.weight", 0, /*flat=*/true);
  }
  test::TempDir dir;
  const std::string path = dir.write("qwen2moe.gguf", test::bytes_of(g.build()));
  const auto gguf = LlamaModel::load_gguf(path);
  const MoeHparams& moe = gguf->hparams().moe;
  EXPECT_EQ(moe.routing.n_expert_used, 4);
  EXPECT_FALSE(moe.routing.norm_topk);  // qwen2moe: top-k weights not renormalised
  EXPECT_TRUE(moe.shared_gate);
  const std::vector<int32_t> ids = reference_prompt(folder, 1);
  EXPECT_EQ(test::prompt_logits(*gguf, ids, f32_config()), test::prompt_logits(*hf, ids, f32_config()));
}

// RoPE on permuted rows sums the attention dot products in another order: equal within f32
// rounding (measured worst 2.6e-6 on logits of magnitude ~5), the argmax everywhere the same.
TEST(GgufMoe, MixtralAsLlamaGgufMatchesTheHfFolder) {
  const std::string folder = test::data_dir() + "/hf-tiny/mixtral-tiny";
  KESTREL_REQUIRE_FILE(folder + "/model.safetensors");
  const auto hf = LlamaModel::load_hf_dir(folder);
  const SafetensorsCheckpoint ckpt = SafetensorsCheckpoint::open_dir(folder);
  B g;
  common_keys(g, "llama", 96, 1e-5f);
  g.kv("llama.expert_used_count", B::u32(2));
  Converter c{ckpt, g};
  c.put("token_embd.weight", "model.embed_tokens.weight");
  c.put("output_norm.weight", "model.norm.weight");
  for (int l = 0; l < 3; ++l) {
    const std::string b = "blk." + std::to_string(l) + ".", p = "model.layers." + std::to_string(l) + ".";
    c.put(b + "attn_norm.weight", p + "input_layernorm.weight");
    c.put(b + "attn_q.weight", p + "self_attn.q_proj.weight", 16);
    c.put(b + "attn_k.weight", p + "self_attn.k_proj.weight", 16);
    c.put(b + "attn_v.weight", p + "self_attn.v_proj.weight");
    c.put(b + "attn_output.weight", p + "self_attn.o_proj.weight");
    c.put(b + "ffn_norm.weight", p + "post_attention_layernorm.weight");
    c.put(b + "ffn_gate_inp.weight", p + "block_sparse_moe.gate.weight");
    c.put_experts(b + "ffn_gate_exps.weight", p + "block_sparse_moe.experts.", ".w1.weight", 8);
    c.put_experts(b + "ffn_up_exps.weight", p + "block_sparse_moe.experts.", ".w3.weight", 8);
    c.put_experts(b + "ffn_down_exps.weight", p + "block_sparse_moe.experts.", ".w2.weight", 8);
  }
  test::TempDir dir;
  const std::string path = dir.write("mixtral.gguf", test::bytes_of(g.build()));
  const auto gguf = LlamaModel::load_gguf(path);
  ASSERT_EQ(gguf->hparams().arch, "llama");
  EXPECT_EQ(gguf->hparams().moe.n_ff_expert, 96);
  EXPECT_TRUE(gguf->hparams().moe.routing.norm_topk);
  const std::vector<int32_t> ids = reference_prompt(folder, 1);
  const std::vector<float> a = test::prompt_logits(*gguf, ids, f32_config());
  const std::vector<float> b = test::prompt_logits(*hf, ids, f32_config());
  ASSERT_EQ(a.size(), b.size());
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, static_cast<double>(std::abs(a[i] - b[i])));
  std::printf("mixtral GGUF vs HF folder: worst |difference| %.3g\n", worst);
  EXPECT_LT(worst, 1e-5);
  const int64_t V = 32000;
  for (size_t pos = 0; pos < ids.size(); ++pos)
    EXPECT_EQ(std::max_element(a.begin() + pos * V, a.begin() + (pos + 1) * V) - a.begin(),
              std::max_element(b.begin() + pos * V, b.begin() + (pos + 1) * V) - b.begin())
        << "position " << pos;
}

}  // namespace
}  // namespace kestrel
