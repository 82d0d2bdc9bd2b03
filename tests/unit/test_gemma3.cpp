// Gemma 3's two file forms agree: a tiny random Gemma3ForCausalLM folder (norm weights stored as w,
// meaning 1 + w; transformers' names, layer_types, rope_local_base_freq, query_pre_attn_scalar)
// and a GGUF of the same tensors as llama.cpp writes gemma3 (norm weights 1 + w, llama.cpp's
// names, the six-layer pattern and local RoPE base it assumes) give the same logits bit for bit,
// over a prompt longer than the window so the local layers' window and RoPE base matter. Each
// change below (a norm offset, a window, a base) must move the logits.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "gguf_builder.h"
#include "hf_configs.h"
#include "model/llama_weights.h"
#include "gemma3_tiny.h"
#include "test_util.h"

namespace kestrel {
namespace {

using B = test::GgufBuilder;

using namespace test::gemma3_tiny;

// The GGUF llama.cpp's converter writes: norms as 1 + w, names blk.N.*, window and pattern implied.
std::string write_gguf(const test::TempDir& dir, const std::map<std::string, Tensor>& t) {
  B g;
  g.kv("general.architecture", B::str("gemma3"))
      .kv("gemma3.embedding_length", B::u32(kEmbd))
      .kv("gemma3.feed_forward_length", B::u32(kFf))
      .kv("gemma3.block_count", B::u32(kLayers))
      .kv("gemma3.attention.head_count", B::u32(kHeads))
      .kv("gemma3.attention.head_count_kv", B::u32(1))
      .kv("gemma3.attention.key_length", B::u32(kHeadDim))
      .kv("gemma3.attention.value_length", B::u32(kHeadDim))
      .kv("gemma3.context_length", B::u32(128))
      .kv("gemma3.vocab_size", B::u32(kVocab))
      .kv("gemma3.rope.freq_base", B::f32(1000000.0f))
      .kv("gemma3.attention.sliding_window", B::u32(kWindow))
      .kv("gemma3.attention.layer_norm_rms_epsilon", B::f32(1e-6f));
  auto put = [&](const std::string& gguf, const std::string& hf, bool norm) {
    const Tensor& x = t.at(hf);
    std::vector<float> v = x.values;
    if (norm)
      for (float& e : v) e += 1.0f;
    std::vector<int64_t> ne(x.shape.rbegin(), x.shape.rend());
    g.tensor(gguf, ne, GgmlType::F32, test::f32_bytes(v));
  };
  put("token_embd.weight", "model.embed_tokens.weight", false);
  put("output_norm.weight", "model.norm.weight", true);
  for (int l = 0; l < kLayers; ++l) {
    const std::string b = "blk." + std::to_string(l) + ".", p = "model.layers." + std::to_string(l) + ".";
    put(b + "attn_norm.weight", p + "input_layernorm.weight", true);
    put(b + "attn_q.weight", p + "self_attn.q_proj.weight", false);
    put(b + "attn_k.weight", p + "self_attn.k_proj.weight", false);
    put(b + "attn_v.weight", p + "self_attn.v_proj.weight", false);
    put(b + "attn_q_norm.weight", p + "self_attn.q_norm.weight", true);
    put(b + "attn_k_norm.weight", p + "self_attn.k_norm.weight", true);
    put(b + "attn_output.weight", p + "self_attn.o_proj.weight", false);
    put(b + "post_attention_norm.weight", p + "post_attention_layernorm.weight", true);
    put(b + "ffn_norm.weight", p + "pre_feedforward_layernorm.weight", true);
    put(b + "ffn_gate.weight", p + "mlp.gate_proj.weight", false);
    put(b + "ffn_up.weight", p + "mlp.up_proj.weight", false);
    put(b + "ffn_down.weight", p + "mlp.down_proj.weight", false);
    put(b + "post_ffw_norm.weight", p + "post_feedforward_layernorm.weight", true);
  }
  return dir.write("gemma3.gguf", test::bytes_of(g.build()));
}

std::vector<float> logits(const LlamaModel& m) {
  const std::vector<int32_t> ids = {2, 7, 19, 3, 44, 12, 12, 30, 5, 21, 9, 40};  // 12 tokens, window 4
  EngineConfig c;
  c.kv_dtype = KvDtype::F32;
  c.block_size = 4;
  return test::prompt_logits(m, ids, c);
}

TEST(Gemma3, TinyGgufEqualsTinyHfFolder) {
  const auto tensors = random_tensors();
  test::TempDir hf_dir, gguf_dir;
  const auto hf = LlamaModel::load_hf_dir(write_hf(hf_dir, tensors, hf_config()));
  const auto gguf = LlamaModel::load_gguf(write_gguf(gguf_dir, tensors));
  for (const ModelHparams* hp : {&hf->hparams(), &gguf->hparams()}) {
    EXPECT_EQ(hp->arch, "gemma3");
    EXPECT_EQ(hp->layer_window(0), kWindow);
    EXPECT_EQ(hp->layer_window(kLayers - 1), 0);
    EXPECT_EQ(hp->layer_rope_theta(0), 10000.0f);
    EXPECT_EQ(hp->layer_rope_theta(kLayers - 1), 1000000.0f);
    EXPECT_FLOAT_EQ(hp->embd_scale, std::sqrt(32.0f));
  }
  const std::vector<float> a = logits(*hf);
  ASSERT_EQ(a.size(), 12u * kVocab);
  EXPECT_EQ(a, logits(*gguf));

  // The checks can fail: a window as wide as the prompt, one local base for all layers, or a
  // norm without its + 1 each change the logits.
  json wide = hf_config();
  wide["sliding_window"] = 64;
  test::TempDir d1, d2, d3;
  EXPECT_NE(logits(*LlamaModel::load_hf_dir(write_hf(d1, tensors, wide))), a);
  json one_base = hf_config();
  one_base["rope_local_base_freq"] = 1000000.0;
  EXPECT_NE(logits(*LlamaModel::load_hf_dir(write_hf(d2, tensors, one_base))), a);
  auto shifted = tensors;
  for (float& v : shifted["model.layers.0.self_attn.q_norm.weight"].values) v += 1.0f;  // now 2 + w
  EXPECT_NE(logits(*LlamaModel::load_hf_dir(write_hf(d3, shifted, hf_config()))), a);
}

TEST(Gemma3, HfConfigErrors) {
  test::TempDir dir;
  const auto tensors = random_tensors();
  json c = hf_config();
  c["hidden_activation"] = "gelu";
  EXPECT_NE(test::error_of([&] { LlamaModel::load_hf_dir(write_hf(dir, tensors, c)); })
                .find("hidden_activation 'gelu' is not supported (only gelu_pytorch_tanh)"),
            std::string::npos);
  c = hf_config();
  c["layer_types"][1] = "full_attention";  // full at 1 and 5: not one repeating pattern
  EXPECT_NE(test::error_of([&] { LlamaModel::load_hf_dir(write_hf(dir, tensors, c)); })
                .find("'layer_types' is not a repeating pattern"),
            std::string::npos);
  c = hf_config();
  c["final_logit_softcapping"] = 30.0;
  EXPECT_NE(test::error_of([&] { LlamaModel::load_hf_dir(write_hf(dir, tensors, c)); })
                .find("'final_logit_softcapping' is not supported"),
            std::string::npos);
}

}  // namespace
}  // namespace kestrel
