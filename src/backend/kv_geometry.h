// The KV cache geometry of a model: what one token leaves in the cache per layer (K and V heads,
// or MLA's latent + RoPE key). Here, not in src/model, because the model layer does not depend on
// the memory layer; the backends and the engine, which size KV pools, see both.
#pragma once

#include "memory/kv_planner.h"
#include "model/hparams.h"

namespace kestrel {

KvGeometry kv_geometry(const ModelHparams& hp);

}  // namespace kestrel
