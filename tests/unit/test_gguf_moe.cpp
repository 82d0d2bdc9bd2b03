// The hf-tiny MoE folders' own tensors written into GGUF files under llama.cpp's names and keys
// (Qwen2-MoE as `qwen2moe`; Mixtral as `llama` with expert_count, its experts as 3-D `*_exps`
// tensors and its q/k rows permuted to adjacent RoPE pairs; DeepSeek-V2 as `deepseek2`, kv_b whole
// or split into attn_k_b / attn_v_b, as llama.cpp's converter writes them): each GGUF must give the
// logits of the folder it was written from.
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

// DeepSeek-V2's llama.cpp keys: older files give the heads' dims in key_length / value_length and
// kv_b whole; files since llama.cpp's MLA rework give the latent's widths there, the heads' in
// key_length_mla / value_length_mla, and kv_b split by head into attn_k_b ne {nope, r, H} (the
// key block transposed) and attn_v_b ne {r, v, H}.
// transposed_k_b: attn_k_b written with ne {r, nope, H} (a wrong shape).
void deepseek2_gguf(const std::string& folder, bool split_kv_b, B& g, bool transposed_k_b = false) {
  const nlohmann::json cfg = nlohmann::json::parse(std::ifstream(folder + "/config.json"));
  const SafetensorsCheckpoint ckpt = SafetensorsCheckpoint::open_dir(folder);
  const int64_t H = cfg.at("num_attention_heads"), nope = cfg.at("qk_nope_head_dim"), rope = cfg.at("qk_rope_head_dim");
  const int64_t v = cfg.at("v_head_dim"), r = cfg.at("kv_lora_rank"), n_layer = cfg.at("num_hidden_layers");
  const bool q_lora = !cfg.at("q_lora_rank").is_null();
  const nlohmann::json& ys = cfg.at("rope_scaling");
  const auto u32 = [](int64_t x) { return B::u32(static_cast<uint32_t>(x)); };
  const std::string a = "deepseek2.";
  g.kv("general.architecture", B::str("deepseek2"))
      .kv(a + "embedding_length", u32(cfg.at("hidden_size")))
      .kv(a + "feed_forward_length", u32(cfg.at("intermediate_size")))
      .kv(a + "block_count", u32(n_layer))
      .kv(a + "attention.head_count", u32(H))
      .kv(a + "attention.head_count_kv", u32(split_kv_b ? 1 : H))
      .kv(a + "context_length", u32(cfg.at("max_position_embeddings")))
      .kv(a + "vocab_size", u32(cfg.at("vocab_size")))
      .kv(a + "rope.freq_base", B::f32(cfg.at("rope_theta").get<float>()))
      .kv(a + "rope.dimension_count", u32(rope))
      .kv(a + "attention.layer_norm_rms_epsilon", B::f32(cfg.at("rms_norm_eps").get<float>()))
      .kv(a + "attention.kv_lora_rank", u32(r))
      .kv(a + "leading_dense_block_count", u32(cfg.at("first_k_dense_replace")))
      .kv(a + "expert_count", u32(cfg.at("n_routed_experts")))
      .kv(a + "expert_used_count", u32(cfg.at("num_experts_per_tok")))
      .kv(a + "expert_shared_count", u32(cfg.at("n_shared_experts")))
      .kv(a + "expert_feed_forward_length", u32(cfg.at("moe_intermediate_size")))
      .kv(a + "expert_weights_scale", B::f32(cfg.at("routed_scaling_factor").get<float>()))
      .kv(a + "rope.scaling.type", B::str("yarn"))
      .kv(a + "rope.scaling.factor", B::f32(ys.at("factor").get<float>()))
      .kv(a + "rope.scaling.original_context_length", u32(ys.at("original_max_position_embeddings")))
      .kv(a + "rope.scaling.yarn_log_multiplier", B::f32(0.1f * ys.at("mscale_all_dim").get<float>()));
  if (q_lora) g.kv(a + "attention.q_lora_rank", u32(cfg.at("q_lora_rank")));
  if (split_kv_b) {
    g.kv(a + "attention.key_length", u32(r + rope)).kv(a + "attention.value_length", u32(r));
    g.kv(a + "attention.key_length_mla", u32(nope + rope)).kv(a + "attention.value_length_mla", u32(v));
  } else {
    g.kv(a + "attention.key_length", u32(nope + rope)).kv(a + "attention.value_length", u32(v));
  }
  Converter c{ckpt, g};
  c.put("token_embd.weight", "model.embed_tokens.weight");
  c.put("output_norm.weight", "model.norm.weight");
  for (int64_t l = 0; l < n_layer; ++l) {
    const std::string b = "blk." + std::to_string(l) + ".", p = "model.layers." + std::to_string(l) + ".";
    const std::string at = p + "self_attn.";
    c.put(b + "attn_norm.weight", p + "input_layernorm.weight");
    if (q_lora) {
      c.put(b + "attn_q_a.weight", at + "q_a_proj.weight");
      c.put(b + "attn_q_a_norm.weight", at + "q_a_layernorm.weight");
      c.put(b + "attn_q_b.weight", at + "q_b_proj.weight");
    } else {
      c.put(b + "attn_q.weight", at + "q_proj.weight");
    }
    c.put(b + "attn_kv_a_mqa.weight", at + "kv_a_proj_with_mqa.weight");
    c.put(b + "attn_kv_a_norm.weight", at + "kv_a_layernorm.weight");
    if (split_kv_b) {
      const SafetensorsTensor& kvb = c.get(at + "kv_b_proj.weight");  // [H (nope + v), r] bf16
      const auto* src = reinterpret_cast<const uint16_t*>(kvb.data);
      std::vector<uint16_t> k_b(static_cast<size_t>(H * r * nope)), v_b(static_cast<size_t>(H * v * r));
      for (int64_t h = 0; h < H; ++h) {
        for (int64_t i = 0; i < nope; ++i)
          for (int64_t cc = 0; cc < r; ++cc)
            k_b[static_cast<size_t>((h * r + cc) * nope + i)] = src[(h * (nope + v) + i) * r + cc];
        for (int64_t j = 0; j < v; ++j)
          for (int64_t cc = 0; cc < r; ++cc)
            v_b[static_cast<size_t>((h * v + j) * r + cc)] = src[(h * (nope + v) + nope + j) * r + cc];
      }
      const auto bytes = [](const std::vector<uint16_t>& x) {
        const auto* p8 = reinterpret_cast<const uint8_t*>(x.data());
        return std::vector<uint8_t>(p8, p8 + 2 * x.size());
      };
      g.tensor(b + "attn_k_b.weight", transposed_k_b ? std::vector<int64_t>{r, nope, H} : std::vector<int64_t>{nope, r, H},
               GgmlType::BF16, bytes(k_b));
      g.tensor(b + "attn_v_b.weight", {r, v, H}, GgmlType::BF16, bytes(v_b));
    } else {
      c.put(b + "attn_kv_b.weight", at + "kv_b_proj.weight");
    }
    c.put(b + "attn_output.weight", at + "o_proj.weight");
    c.put(b + "ffn_norm.weight", p + "post_attention_layernorm.weight");
    if (l < cfg.at("first_k_dense_replace").get<int64_t>()) {
      c.put(b + "ffn_gate.weight", p + "mlp.gate_proj.weight");
      c.put(b + "ffn_up.weight", p + "mlp.up_proj.weight");
      c.put(b + "ffn_down.weight", p + "mlp.down_proj.weight");
      continue;
    }
    const int64_t E = cfg.at("n_routed_experts");
    c.put(b + "ffn_gate_inp.weight", p + "mlp.gate.weight");
    c.put_experts(b + "ffn_gate_exps.weight", p + "mlp.experts.", ".gate_proj.weight", E);
    c.put_experts(b + "ffn_up_exps.weight", p + "mlp.experts.", ".up_proj.weight", E);
    c.put_experts(b + "ffn_down_exps.weight", p + "mlp.experts.", ".down_proj.weight", E);
    c.put(b + "ffn_gate_shexp.weight", p + "mlp.shared_experts.gate_proj.weight");
    c.put(b + "ffn_up_shexp.weight", p + "mlp.shared_experts.up_proj.weight");
    c.put(b + "ffn_down_shexp.weight", p + "mlp.shared_experts.down_proj.weight");
  }
}

// Both tiny DeepSeek folders (with and without the query's low rank; YaRN; a dense first layer; a
// shared expert; routed_scaling_factor 2.5) in both kv_b layouts: the logits of the folder at every
// position of a 40-token prompt. The same weights and kernels give the same bits (measured: 0
// difference in all four files, AVX-512); the bound, 1e-5 of the largest logit, leaves room for
// what may differ on other machines: kv_b assembled from the split tensors is f32 (exact bf16
// values) where the folder's is bf16, and yarn's log multiplier arrives as the f32 0.1
// mscale_all_dim.
TEST(GgufMoe, DeepSeekV2GgufMatchesTheHfFolder) {
  for (const char* name : {"deepseek-v2-lite-tiny", "deepseek-v2-tiny"})
    for (const bool split : {false, true}) {
      SCOPED_TRACE(std::string(name) + (split ? ", kv_b split into attn_k_b / attn_v_b" : ", attn_kv_b"));
      const std::string folder = test::data_dir() + "/hf-tiny/" + name;
      KESTREL_REQUIRE_FILE(folder + "/model.safetensors");
      const auto hf = LlamaModel::load_hf_dir(folder);
      B g;
      deepseek2_gguf(folder, split, g);
      test::TempDir dir;
      const std::string path = dir.write("deepseek2.gguf", test::bytes_of(g.build()));
      const auto gguf = LlamaModel::load_gguf(path);
      const ModelHparams& a = gguf->hparams();
      const ModelHparams& b = hf->hparams();
      EXPECT_EQ(a.mla.kv_lora_rank, b.mla.kv_lora_rank);
      EXPECT_EQ(a.mla.q_lora_rank, b.mla.q_lora_rank);
      EXPECT_EQ(a.mla.qk_nope, b.mla.qk_nope);
      EXPECT_EQ(a.mla.v_head_dim, b.mla.v_head_dim);
      EXPECT_EQ(a.n_head_kv, b.n_head_kv);
      EXPECT_EQ(a.moe.first_dense, b.moe.first_dense);
      EXPECT_EQ(a.moe.n_ff_shared, b.moe.n_ff_shared);
      EXPECT_EQ(a.moe.routing.norm_topk, b.moe.routing.norm_topk);
      EXPECT_NEAR(a.softmax_scale(), b.softmax_scale(), 1e-6f * b.softmax_scale());
      ASSERT_EQ(gguf->weights().rope_freq_factors.size(), hf->weights().rope_freq_factors.size());
      for (size_t i = 0; i < hf->weights().rope_freq_factors.size(); ++i)
        EXPECT_FLOAT_EQ(gguf->weights().rope_freq_factors[i], hf->weights().rope_freq_factors[i]) << i;
      const std::vector<int32_t> ids = reference_prompt(folder, 1);
      const std::vector<float> x = test::prompt_logits(*gguf, ids, f32_config());
      const std::vector<float> y = test::prompt_logits(*hf, ids, f32_config());
      ASSERT_EQ(x.size(), y.size());
      double worst = 0, mag = 0;
      for (size_t i = 0; i < x.size(); ++i) {
        worst = std::max(worst, static_cast<double>(std::abs(x[i] - y[i])));
        mag = std::max(mag, static_cast<double>(std::abs(y[i])));
      }
      std::printf("%s GGUF%s vs HF folder: worst |difference| %.3g (largest logit %.3g)\n", name,
                  split ? " (split kv_b)" : "", worst, mag);
      EXPECT_LT(worst, 1e-5 * std::max(1.0, mag));
    }
}

// What this build does not run is refused by name at load: DeepSeek-V3's sigmoid gating, and a
// split kv_b of the wrong shape.
TEST(GgufMoe, DeepSeekV2GgufRefusesWhatItCannotRun) {
  const std::string folder = test::data_dir() + "/hf-tiny/deepseek-v2-lite-tiny";
  KESTREL_REQUIRE_FILE(folder + "/model.safetensors");
  test::TempDir dir;
  {
    B g;
    deepseek2_gguf(folder, false, g);
    g.kv("deepseek2.expert_gating_func", B::u32(2));
    const std::string path = dir.write("v3.gguf", test::bytes_of(g.build()));
    EXPECT_NE(test::error_of([&] { LlamaModel::load_gguf(path); }).find("expert_gating_func 2"), std::string::npos);
  }
  {
    B g;
    deepseek2_gguf(folder, true, g, /*transposed_k_b=*/true);
    const std::string path = dir.write("bad.gguf", test::bytes_of(g.build()));
    const std::string e = test::error_of([&] { LlamaModel::load_gguf(path); });
    EXPECT_NE(e.find("attn_k_b"), std::string::npos) << e;
  }
}

}  // namespace
}  // namespace kestrel
