// Models with generated weights (LlamaModel::load_dummy, --load-format dummy) from a config.json
// alone: every tensor the architecture lists, in its shape and role; values a pure function of the
// tensor's name and index (two loads equal, the generator's formula), in the stated ranges; no
// host memory until the host copy is asked for; finite logits on the CPU backend for every
// architecture (80 layers deep too); the same logits as an HF folder holding the same values;
// clear errors for what is not a config folder.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>

#include "core/random_fill.h"
#include "gemma3_tiny.h"
#include "hf_configs.h"
#include "model/dummy_weights.h"
#include "model/forward_ops.h"
#include "model/llama_weights.h"
#include "safetensors_builder.h"
#include "test_util.h"

using namespace kestrel;
using json = nlohmann::json;

namespace {

json llama_config() {
  return {{"architectures", {"LlamaForCausalLM"}}, {"hidden_size", 64}, {"intermediate_size", 96},
          {"num_hidden_layers", 2}, {"num_attention_heads", 4}, {"num_key_value_heads", 2},
          {"vocab_size", 256}, {"max_position_embeddings", 128}, {"tie_word_embeddings", false}};
}

json mixtral_config() {
  return {{"architectures", {"MixtralForCausalLM"}}, {"hidden_size", 64}, {"intermediate_size", 32},
          {"num_hidden_layers", 2}, {"num_attention_heads", 4}, {"num_key_value_heads", 2},
          {"num_local_experts", 4}, {"num_experts_per_tok", 2}, {"vocab_size", 256},
          {"max_position_embeddings", 128}, {"tie_word_embeddings", true}};
}

json qwen2_moe_config() {
  return {{"architectures", {"Qwen2MoeForCausalLM"}}, {"hidden_size", 64}, {"intermediate_size", 96},
          {"moe_intermediate_size", 32}, {"shared_expert_intermediate_size", 48}, {"num_experts", 6},
          {"num_experts_per_tok", 2}, {"num_hidden_layers", 2}, {"num_attention_heads", 4},
          {"num_key_value_heads", 2}, {"vocab_size", 256}, {"max_position_embeddings", 128},
          {"tie_word_embeddings", false}};
}

json deepseek_v2_config() {
  return {{"architectures", {"DeepseekV2ForCausalLM"}}, {"hidden_size", 64}, {"intermediate_size", 96},
          {"moe_intermediate_size", 32}, {"num_hidden_layers", 3}, {"num_attention_heads", 4},
          {"num_key_value_heads", 4}, {"n_routed_experts", 8}, {"n_shared_experts", 1},
          {"num_experts_per_tok", 2}, {"first_k_dense_replace", 1}, {"q_lora_rank", 32},
          {"kv_lora_rank", 32}, {"qk_nope_head_dim", 16}, {"qk_rope_head_dim", 8}, {"v_head_dim", 16},
          {"routed_scaling_factor", 2.5}, {"vocab_size", 256}, {"max_position_embeddings", 4096},
          {"rope_scaling", {{"type", "yarn"}, {"factor", 32}, {"original_max_position_embeddings", 128},
                            {"beta_fast", 32}, {"beta_slow", 1}, {"mscale", 0.707}, {"mscale_all_dim", 0.707}}},
          {"tie_word_embeddings", true}};
}

std::unique_ptr<LlamaModel> dummy(const test::TempDir& dir, const json& config) {
  dir.write_config(config);
  return LlamaModel::load(dir.path(), LoadFormat::Dummy);
}

std::vector<uint16_t> host_values(const WeightView& w) {
  std::vector<uint16_t> v(static_cast<size_t>(w.n_in * w.n_out));
  std::memcpy(v.data(), w.data, v.size() * 2);
  return v;
}

// Every matrix view of a model (experts included), in the architecture's order.
std::vector<const WeightView*> matrices(const LlamaModel& m) {
  std::vector<const WeightView*> out;
  const Architecture& arch = architecture(m.hparams().arch);
  for (int32_t l = -1; l < static_cast<int32_t>(m.hparams().n_layer); ++l)
    for (const TensorSpec& s : arch.tensors(m.hparams(), l)) {
      const LayerTensor& t = m.weights().at({l, s.role});
      if (t.matrix.n_out > 0) out.push_back(&t.matrix);
      for (const WeightView& e : t.experts) out.push_back(&e);
    }
  return out;
}

// Resident pages of [p, p + bytes) (mincore).
size_t resident_pages(const void* p, size_t bytes) {
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  const auto begin = reinterpret_cast<uintptr_t>(p) / page * page;
  const size_t n = (reinterpret_cast<uintptr_t>(p) + bytes - begin + page - 1) / page;
  std::vector<unsigned char> v(n);
  EXPECT_EQ(::mincore(reinterpret_cast<void*>(begin), n * page, v.data()), 0);
  size_t r = 0;
  for (unsigned char c : v) r += c & 1;
  return r;
}

// Finite logits at every position of a 12-token prompt on the CPU backend; returns them.
std::vector<float> cpu_logits(const LlamaModel& m) {
  std::vector<int32_t> ids;
  for (int i = 0; i < 12; ++i) ids.push_back((i * 37 + 5) % static_cast<int32_t>(m.hparams().n_vocab));
  EngineConfig c;
  c.kv_dtype = KvDtype::F32;
  c.n_kv_blocks = 8;
  const std::vector<float> logits = test::prompt_logits(m, ids, c);
  EXPECT_EQ(logits.size(), ids.size() * static_cast<size_t>(m.hparams().n_vocab));
  for (float x : logits) EXPECT_TRUE(std::isfinite(x));
  return logits;
}

}  // namespace

TEST(DummyWeights, EveryTensorOfTheArchitectureInItsShapeAsBf16) {
  for (const json& config : {llama_config(), mixtral_config(), qwen2_moe_config(), deepseek_v2_config(),
                             test::gemma3_tiny::hf_config()}) {
    test::TempDir dir;
    const auto m = dummy(dir, config);
    SCOPED_TRACE(m->hparams().arch);
    EXPECT_TRUE(m->generated_weights());
    const Architecture& arch = architecture(m->hparams().arch);
    uint64_t bytes = 0;
    int n_matrices = 0;
    for (int32_t l = -1; l < static_cast<int32_t>(m->hparams().n_layer); ++l)
      for (const TensorSpec& s : arch.tensors(m->hparams(), l)) {
        const LayerTensor* t = m->weights().find({l, s.role});
        ASSERT_NE(t, nullptr) << weight_role_name(s.role) << " of layer " << l;
        if (s.role == WeightRole::Output && config.value("tie_word_embeddings", false)) {
          EXPECT_TRUE(m->weights().tied_output);
          EXPECT_EQ(t->matrix.data, m->weights().at({-1, WeightRole::TokenEmbd}).matrix.data);
          continue;
        }
        if (s.n_in == 0) {
          EXPECT_EQ(t->vector.size(), static_cast<size_t>(s.n_out));
          bytes += 2 * s.n_out;
          continue;
        }
        std::vector<WeightView> views = s.n_expert > 0 ? t->experts : std::vector<WeightView>{t->matrix};
        EXPECT_EQ(views.size(), static_cast<size_t>(std::max<int64_t>(s.n_expert, 1)));
        for (const WeightView& w : views) {
          EXPECT_EQ(w.type, GgmlType::BF16);
          EXPECT_EQ(w.n_in, s.n_in);
          EXPECT_EQ(w.n_out, s.n_out);
          EXPECT_NE(w.random, nullptr);
          EXPECT_NE(w.data, nullptr);
          bytes += 2 * s.n_in * s.n_out;
          ++n_matrices;
        }
        if (s.n_expert == 0) {
          EXPECT_TRUE(t->experts.empty());
        }
      }
    // Qwen2-MoE has q/k/v biases (Qwen2's attention); the others none.
    const bool biased = m->hparams().arch == "qwen2moe";
    for (WeightRole r : {WeightRole::Q, WeightRole::K, WeightRole::V})
      if (const LayerTensor* t = m->weights().find({0, r}))  // DeepSeek-V2 with q_lora has no Q, K or V
        EXPECT_EQ(t->bias.size(), biased ? static_cast<size_t>(t->matrix.n_out) : 0u);
    if (biased) bytes += 2 * (m->weights().at({0, WeightRole::Q}).matrix.n_out + 2 * m->weights().at({0, WeightRole::K}).matrix.n_out) * m->hparams().n_layer;
    EXPECT_EQ(m->weight_bytes(), bytes);
    EXPECT_GT(n_matrices, 0);
  }
}

TEST(DummyWeights, MoeAndMlaShapes) {
  test::TempDir a, b;
  const auto mix = dummy(a, mixtral_config());
  EXPECT_EQ(mix->weights().at({1, WeightRole::ExpGate}).experts.size(), 4u);
  EXPECT_EQ(mix->weights().at({1, WeightRole::ExpDown}).experts[3].n_in, 32);
  EXPECT_EQ(mix->weights().at({1, WeightRole::Router}).matrix.n_out, 4);
  const auto ds = dummy(b, deepseek_v2_config());
  EXPECT_EQ(ds->weights().find({0, WeightRole::ExpGate}), nullptr);  // first_k_dense_replace 1: layer 0 dense
  EXPECT_EQ(ds->weights().at({0, WeightRole::Gate}).matrix.n_out, 96);
  EXPECT_EQ(ds->weights().at({1, WeightRole::ExpUp}).experts.size(), 8u);
  EXPECT_EQ(ds->weights().at({1, WeightRole::ShGate}).matrix.n_out, 32);
  EXPECT_EQ(ds->weights().at({2, WeightRole::KvA}).matrix.n_out, 32 + 8);
  EXPECT_EQ(ds->weights().at({2, WeightRole::KvB}).matrix.n_out, 4 * (16 + 16));
  EXPECT_EQ(ds->weights().at({2, WeightRole::QB}).matrix.n_in, 32);
  EXPECT_FALSE(ds->weights().rope_freq_factors.empty());  // YaRN from the config
}

TEST(DummyWeights, ValuesArePureFunctionsOfNameAndIndexInTheirRanges) {
  test::TempDir d1, d2;
  const auto m1 = dummy(d1, mixtral_config());
  const auto m2 = dummy(d2, mixtral_config());
  m1->ensure_host_weights();
  m2->ensure_host_weights();
  const auto v1 = matrices(*m1), v2 = matrices(*m2);
  ASSERT_EQ(v1.size(), v2.size());
  for (size_t i = 0; i < v1.size(); ++i) EXPECT_EQ(host_values(*v1[i]), host_values(*v2[i])) << "matrix " << i;
  // Distinct tensors differ (expert 0 and 1 of the same projection too).
  const LayerTensor& gate = m1->weights().at({0, WeightRole::ExpGate});
  EXPECT_NE(host_values(gate.experts[0]), host_values(gate.experts[1]));
  EXPECT_NE(host_values(m1->weights().at({0, WeightRole::Q}).matrix),
            host_values(m1->weights().at({1, WeightRole::Q}).matrix));

  // The formula: the key of the HF name, uniform in [-a, a), a = 1/sqrt(n_in), rounded to bf16.
  const WeightView& e1 = gate.experts[1];
  const RandomFill f = matrix_fill("model.layers.0.block_sparse_moe.experts.1.w1.weight", 64);
  EXPECT_EQ(e1.random->key, f.key);
  EXPECT_EQ(e1.random->step, f.step);
  const std::vector<uint16_t> got = host_values(e1);
  const float a = 1.0f / 8;
  double sum = 0, sum2 = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_EQ(got[i], random_fill_bf16(f, i)) << i;
    const float x = bf16_to_fp32(got[i]);
    EXPECT_LE(std::fabs(x), a);
    sum += x;
    sum2 += static_cast<double>(x) * x;
  }
  const double n = static_cast<double>(got.size());  // 2048 values: mean 0, variance a^2 / 3
  EXPECT_NEAR(sum / n, 0.0, 4 * a / std::sqrt(3 * n));
  EXPECT_NEAR(sum2 / n, a * a / 3, 0.1 * a * a / 3);
  // Norm weights near 1, and the same on every load.
  const std::vector<float>& norm = m1->weights().at({1, WeightRole::AttnNorm}).vector;
  EXPECT_EQ(norm, m2->weights().at({1, WeightRole::AttnNorm}).vector);
  for (float x : norm) EXPECT_NEAR(x, 1.0f, 1.0f / 16);
  EXPECT_NE(norm, m1->weights().at({1, WeightRole::FfnNorm}).vector);
}

// The host fill (four elements per hash) gives each element's random_fill_bf16 from any range.
TEST(DummyWeights, HostFillOfAnyRangeIsElementwise) {
  const RandomFill f = matrix_fill("model.layers.1.self_attn.v_proj.weight", 100);
  for (int64_t begin = 0; begin < 6; ++begin)
    for (int64_t end = begin; end < begin + 11; ++end) {
      std::vector<uint16_t> out(static_cast<size_t>(end - begin));
      fill_random_bf16_host(f, out.data(), begin, end);
      for (int64_t i = begin; i < end; ++i)
        ASSERT_EQ(out[static_cast<size_t>(i - begin)], random_fill_bf16(f, static_cast<uint64_t>(i))) << begin << " " << i;
    }
  // Lanes of one hash: element 4g + j is bits 16 j of the group's 64 bits.
  const uint64_t z = random_fill_group(f.key, 3);
  EXPECT_EQ(random_fill_f32(f, 13), static_cast<float>(static_cast<int32_t>((z >> 16) & 0xffff) - 32768) * f.step);
}

TEST(DummyWeights, NoHostMemoryUntilTheHostCopyIsAsked) {
  // 8 MiB of embedding: its pages stay out of memory until ensure_host_weights.
  json c = llama_config();
  c["vocab_size"] = 65536;
  test::TempDir dir;
  const auto m = dummy(dir, c);
  const WeightView& embd = m->weights().at({-1, WeightRole::TokenEmbd}).matrix;
  const size_t bytes = static_cast<size_t>(embd.n_in * embd.n_out) * 2;
  EXPECT_EQ(resident_pages(embd.data, bytes), 0u);
  m->ensure_host_weights();
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  EXPECT_EQ(resident_pages(embd.data, bytes), bytes / page);
  EXPECT_EQ(host_values(embd)[12345], random_fill_bf16(*embd.random, 12345));
}

TEST(DummyWeights, MlaUpProjectionIsOnTheHostAtOnce) {
  // The CUDA backend splits KvB on the host while it starts, so it is made at load.
  test::TempDir dir;
  const auto m = dummy(dir, deepseek_v2_config());
  const WeightView& kvb = m->weights().at({1, WeightRole::KvB}).matrix;
  EXPECT_EQ(host_values(kvb)[7], random_fill_bf16(*kvb.random, 7));
  const WeightView& q_a = m->weights().at({1, WeightRole::QA}).matrix;
  EXPECT_EQ(resident_pages(q_a.data, static_cast<size_t>(q_a.n_in * q_a.n_out) * 2), 0u);
}

TEST(DummyWeights, FiniteLogitsOnTheCpuForEveryArchitecture) {
  json qwen2 = llama_config();
  qwen2["architectures"] = {"Qwen2ForCausalLM"};
  json mistral = llama_config();
  mistral["architectures"] = {"MistralForCausalLM"};
  mistral["sliding_window"] = 4;
  for (const json& config : {llama_config(), qwen2, mistral, mixtral_config(), qwen2_moe_config(),
                             deepseek_v2_config(), test::gemma3_tiny::hf_config()}) {
    test::TempDir dir;
    const auto m = dummy(dir, config);
    SCOPED_TRACE(m->hparams().arch);
    const std::vector<float> logits = cpu_logits(*m);
    const size_t v = static_cast<size_t>(m->hparams().n_vocab);
    // Not constant: positions and vocabulary entries differ.
    EXPECT_NE(std::vector<float>(logits.begin(), logits.begin() + v), std::vector<float>(logits.end() - v, logits.end()));
    EXPECT_NE(logits[0], logits[1]);
  }
}

TEST(DummyWeights, ActivationsStayFiniteThroughEightyLayers) {
  json c = llama_config();
  c["num_hidden_layers"] = 80;
  test::TempDir dir;
  const auto m = dummy(dir, c);
  float worst = 0;
  for (float x : cpu_logits(*m)) worst = std::max(worst, std::fabs(x));
  EXPECT_GT(worst, 0.01f);
  EXPECT_LT(worst, 100.0f);
}

// The dummy model's values written to an HF folder (bf16 matrices, f32 vectors) and loaded from
// it give the same logits bit for bit: the generated model is built as the loader builds a real one.
TEST(DummyWeights, SameLogitsAsAnHfFolderHoldingItsValues) {
  for (const json& config : {qwen2_moe_config(), deepseek_v2_config()}) {
    test::TempDir cfg_dir, hf_dir;
    const auto m = dummy(cfg_dir, config);
    SCOPED_TRACE(m->hparams().arch);
    m->ensure_host_weights();
    test::SafetensorsBuilder b;
    const Architecture& arch = architecture(m->hparams().arch);
    auto bf16_tensor = [&](const std::string& name, const WeightView& w) {
      std::vector<uint8_t> bytes(static_cast<size_t>(w.n_in * w.n_out) * 2);
      std::memcpy(bytes.data(), w.data, bytes.size());
      b.tensor(name, "BF16", {w.n_out, w.n_in}, std::move(bytes));
    };
    for (int32_t l = -1; l < static_cast<int32_t>(m->hparams().n_layer); ++l)
      for (const TensorSpec& s : arch.tensors(m->hparams(), l)) {
        const LayerTensor& t = m->weights().at({l, s.role});
        if (s.role == WeightRole::Output && m->weights().tied_output) continue;
        if (s.n_in == 0) {
          b.f32(s.hf + ".weight", {s.n_out}, t.vector);
        } else if (s.n_expert > 0) {
          for (int64_t e = 0; e < s.n_expert; ++e) {
            std::string name = s.hf;
            name.replace(name.find("{e}"), 3, std::to_string(e));
            bf16_tensor(name + ".weight", t.experts[static_cast<size_t>(e)]);
          }
        } else {
          bf16_tensor(s.hf + ".weight", t.matrix);
        }
        if (!t.bias.empty()) b.f32(s.hf + ".bias", {s.n_out}, t.bias);
      }
    hf_dir.write_config(config);
    hf_dir.write("model.safetensors", test::bytes_of(b.build()));
    const auto real = LlamaModel::load(hf_dir.path());
    EXPECT_FALSE(real->generated_weights());
    EXPECT_EQ(cpu_logits(*real), cpu_logits(*m));
  }
}

TEST(DummyWeights, ClearErrors) {
  test::TempDir empty;
  EXPECT_TRUE(test::fails_naming(empty.path(), "no config.json",
                                 [&] { LlamaModel::load(empty.path(), LoadFormat::Dummy); }));
  const std::string file = empty.write("model.gguf", "GGUF....");
  EXPECT_TRUE(test::fails_naming(file, "needs a Hugging Face model folder holding a config.json",
                                 [&] { LlamaModel::load(file, LoadFormat::Dummy); }));
  EXPECT_TRUE(test::fails_naming(empty.path() + "/nope", "no such folder",
                                 [&] { LlamaModel::load(empty.path() + "/nope", LoadFormat::Dummy); }));
  EXPECT_EQ(test::error_of([] { parse_load_format("pt"); }), "unknown load format 'pt' (supported: auto, dummy)");
  EXPECT_EQ(parse_load_format("auto"), LoadFormat::Auto);
  EXPECT_EQ(parse_load_format("dummy"), LoadFormat::Dummy);
  // The config's own errors, naming the field.
  json bad = llama_config();
  bad.erase("hidden_size");
  test::TempDir dir;
  EXPECT_NE(test::error_of([&] { dummy(dir, bad); }).find("hidden_size"), std::string::npos);
}
