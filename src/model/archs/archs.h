// The architecture builders (one file each) that the registry (src/model/architecture.cpp) lists.
#pragma once

#include "model/forward_ops.h"

namespace kestrel::archs {

// The model-level tensors every decoder has: token embedding, final norm (norm_hf_add: see
// TensorSpec::hf_add), LM head (absent = tied).
std::vector<TensorSpec> model_tensors(const ModelHparams& hp, float norm_hf_add = 0);
// The FFN half of a decoder block (shared by the builders): residual += attention output, RMSNorm,
// then the dense SwiGLU MLP or, in the model's MoE layers, moe_ffn -> Act::Down.
void ffn_block(ForwardOps& ops, const ModelHparams& hp, int32_t layer);
// Transformers' names of an MoE layer's FFN under "model.layers.N.": the MoE module ("mlp."),
// the expert projections, the shared expert module ("shared_expert.").
struct HfFfnNames {
  std::string moe, expert_gate, expert_up, expert_down, shared;
};
// The FFN tensors of `layer` (dense, or router + experts + shared expert), GGUF names as llama.cpp's.
void add_ffn_tensors(std::vector<TensorSpec>& t, const ModelHparams& hp, int32_t layer, const HfFfnNames& names);

// llama.cpp: llama, qwen2, mistral, mixtral, qwen2moe
void llama_forward(ForwardOps& ops, const ModelHparams& hp);
std::vector<TensorSpec> llama_tensors(const ModelHparams& hp, int32_t layer);

// deepseek2.cpp: DeepSeek-V2 (MLA attention, MoE with shared experts, leading dense layers)
void deepseek2_forward(ForwardOps& ops, const ModelHparams& hp);
std::vector<TensorSpec> deepseek2_tensors(const ModelHparams& hp, int32_t layer);

// gemma3.cpp: Gemma 3 (QK-norm, post-norms, GeGLU, local and global layers)
void gemma3_forward(ForwardOps& ops, const ModelHparams& hp);
std::vector<TensorSpec> gemma3_tensors(const ModelHparams& hp, int32_t layer);

}  // namespace kestrel::archs
