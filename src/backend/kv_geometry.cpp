#include "backend/kv_geometry.h"

namespace kestrel {

KvGeometry kv_geometry(const ModelHparams& hp) {
  KvGeometry g;
  g.n_layer = hp.n_layer;
  if (hp.mla.enabled()) {
    g.kv_lora_rank = hp.mla.kv_lora_rank;
    g.rope_dim = hp.mla.qk_rope;
  } else {
    g.n_head_kv = hp.n_head_kv;
    g.head_dim = hp.head_dim;
  }
  return g;
}

}  // namespace kestrel
