#include "model/hparams.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "core/error.h"
#include "io/gguf.h"
#include "model/forward_ops.h"

namespace kestrel {

bool MoeHparams::is_moe_layer(int64_t layer) const {
  if (!enabled() || layer < first_dense || (layer + 1) % sparse_step != 0) return false;
  for (int64_t d : dense_layers)
    if (d == layer) return false;
  return true;
}

float ModelHparams::softmax_scale() const {
  return attn_scale > 0 ? attn_scale : 1.0f / std::sqrt(static_cast<float>(head_dim));
}

namespace {

// DeepSeek-V2's keys as llama.cpp's converter writes them: the MLA ranks (attention.q_lora_rank,
// absent or 0 without the query's low rank; attention.kv_lora_rank); the heads' dims (files written
// since llama.cpp's MLA rework carry attention.key_length_mla / value_length_mla and give
// key_length / value_length the latent's widths; older files carry the heads' dims in key_length /
// value_length); rope.dimension_count = qk_rope_head_dim; the MoE fields leading_dense_block_count,
// expert_shared_count (shared experts of expert_feed_forward_length each), expert_weights_norm
// (absent: no renormalisation, as V2's router), expert_gating_func (1 = softmax; 2, sigmoid, is
// DeepSeek-V3's) and expert_group_count / expert_group_used_count (group-limited greedy); and
// YaRN's rope.scaling.yarn_log_multiplier = 0.1 mscale_all_dim, which makes the softmax scale
// mscale^2 / sqrt(head_dim) with mscale = 1 + yarn_log_multiplier ln(factor), as the HF config's
// mscale_all_dim does (read_yarn in hf_config.cpp).
void read_deepseek2_gguf(const GgufFile& f, ModelHparams& hp) {
  const std::string a = "deepseek2.";
  MlaHparams& mla = hp.mla;
  mla.q_lora_rank = f.get_int_or(a + "attention.q_lora_rank", 0);
  mla.kv_lora_rank = f.get_int_in(a + "attention.kv_lora_rank", 1, 8192);
  mla.qk_rope = hp.rope_dim;
  const std::string key = f.has(a + "attention.key_length_mla") ? "attention.key_length_mla" : "attention.key_length";
  const std::string value =
      f.has(a + "attention.value_length_mla") ? "attention.value_length_mla" : "attention.value_length";
  hp.head_dim = f.get_int(a + key);
  mla.qk_nope = hp.head_dim - mla.qk_rope;
  mla.v_head_dim = f.get_int(a + value);
  hp.n_head_kv = hp.n_head;  // every head reads the one cached latent (files may say 1)
  hp.rope_style = RopeStyle::AdjacentPairs;
  MoeHparams& moe = hp.moe;
  if (moe.enabled()) {
    moe.first_dense = f.get_int_or(a + "leading_dense_block_count", 0);
    const int64_t shared = f.has(a + "expert_shared_count") ? f.get_int_in(a + "expert_shared_count", 0, 1024) : 0;
    // An expert width out of range fails validate() by name; no product of it is formed.
    moe.n_ff_shared = moe.n_ff_expert > 0 && moe.n_ff_expert <= (1 << 20) ? shared * moe.n_ff_expert : 0;
    moe.routing.norm_topk = f.get_bool_or(a + "expert_weights_norm", false);
    if (const int64_t gating = f.get_int_or(a + "expert_gating_func", 1); gating != 1)
      throw Error(f.path() + ": " + a + "expert_gating_func " + std::to_string(gating) +
                  " is not supported (1, softmax; sigmoid gating is DeepSeek-V3's)");
    if (const int64_t groups = f.get_int_or(a + "expert_group_count", 1); groups > 1) {
      moe.routing.select = MoeRouting::Select::GroupLimited;
      moe.routing.n_group = static_cast<int32_t>(std::min<int64_t>(groups, 1 << 20));
      moe.routing.topk_group = static_cast<int32_t>(f.get_int_in(a + "expert_group_used_count", 1, groups));
    }
  }
  if (hp.yarn_factor > 0) {
    const double log_mul = f.get_float_or(a + "rope.scaling.yarn_log_multiplier", 0.0);
    if (log_mul != 0 && hp.head_dim > 0) {
      const double m = 1.0 + log_mul * std::log(hp.yarn_factor);
      hp.attn_scale = static_cast<float>(m * m / std::sqrt(static_cast<double>(hp.head_dim)));
    }
  }
}

}  // namespace

ModelHparams ModelHparams::from_gguf(const GgufFile& f) {
  ModelHparams hp;
  hp.arch = f.get_string("general.architecture");
  try {
    architecture(hp.arch);  // one the registry knows
  } catch (const Error& e) {
    throw Error(f.path() + ": " + e.what());
  }
  const std::string a = hp.arch + ".";
  hp.name = f.get_string_or("general.name", "");
  hp.n_embd = f.get_int(a + "embedding_length");
  hp.n_layer = f.get_int(a + "block_count");
  hp.n_head = f.get_int(a + "attention.head_count");
  hp.n_head_kv = f.get_int_or(a + "attention.head_count_kv", hp.n_head);
  hp.n_ff = f.get_int(a + "feed_forward_length");
  hp.n_ctx_train = f.get_int_or(a + "context_length", 2048);
  hp.rms_eps = static_cast<float>(f.get_float_or(a + "attention.layer_norm_rms_epsilon", 1e-5));
  hp.rope_theta = static_cast<float>(f.get_float_or(a + "rope.freq_base", 10000.0));
  if (hp.n_head <= 0) throw Error(f.path() + ": " + a + "attention.head_count must be positive");
  hp.head_dim = f.get_int_or(a + "attention.key_length", hp.n_embd / hp.n_head);
  hp.rope_dim = f.get_int_or(a + "rope.dimension_count", hp.head_dim);
  const std::string scaling = f.get_string_or(a + "rope.scaling.type", "none");
  if (scaling == "linear") {
    hp.rope_linear_scale = static_cast<float>(f.get_float_or(a + "rope.scaling.factor", 1.0));
  } else if (scaling == "yarn" && hp.arch == "deepseek2") {
    hp.yarn_factor = f.get_float_or(a + "rope.scaling.factor", 0.0);
    hp.yarn_original_ctx = f.get_float_or(a + "rope.scaling.original_context_length", 0.0);
    if (!(hp.yarn_factor > 0) || !(hp.yarn_original_ctx > 0))
      throw Error(f.path() + ": yarn rope scaling needs a positive " + a + "rope.scaling.factor and " + a +
                  "rope.scaling.original_context_length");
  } else if (scaling != "none") {
    throw Error(f.path() + ": unsupported " + a + "rope.scaling.type '" + scaling + "'" +
                (scaling == "yarn" ? " for " + hp.arch + " (yarn is read for deepseek2)" : ""));
  }
  hp.rope_style = hp.arch == "qwen2" || hp.arch == "qwen2moe" || hp.arch == "gemma3" ? RopeStyle::RotateHalf
                                                                                    : RopeStyle::AdjacentPairs;
  if (hp.arch == "gemma3") {
    // What llama.cpp's gemma3 loader fixes in code rather than reading from the file: every sixth
    // layer global, the local layers' RoPE base 10000 (rope.freq_base_swa in newer files), the
    // embedding scaled by sqrt(n_embd), and the softmax scale query_pre_attn_scalar^-0.5, which is
    // head_dim except in the 27B model (62 layers: n_embd / n_head).
    hp.sliding_window = f.get_int_or(a + "attention.sliding_window", 0);
    hp.swa_pattern = 6;
    hp.rope_theta_swa = static_cast<float>(f.get_float_or(a + "rope.freq_base_swa", 10000.0));
    hp.embd_scale = std::sqrt(static_cast<float>(hp.n_embd));
    if (hp.n_layer == 62) hp.attn_scale = 1.0f / std::sqrt(static_cast<float>(hp.n_embd / hp.n_head));
  }
  // Mixture of experts, as llama.cpp's converter writes it: Mixtral is "llama" with expert_count
  // and feed_forward_length the expert width; qwen2moe adds expert_feed_forward_length and the
  // shared expert's expert_shared_feed_forward_length (sigmoid-gated, top-k not renormalised).
  if (const int64_t n_expert = f.get_int_or(a + "expert_count", 0); n_expert > 0) {
    MoeHparams& moe = hp.moe;
    moe.routing.n_expert = static_cast<int32_t>(std::min<int64_t>(n_expert, 1 << 20));
    moe.routing.n_expert_used = static_cast<int32_t>(f.get_int_in(a + "expert_used_count", 1, n_expert));
    moe.n_ff_expert = f.get_int_or(a + "expert_feed_forward_length", hp.n_ff);
    moe.n_ff_shared = f.get_int_or(a + "expert_shared_feed_forward_length", 0);
    moe.shared_gate = hp.arch == "qwen2moe" && moe.n_ff_shared > 0;
    moe.routing.norm_topk = f.get_bool_or(a + "expert_weights_norm", hp.arch != "qwen2moe");
    moe.routing.routed_scale = static_cast<float>(f.get_float_or(a + "expert_weights_scale", 1.0));
  }
  if (hp.arch == "deepseek2") read_deepseek2_gguf(f, hp);
  if (const auto* tokens = f.find("tokenizer.ggml.tokens"); tokens != nullptr)
    hp.n_vocab = static_cast<int64_t>(tokens->array_size());
  hp.n_vocab = f.get_int_or(a + "vocab_size", hp.n_vocab);
  try {
    hp.validate();
  } catch (const Error& e) {
    throw Error(f.path() + ": " + e.what());
  }
  return hp;
}

void ModelHparams::validate() const {
  auto require = [](bool ok, const std::string& what) {
    if (!ok) throw Error("invalid hyperparameters: " + what);
  };
  // Upper bounds keep a corrupt header from asking for absurd buffers before any weight is read.
  require(n_embd > 0 && n_embd <= (1 << 16), "embedding_length = " + std::to_string(n_embd));
  require(n_layer > 0 && n_layer <= 1024, "block_count = " + std::to_string(n_layer));
  require(n_head > 0 && n_head <= 1024, "head_count = " + std::to_string(n_head));
  require(n_head_kv > 0 && n_head % n_head_kv == 0,
          "head_count_kv = " + std::to_string(n_head_kv) + " must divide head_count " +
              std::to_string(n_head));
  require(head_dim > 0 && head_dim <= 1024 && head_dim % 2 == 0,
          "head dimension = " + std::to_string(head_dim));
  require(rope_dim > 0 && rope_dim <= head_dim && rope_dim % 2 == 0,
          "rope.dimension_count = " + std::to_string(rope_dim));
  require(n_ff > 0 && n_ff <= (1 << 20), "feed_forward_length = " + std::to_string(n_ff));
  require(n_vocab > 0 && n_vocab <= (1 << 24), "vocabulary size = " + std::to_string(n_vocab));
  require(n_ctx_train > 0, "context_length = " + std::to_string(n_ctx_train));
  require(std::isfinite(rms_eps) && rms_eps > 0, "layer_norm_rms_epsilon = " + std::to_string(rms_eps));
  require(std::isfinite(rope_theta) && rope_theta > 0, "rope.freq_base = " + std::to_string(rope_theta));
  require(std::isfinite(rope_linear_scale) && rope_linear_scale > 0,
          "rope.scaling.factor = " + std::to_string(rope_linear_scale));
  require(sliding_window >= 0 && swa_pattern >= 0 && std::isfinite(rope_theta_swa) && rope_theta_swa >= 0,
          "sliding window " + std::to_string(sliding_window) + ", pattern " + std::to_string(swa_pattern) +
              ", local RoPE base " + std::to_string(rope_theta_swa));
  require(std::isfinite(embd_scale) && embd_scale > 0, "embedding scale = " + std::to_string(embd_scale));
  require(std::isfinite(attn_scale) && attn_scale >= 0, "attention scale = " + std::to_string(attn_scale));
  if (mla.enabled()) {
    require(mla.kv_lora_rank <= 8192 && mla.q_lora_rank >= 0 && mla.q_lora_rank <= 65536,
            "MLA ranks: kv_lora_rank " + std::to_string(mla.kv_lora_rank) + ", q_lora_rank " +
                std::to_string(mla.q_lora_rank));
    require(mla.qk_nope > 0 && mla.qk_nope <= 1024 && mla.v_head_dim > 0 && mla.v_head_dim <= 1024,
            "MLA head widths: qk_nope_head_dim " + std::to_string(mla.qk_nope) + ", v_head_dim " +
                std::to_string(mla.v_head_dim));
    require(mla.qk_rope == rope_dim && head_dim == mla.qk_nope + mla.qk_rope,
            "MLA: head_dim " + std::to_string(head_dim) + " must be qk_nope_head_dim + qk_rope_head_dim (" +
                std::to_string(mla.qk_nope) + " + " + std::to_string(mla.qk_rope) + ")");
  }
  if (moe.enabled()) {
    const MoeRouting& r = moe.routing;
    require(r.n_expert <= 1024, "expert_count = " + std::to_string(r.n_expert));
    require(r.n_expert_used > 0 && r.n_expert_used <= r.n_expert,
            "expert_used_count = " + std::to_string(r.n_expert_used) + " must be in [1, expert_count " +
                std::to_string(r.n_expert) + "]");
    require(moe.n_ff_expert > 0 && moe.n_ff_expert <= (1 << 20),
            "expert_feed_forward_length = " + std::to_string(moe.n_ff_expert));
    require(moe.n_ff_shared >= 0 && moe.n_ff_shared <= (1 << 20),
            "expert_shared_feed_forward_length = " + std::to_string(moe.n_ff_shared));
    require(!moe.shared_gate || moe.n_ff_shared > 0, "a shared-expert gate without a shared expert");
    require(moe.first_dense >= 0 && moe.first_dense <= n_layer,
            "leading_dense_block_count = " + std::to_string(moe.first_dense));
    require(moe.sparse_step > 0, "decoder_sparse_step = " + std::to_string(moe.sparse_step));
    require(std::isfinite(r.routed_scale) && r.routed_scale > 0,
            "expert_weights_scale = " + std::to_string(r.routed_scale));
    if (r.select == MoeRouting::Select::GroupLimited)
      require(r.n_group > 0 && r.n_expert % r.n_group == 0 && r.topk_group > 0 && r.topk_group <= r.n_group &&
                  r.topk_group * (r.n_expert / r.n_group) >= r.n_expert_used,
              "expert groups: n_group " + std::to_string(r.n_group) + ", topk_group " +
                  std::to_string(r.topk_group) + " for " + std::to_string(r.n_expert) + " experts, top-" +
                  std::to_string(r.n_expert_used));
  }
}

std::string ModelHparams::summary() const {
  std::ostringstream s;
  s << arch << ": " << n_layer << " layers, n_embd " << n_embd << ", " << n_head << " heads / "
    << n_head_kv << " KV heads (head_dim " << head_dim << "), FFN " << n_ff << ", vocab " << n_vocab
    << ", context " << n_ctx_train;
  if (sliding_window > 0 && swa_pattern > 0) {
    s << ", sliding window " << sliding_window << " in " << swa_pattern - 1 << " of every " << swa_pattern << " layers";
  } else if (sliding_window > 0) {
    s << ", sliding window " << sliding_window;
  }
  if (mla.enabled()) s << ", MLA latent " << mla.kv_lora_rank << " + rope " << mla.qk_rope;
  if (moe.enabled()) {
    s << ", MoE " << moe.routing.n_expert << " experts top-" << moe.routing.n_expert_used << " (FFN "
      << moe.n_ff_expert << ")";
    if (moe.n_ff_shared > 0) s << " + shared FFN " << moe.n_ff_shared;
  }
  s << ", rope theta " << rope_theta;
  return s.str();
}

std::vector<float> rope_inv_freq(const ModelHparams& hp, const std::vector<float>& freq_factors) {
  return rope_inv_freq(hp, hp.rope_theta, freq_factors);
}

std::vector<float> rope_inv_freq(const ModelHparams& hp, double theta, const std::vector<float>& freq_factors) {
  const int64_t half = hp.rope_dim / 2;
  std::vector<float> inv(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i) {
    double f = std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(hp.rope_dim));
    if (!freq_factors.empty()) f /= freq_factors[static_cast<size_t>(i)];
    inv[static_cast<size_t>(i)] = static_cast<float>(f);
  }
  return inv;
}

}  // namespace kestrel
