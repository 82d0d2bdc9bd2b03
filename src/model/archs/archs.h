// The architecture builders (one file each) that the registry (src/model/architecture.cpp) lists.
#pragma once

#include "model/forward_ops.h"

namespace kestrel::archs {

void llama_forward(ForwardOps& ops, const ModelHparams& hp);  // llama.cpp: llama, qwen2, mistral

}  // namespace kestrel::archs
