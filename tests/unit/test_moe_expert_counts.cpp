// Tokens routed to each expert (ModelRunner::expert_token_counts, carried in EngineStats to the
// server's kestrel_moe_expert_tokens_total) on the CPU backend: mixtral-tiny (8 experts, top-2, all
// three layers MoE) counts k per computed token and layer, and layer 0's counts equal the choices
// of moe_select over router logits computed here from the weights alone; a dense model counts
// nothing.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include "backend/cpu/matmul.h"
#include "backend/model_runner.h"
#include "engine/engine.h"
#include "model/moe_router.h"
#include "test_util.h"

namespace kestrel {
namespace {

EngineConfig config(bool prefix_caching) {
  EngineConfig c;
  c.kv_dtype = KvDtype::F32;
  c.max_model_len = 256;
  c.n_threads = 1;
  c.enable_prefix_caching = prefix_caching;
  return c;
}

std::vector<double> row_of(const WeightView& w, int64_t r) {
  std::vector<float> f(static_cast<size_t>(w.n_in));
  cpu::dequantize_row(w.type.storage, w.row(r), f.data(), w.n_in);
  return std::vector<double>(f.begin(), f.end());
}

// y = W x for a [n_out, n_in] matrix, in double.
std::vector<double> mat_vec(const WeightView& w, const std::vector<double>& x) {
  std::vector<double> y(static_cast<size_t>(w.n_out));
  for (int64_t o = 0; o < w.n_out; ++o) {
    const std::vector<double> r = row_of(w, o);
    y[static_cast<size_t>(o)] = std::inner_product(r.begin(), r.end(), x.begin(), 0.0);
  }
  return y;
}

std::vector<double> rms_norm(const std::vector<double>& x, const std::vector<float>& w, double eps) {
  double ss = 0;
  for (double v : x) ss += v * v;
  const double inv = 1.0 / std::sqrt(ss / static_cast<double>(x.size()) + eps);
  std::vector<double> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = x[i] * inv * w[i];
  return y;
}

// Layer 0's experts for a one-token sequence: at position 0 attention sees only the token's own
// key, so each head's output is its KV head's value row and neither Q, K nor RoPE matters. Router
// input = RMSNorm(x + W_o (value rows)), x the token's embedding.
std::vector<int32_t> layer0_experts(const LlamaModel& m, int32_t token) {
  const ModelHparams& hp = m.hparams();
  const ModelWeights& W = m.weights();
  const std::vector<double> x = row_of(W.at({-1, WeightRole::TokenEmbd}).matrix, token);
  const std::vector<double> h = rms_norm(x, W.at({0, WeightRole::AttnNorm}).vector, hp.rms_eps);
  const std::vector<double> v = mat_vec(W.at({0, WeightRole::V}).matrix, h);  // [n_head_kv * head_dim]
  const int64_t group = hp.n_head / hp.n_head_kv;
  std::vector<double> attn(static_cast<size_t>(hp.q_dim()));
  for (int64_t head = 0; head < hp.n_head; ++head)
    for (int64_t i = 0; i < hp.head_dim; ++i)
      attn[static_cast<size_t>(head * hp.head_dim + i)] = v[static_cast<size_t>((head / group) * hp.head_dim + i)];
  const std::vector<double> o = mat_vec(W.at({0, WeightRole::AttnOut}).matrix, attn);
  std::vector<double> x2(x.size());
  for (size_t i = 0; i < x.size(); ++i) x2[i] = x[i] + o[i];
  const std::vector<double> f = rms_norm(x2, W.at({0, WeightRole::FfnNorm}).vector, hp.rms_eps);
  const std::vector<double> logits_d = mat_vec(W.at({0, WeightRole::Router}).matrix, f);
  const std::vector<float> logits(logits_d.begin(), logits_d.end());
  std::vector<int32_t> ids(static_cast<size_t>(hp.moe.routing.n_expert_used));
  std::vector<float> weights(ids.size());
  moe_select(logits.data(), hp.moe.routing, ids.data(), weights.data());
  return ids;
}

uint64_t layer_sum(const std::vector<uint64_t>& c, int64_t layer, int64_t n_exp) {
  return std::accumulate(c.begin() + layer * n_exp, c.begin() + (layer + 1) * n_exp, uint64_t{0});
}

TEST(MoeExpertCounts, MixtralCountsEqualTheRouterChoices) {
  const std::string folder = test::data_dir() + "/hf-tiny/mixtral-tiny";
  KESTREL_REQUIRE_FILE(folder + "/config.json");
  const auto model = LlamaModel::load_hf_dir(folder);
  const ModelHparams& hp = model->hparams();
  const int64_t n_layer = hp.n_layer, n_exp = hp.moe.routing.n_expert, k = hp.moe.routing.n_expert_used;
  ASSERT_EQ(n_layer, 3);
  ASSERT_EQ(n_exp, 8);
  ASSERT_EQ(k, 2);

  Engine engine(*model, nullptr, config(true));
  EXPECT_EQ(engine.stats().moe_layers, (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(engine.stats().moe_n_expert, 8);
  EXPECT_EQ(engine.stats().expert_tokens, std::vector<uint64_t>(static_cast<size_t>(n_layer * n_exp), 0));

  // One-token prompts, one token out each: every prompt runs one forward pass of one token.
  const std::vector<int32_t> tokens = {1, 100, 2000, 3001, 15000, 31999, 777, 4242, 9, 20000};
  std::vector<std::vector<int32_t>> prompts;
  std::vector<uint64_t> want0(static_cast<size_t>(n_exp), 0);
  for (int32_t t : tokens) {
    prompts.push_back({t});
    for (int32_t e : layer0_experts(*model, t)) ++want0[static_cast<size_t>(e)];
  }
  test::greedy_ids(engine, prompts, 1);
  const std::vector<uint64_t> c1 = engine.runner().expert_token_counts();
  ASSERT_EQ(c1.size(), static_cast<size_t>(n_layer * n_exp));
  EXPECT_EQ(engine.stats().expert_tokens, c1);
  EXPECT_EQ(std::vector<uint64_t>(c1.begin(), c1.begin() + n_exp), want0);
  for (int64_t l = 0; l < n_layer; ++l) EXPECT_EQ(layer_sum(c1, l, n_exp), tokens.size() * k) << "layer " << l;

  // A 40-token prompt and 5 tokens: 40 + 4 tokens computed (the last sampled one is never fed).
  std::vector<int32_t> prompt;
  for (int32_t i = 0; i < 40; ++i) prompt.push_back(100 + 37 * i);
  test::greedy_ids(engine, {prompt}, 5);
  const std::vector<uint64_t>& c2 = engine.stats().expert_tokens;
  for (int64_t l = 0; l < n_layer; ++l)
    EXPECT_EQ(layer_sum(c2, l, n_exp), (tokens.size() + 44) * k) << "layer " << l;
}

// Without the prefix cache the same prompt recomputes every token, routed as before (the CPU's
// results do not depend on the batch): every count doubles.
TEST(MoeExpertCounts, SecondIdenticalPromptDoublesEveryCount) {
  const std::string folder = test::data_dir() + "/hf-tiny/mixtral-tiny";
  KESTREL_REQUIRE_FILE(folder + "/config.json");
  const auto model = LlamaModel::load_hf_dir(folder);
  Engine engine(*model, nullptr, config(false));
  std::vector<int32_t> prompt;
  for (int32_t i = 0; i < 30; ++i) prompt.push_back(5 + 611 * i);
  test::greedy_ids(engine, {prompt}, 3);
  const std::vector<uint64_t> once = engine.stats().expert_tokens;
  ASSERT_EQ(once.size(), 24u);
  for (int64_t l = 0; l < 3; ++l) EXPECT_EQ(layer_sum(once, l, 8), (30u + 2u) * 2u);
  test::greedy_ids(engine, {prompt}, 3);
  const std::vector<uint64_t>& twice = engine.stats().expert_tokens;
  ASSERT_EQ(twice.size(), once.size());
  for (size_t i = 0; i < once.size(); ++i) EXPECT_EQ(twice[i], 2 * once[i]) << "layer " << i / 8 << " expert " << i % 8;
}

TEST(MoeExpertCounts, DenseModelCountsNothing) {
  const std::string folder = test::data_dir() + "/hf-tiny/mistral-swa-tiny";
  KESTREL_REQUIRE_FILE(folder + "/config.json");
  const auto model = LlamaModel::load_hf_dir(folder);
  Engine engine(*model, nullptr, config(true));
  test::greedy_ids(engine, {{1, 2, 3, 4, 5}}, 2);
  EXPECT_TRUE(engine.runner().expert_token_counts().empty());
  EXPECT_TRUE(engine.stats().moe_layers.empty());
  EXPECT_TRUE(engine.stats().expert_tokens.empty());
  EXPECT_EQ(engine.stats().moe_n_expert, 0);
}

}  // namespace
}  // namespace kestrel
