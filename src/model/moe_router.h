// Top-k expert selection of a mixture-of-experts layer for one token, from the router's logits, as
// the reference implementations choose: Mixtral (softmax, top-k renormalised over the chosen;
// transformers MixtralTopKRouter), Qwen2-MoE (softmax, top-k not renormalised: norm_topk_prob
// false), DeepSeek-V2 (softmax; greedy or group-limited greedy: the experts split into n_group
// groups, a group scored by its best expert, only the topk_group best groups eligible; the weights
// times routed_scaling_factor). Shared by both backends, so they route identically.
#pragma once

#include <cstdint>

namespace kestrel {

struct MoeRouting {
  int32_t n_expert = 0;       // routed experts
  int32_t n_expert_used = 0;  // k: experts per token
  enum class Select : uint8_t { Greedy, GroupLimited } select = Select::Greedy;
  int32_t n_group = 1;        // GroupLimited: groups of n_expert / n_group experts
  int32_t topk_group = 1;     // GroupLimited: groups eligible per token
  bool norm_topk = false;     // divide the k weights by their sum
  float routed_scale = 1.0f;  // multiply the k weights (DeepSeek's routed_scaling_factor)
};

// ids[0..k) = the chosen experts, best first (ties to the lower id); weights[0..k) their mixing
// weights: softmax probabilities over all n_expert logits, renormalised over the k when
// norm_topk, times routed_scale. Computed in double, returned as f32.
void moe_select(const float* logits, const MoeRouting& r, int32_t* ids, float* weights);

}  // namespace kestrel
