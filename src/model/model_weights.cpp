#include "model/model_weights.h"

#include "core/error.h"

namespace kestrel {

namespace {
constexpr WeightRole kQkv[] = {WeightRole::Q, WeightRole::K, WeightRole::V};
constexpr WeightRole kGateUp[] = {WeightRole::Gate, WeightRole::Up};
constexpr WeightRole kShGateUp[] = {WeightRole::ShGate, WeightRole::ShUp};
constexpr std::array<WeightRole, kWeightRoleCount> kSelf = [] {
  std::array<WeightRole, kWeightRoleCount> a{};
  for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<WeightRole>(i);
  return a;
}();
constexpr std::array<std::string_view, kWeightRoleCount> kNames = {
    "token_embd", "output_norm", "output", "attn_norm", "q", "k", "v", "attn_out",
    "ffn_norm",   "gate",        "up",     "down",      "q_norm", "k_norm", "post_attn_norm", "post_ffn_norm", "router", "expert_gate", "expert_up",
    "expert_down", "shared_gate", "shared_up", "shared_down", "shared_router", "q_a", "q_a_norm", "q_b", "kv_a", "kv_a_norm", "kv_b", "qkv", "gate_up",
    "shared_gate_up"};
}  // namespace

std::span<const WeightRole> parts(WeightRole role) {
  switch (role) {
    case WeightRole::Qkv: return kQkv;
    case WeightRole::GateUp: return kGateUp;
    case WeightRole::ShGateUp: return kShGateUp;
    default: return {&kSelf[static_cast<size_t>(role)], 1};
  }
}

std::string_view weight_role_name(WeightRole role) {
  const auto i = static_cast<size_t>(role);
  return i < kNames.size() ? kNames[i] : "?";
}

const LayerTensor* ModelWeights::find(WeightId id) const {
  const auto l = static_cast<size_t>(id.layer + 1);
  const auto r = static_cast<size_t>(id.role);
  if (l >= t_.size() || r >= kWeightRoleCount || !t_[l][r]) return nullptr;
  return &*t_[l][r];
}

const LayerTensor& ModelWeights::at(WeightId id) const {
  if (const LayerTensor* t = find(id)) return *t;
  throw Error("the model has no '" + std::string(weight_role_name(id.role)) + "' tensor" +
              (id.layer < 0 ? std::string() : " in layer " + std::to_string(id.layer)));
}

void ModelWeights::put(WeightId id, LayerTensor t) {
  const auto l = static_cast<size_t>(id.layer + 1);
  const auto r = static_cast<size_t>(id.role);
  KESTREL_ASSERT(l < t_.size() && r < kWeightRoleCount && parts(id.role).size() == 1,
                 "ModelWeights::put: a stored role of a layer in range");
  t_[l][r] = std::move(t);
}

}  // namespace kestrel
