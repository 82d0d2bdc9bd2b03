#include <algorithm>
#include <array>

#include "core/error.h"
#include "model/archs/archs.h"
#include "model/forward_ops.h"

namespace kestrel {

namespace {
// Explicit, so a static library never drops a builder the way it drops an unreferenced
// self-registering object file.
constexpr std::array<Architecture, 7> kArchitectures = {{
    {"llama", archs::llama_forward, archs::llama_tensors},
    {"mistral", archs::llama_forward, archs::llama_tensors},
    {"qwen2", archs::llama_forward, archs::llama_tensors},
    {"mixtral", archs::llama_forward, archs::llama_tensors},
    {"qwen2moe", archs::llama_forward, archs::llama_tensors},
    {"deepseek2", archs::deepseek2_forward, archs::deepseek2_tensors},
    {"gemma3", archs::gemma3_forward, archs::gemma3_tensors},
}};
}  // namespace

void ForwardOps::add_norm(Act, WeightId, Act) { throw Error("this backend does not implement add_norm"); }
void ForwardOps::mla_attention(int32_t, Act, Act) {
  throw Error("this backend does not run multi-head latent attention yet");
}
void ForwardOps::qk_norm(int32_t, Act) { throw Error("this backend does not implement qk_norm (QK-norm) yet"); }
void ForwardOps::norm(Act, WeightId) { throw Error("this backend does not implement norm yet"); }
void ForwardOps::geglu_linear(Act, WeightId, Act) { throw Error("this backend does not implement GeGLU yet"); }
void ForwardOps::moe_ffn(int32_t, Act, Act) {
  throw Error("this backend does not run mixture-of-experts layers yet");
}

const Architecture* find_architecture(std::string_view name) {
  const auto it = std::find_if(kArchitectures.begin(), kArchitectures.end(),
                               [&](const Architecture& a) { return a.name == name; });
  return it == kArchitectures.end() ? nullptr : &*it;
}

std::vector<std::string_view> architecture_names() {
  std::vector<std::string_view> names;
  for (const Architecture& a : kArchitectures) names.push_back(a.name);
  return names;
}

const Architecture& architecture(std::string_view name) {
  if (const Architecture* a = find_architecture(name)) return *a;
  std::string known;
  for (std::string_view n : architecture_names()) known += (known.empty() ? "" : ", ") + std::string(n);
  throw Error("unsupported architecture '" + std::string(name) + "' (supported: " + known + ")");
}

}  // namespace kestrel
