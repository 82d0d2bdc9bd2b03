// A model's weights by role: the tensors an architecture's builder names (WeightId{layer, role}),
// each viewed in place in the mapped model file (matrices in their file type) or converted to f32
// (norm vectors, biases). Which roles a model has is its architecture's tensor list
// (Architecture::tensors), read by both loaders; the backends look tensors up here by role, so an
// architecture with new tensors adds roles, not backend fields.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/tensor.h"

namespace kestrel {

// The tensors an architecture names. Stored roles are one tensor each; group roles name several
// projections of one input that a backend may run as one (parts()). Layer -1 holds the
// model-level tensors.
enum class WeightRole : uint8_t {
  TokenEmbd,   // [n_vocab, d] token embedding (layer -1)
  OutputNorm,  // [d] final RMSNorm weight (layer -1)
  Output,      // [n_vocab, d] the LM head (layer -1; the embedding's view when tied)
  AttnNorm,    // [d] RMSNorm weight before attention
  Q,           // [q_dim, d]
  K,           // [kv_dim, d]
  V,           // [kv_dim, d]
  AttnOut,     // [d, q_dim] the output projection
  FfnNorm,     // [d] RMSNorm weight before the MLP
  Gate,        // [n_ff, d]
  Up,          // [n_ff, d]
  Down,        // [d, n_ff]
  // Gemma 3's extra norms ([head_dim] on each q / k head before RoPE; [d] on the block outputs).
  QNorm,
  KNorm,
  PostAttnNorm,
  PostFfnNorm,
  // Mixture of experts (MoeHparams): E routed experts of width f, a shared expert of width s.
  Router,      // [E, d] router logits
  ExpGate,     // E experts of [f, d] (LayerTensor::experts)
  ExpUp,       // E experts of [f, d]
  ExpDown,     // E experts of [d, f]
  ShGate,      // [s, d]
  ShUp,        // [s, d]
  ShDown,      // [d, s]
  ShRouter,    // [1, d] the shared expert's gate (Qwen2-MoE: output times sigmoid(x . w))
  // Multi-head latent attention (MlaHparams; r = kv_lora_rank, H heads).
  QA,          // [q_lora_rank, d] low-rank query down-projection
  QANorm,      // [q_lora_rank] its RMSNorm weight
  QB,          // [H (qk_nope + qk_rope), q_lora_rank]
  KvA,         // [r + qk_rope, d]: the latent and the RoPE key
  KvANorm,     // [r] the latent's RMSNorm weight
  KvB,         // [H (qk_nope + v_head_dim), r]: per head W_UK (qk_nope rows) then W_UV (v_head_dim rows)
  // Groups.
  Qkv,       // Q, K, V
  GateUp,    // Gate, Up
  ShGateUp,  // ShGate, ShUp
  kCount,
};
inline constexpr size_t kWeightRoleCount = static_cast<size_t>(WeightRole::kCount);

struct WeightId {
  int32_t layer;
  WeightRole role;
};

// The stored roles of a group, in output-row order ({role} for a stored role).
std::span<const WeightRole> parts(WeightRole role);
// "attn_norm", "q", ..., for errors.
std::string_view weight_role_name(WeightRole role);

// One stored tensor: a matrix or a vector, with an optional bias, or a set of expert matrices.
struct LayerTensor {
  WeightView matrix;          // [n_out rows, n_in] in its file type; n_out 0 for a vector
  std::vector<float> vector;  // a norm weight [d], f32; empty for a matrix
  std::vector<float> bias;    // [n_out] f32, or empty
  std::vector<WeightView> experts;  // ExpGate/ExpUp/ExpDown: one [n_out, n_in] matrix per expert
};

class ModelWeights {
 public:
  void resize(int64_t n_layer) { t_.assign(static_cast<size_t>(n_layer + 1), {}); }
  int64_t n_layer() const { return static_cast<int64_t>(t_.size()) - 1; }
  // The tensor of a stored role, or null when the model has none (an optional tensor).
  const LayerTensor* find(WeightId id) const;
  // find(), and throws kestrel::Error naming the layer and role when it is absent.
  const LayerTensor& at(WeightId id) const;
  void put(WeightId id, LayerTensor t);

  bool tied_output = false;              // Output is TokenEmbd's view
  // A tensor-parallel shard's first vocabulary row: its TokenEmbd and Output hold token ids
  // [vocab_begin, vocab_begin + n_out) (LlamaModel::tensor_parallel_shard); 0 for a whole model.
  int64_t vocab_begin = 0;
  std::vector<float> rope_freq_factors;  // [rope_dim/2] divisors of the RoPE frequencies (Llama 3 scaling), or empty

 private:
  std::vector<std::array<std::optional<LayerTensor>, kWeightRoleCount>> t_;  // [n_layer + 1], layer -1 first
};

}  // namespace kestrel
