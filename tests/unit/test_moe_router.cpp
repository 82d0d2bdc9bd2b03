// moe_select against values worked out by hand from the reference routers' definitions
// (transformers' MixtralTopKRouter, Qwen2MoeTopKRouter, DeepseekV2's greedy and
// group_limited_greedy): softmax over all experts, top-k, optional renormalisation, scaling.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "model/moe_router.h"

namespace kestrel {
namespace {

struct Pick {
  std::vector<int32_t> ids;
  std::vector<float> weights;
};

Pick pick(const std::vector<float>& logits, MoeRouting r) {
  r.n_expert = static_cast<int32_t>(logits.size());
  Pick p{std::vector<int32_t>(static_cast<size_t>(r.n_expert_used)), std::vector<float>(static_cast<size_t>(r.n_expert_used))};
  moe_select(logits.data(), r, p.ids.data(), p.weights.data());
  return p;
}

TEST(MoeRouter, SoftmaxTopKWithAndWithoutRenormalisation) {
  const std::vector<float> logits = {1, 3, 2, 0};
  const double z = std::exp(-2.0) + 1.0 + std::exp(-1.0) + std::exp(-3.0);  // softmax denominator, max subtracted
  MoeRouting r;
  r.n_expert_used = 2;
  Pick p = pick(logits, r);  // Qwen2-MoE: norm_topk_prob false
  EXPECT_EQ(p.ids, (std::vector<int32_t>{1, 2}));
  EXPECT_NEAR(p.weights[0], 1.0 / z, 1e-7);
  EXPECT_NEAR(p.weights[1], std::exp(-1.0) / z, 1e-7);
  r.norm_topk = true;  // Mixtral: the two weights are a softmax over the two chosen logits
  p = pick(logits, r);
  EXPECT_NEAR(p.weights[0], 1.0 / (1.0 + std::exp(-1.0)), 1e-7);
  EXPECT_NEAR(p.weights[1], 1.0 / (1.0 + std::exp(1.0)), 1e-7);
  r.norm_topk = false;
  r.routed_scale = 2.5f;  // DeepSeek-V2's routed_scaling_factor
  p = pick(logits, r);
  EXPECT_NEAR(p.weights[0], 2.5 / z, 1e-6);
}

TEST(MoeRouter, TiesGoToTheLowerExpert) {
  MoeRouting r;
  r.n_expert_used = 2;
  EXPECT_EQ(pick({1, 2, 2, 2}, r).ids, (std::vector<int32_t>{1, 2}));
}

TEST(MoeRouter, GroupLimitedGreedyKeepsTheBestGroups) {
  // Groups of two: {5, 0}, {4.9, 0}, {4.8, 4.7}, {0, 0}; by their best expert the top two groups
  // are the first two, so expert 4 (4.8) is not eligible and the third pick is expert 1 (0, the
  // lower of the tied zeros).
  const std::vector<float> logits = {5, 0, 4.9f, 0, 4.8f, 4.7f, 0, 0};
  MoeRouting r;
  r.n_expert_used = 3;
  EXPECT_EQ(pick(logits, r).ids, (std::vector<int32_t>{0, 2, 4}));  // greedy
  r.select = MoeRouting::Select::GroupLimited;
  r.n_group = 4;
  r.topk_group = 2;
  EXPECT_EQ(pick(logits, r).ids, (std::vector<int32_t>{0, 2, 1}));
  r.topk_group = 3;
  EXPECT_EQ(pick(logits, r).ids, (std::vector<int32_t>{0, 2, 4}));
}

}  // namespace
}  // namespace kestrel
