// The architecture builders (one file each) that the registry (src/model/architecture.cpp) lists.
#pragma once

#include "model/forward_ops.h"

namespace kestrel::archs {

// llama.cpp: llama, qwen2, mistral, mixtral, qwen2moe
void llama_forward(ForwardOps& ops, const ModelHparams& hp);
std::vector<TensorSpec> llama_tensors(const ModelHparams& hp, int32_t layer);

}  // namespace kestrel::archs
