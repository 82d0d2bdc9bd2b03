#include "model/model_footprint.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <limits>
#include <optional>

#include "core/checked_int.h"
#include "core/error.h"
#include "io/gguf.h"
#include "io/hf_fields.h"
#include "model/quant_config.h"

namespace kestrel {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr int64_t kMaxDim = HfFields::kMaxDim;

// Bytes per parameter of a torch_dtype name.
std::optional<int64_t> torch_dtype_bytes(const std::string& name) {
  if (name == "float32" || name == "float") return 4;
  if (name == "float16" || name == "half" || name == "bfloat16") return 2;
  if (name.rfind("float8", 0) == 0 || name == "int8" || name == "uint8") return 1;
  return std::nullopt;
}

// Sum of the *.safetensors files directly in dir; sets *n_files.
int64_t safetensors_bytes(const fs::path& dir, int64_t* n_files) {
  std::error_code ec;
  fs::directory_iterator it(dir, ec);
  if (ec) throw Error(dir.string() + ": cannot list the folder: " + ec.message());
  int64_t total = 0;
  *n_files = 0;
  for (const auto& entry : it) {
    if (entry.path().extension() != ".safetensors" || !entry.is_regular_file(ec)) continue;
    const auto size = entry.file_size(ec);
    if (ec) throw Error(entry.path().string() + ": cannot read its size: " + ec.message());
    total = checked_add(total, static_cast<int64_t>(size), dir.string() + ": safetensors bytes");
    ++*n_files;
  }
  return total;
}

}  // namespace

ModelFootprint ModelFootprint::from_gguf(const GgufFile& f) {
  ModelFootprint fp;
  fp.path = f.path();
  fp.format = "gguf";
  fp.arch = f.get_string("general.architecture");
  const std::string a = fp.arch + ".";
  fp.n_layer = f.get_int_in(a + "block_count", 1, kMaxDim);
  if (f.has(a + "attention.kv_lora_rank")) {
    fp.kv_lora_rank = f.get_int_in(a + "attention.kv_lora_rank", 1, kMaxDim);
    fp.rope_dim = f.get_int_in(a + "rope.dimension_count", 1, kMaxDim);
  } else {
    const int64_t n_head = f.get_int_in(a + "attention.head_count", 1, kMaxDim);
    fp.n_head_kv = f.has(a + "attention.head_count_kv")
                       ? f.get_int_in(a + "attention.head_count_kv", 1, kMaxDim)
                       : n_head;
    if (f.has(a + "attention.key_length")) {
      fp.head_dim = f.get_int_in(a + "attention.key_length", 1, kMaxDim);
    } else {
      const int64_t n_embd = f.get_int_in(a + "embedding_length", 1, kMaxDim);
      if (n_embd % n_head != 0)
        throw Error(f.path() + ": " + a + "embedding_length " + std::to_string(n_embd) +
                    " is not a multiple of " + a + "attention.head_count " + std::to_string(n_head));
      fp.head_dim = n_embd / n_head;
    }
  }
  if (f.has(a + "context_length"))
    fp.n_ctx_train = f.get_int_in(a + "context_length", 1, std::numeric_limits<int64_t>::max());
  fp.weight_source = WeightSource::GgufTensors;
  for (const GgufTensorInfo& t : f.tensors())
    fp.weight_bytes =
        checked_add(fp.weight_bytes, static_cast<int64_t>(t.n_bytes), f.path() + ": tensor bytes");
  fp.n_weight_items = static_cast<int64_t>(f.tensors().size());
  return fp;
}

ModelFootprint ModelFootprint::from_hf_config(const std::string& path) {
  std::error_code ec;
  const std::string config_path =
      fs::is_directory(path, ec) ? (fs::path(path) / "config.json").string() : path;
  const json j = read_json_file(config_path);
  const HfFields c(j, config_path);
  if (!j.is_object()) c.fail("expected a JSON object, got " + std::string(j.type_name()));

  ModelFootprint fp;
  fp.path = config_path;
  fp.format = "hf";
  fp.arch = c.string_or("model_type", "");
  fp.n_layer = c.get("num_hidden_layers");
  if (c.has("kv_lora_rank")) {
    fp.kv_lora_rank = c.get("kv_lora_rank");
    fp.rope_dim = c.get("qk_rope_head_dim");
  } else {
    const int64_t n_head = c.get("num_attention_heads");
    fp.n_head_kv = c.get_or("num_key_value_heads", n_head);
    if (c.has("head_dim")) {
      fp.head_dim = c.get("head_dim");
    } else {
      const int64_t hidden = c.get("hidden_size");
      if (hidden % n_head != 0)
        c.fail("hidden_size " + std::to_string(hidden) + " is not a multiple of num_attention_heads " +
               std::to_string(n_head) + " (give head_dim)");
      fp.head_dim = hidden / n_head;
    }
  }
  fp.n_ctx_train = c.get_or("max_position_embeddings", 0);

  fs::path dir = fs::path(config_path).parent_path();
  if (dir.empty()) dir = ".";
  fp.weight_bytes = safetensors_bytes(dir, &fp.n_weight_items);
  if (fp.n_weight_items > 0) {
    fp.weight_source = WeightSource::SafetensorsFiles;
    return fp;
  }
  fp.weight_source = WeightSource::ConfigEstimate;
  // transformers >= 4.56 writes "dtype"; older versions "torch_dtype".
  const char* dtype_key = c.has("torch_dtype") ? "torch_dtype" : "dtype";
  if (!c.has(dtype_key))
    c.fail("missing field 'torch_dtype' (needed to estimate the weight bytes: no *.safetensors files in " +
           dir.string() + ")");
  fp.weight_dtype = c.string_or(dtype_key, "");
  const auto bytes = torch_dtype_bytes(fp.weight_dtype);
  if (!bytes) c.fail("unknown " + std::string(dtype_key) + " '" + fp.weight_dtype + "'");
  fp.n_params = hf_parameter_count(j, config_path);
  fp.weight_bytes = checked_mul(fp.n_params, *bytes, config_path + ": weight bytes");
  const QuantConfig quant = QuantConfig::from_json(j, config_path);
  if (quant.quantized()) {
    // The projections are stored quantized; embeddings, the output head (unless GPTQ's lm_head),
    // norms and biases stay in torch_dtype. Per quantized weight: bits / 8 bytes of code, plus per
    // group (GPTQ / AWQ) an f16 scale and a packed zero of `bits`; FP8: one byte (its per-channel
    // or per-block scales are below a thousandth of that and left out).
    const int64_t hidden = HfFields(j, config_path).get("hidden_size");
    const int64_t vocab = HfFields(j, config_path).get("vocab_size");
    const int64_t n_matrices = HfFields(j, config_path).flag_or("tie_word_embeddings", false) ? 1 : 2;
    const int64_t float_params = std::min(fp.n_params, vocab * hidden * (quant.lm_head ? 1 : n_matrices) +
                                                           hidden * (2 * fp.n_layer + 1));
    const int64_t quant_params = fp.n_params - float_params;
    double per_weight = 1.0;
    if (quant.method != QuantMethod::Fp8) {
      per_weight = quant.bits / 8.0;
      if (quant.group_size > 0) per_weight += (2.0 + quant.bits / 8.0) / static_cast<double>(quant.group_size);
    }
    fp.weight_bytes = checked_add(checked_mul(float_params, *bytes, config_path + ": weight bytes"),
                                  static_cast<int64_t>(std::ceil(static_cast<double>(quant_params) * per_weight)),
                                  config_path + ": weight bytes");
    fp.weight_dtype = std::string(quant_method_name(quant.method)) + " " +
                      (quant.method == QuantMethod::Fp8 ? "8" : std::to_string(quant.bits)) + "-bit projections, " +
                      fp.weight_dtype + " embeddings";
  }
  return fp;
}

int64_t hf_parameter_count(const json& config, const std::string& where) {
  const HfFields c(config, where);
  if (!config.is_object()) c.fail("expected a JSON object, got " + std::string(config.type_name()));
  const std::string what = where + ": parameter count";
  auto mul = [&](std::initializer_list<int64_t> xs) {
    int64_t r = 1;
    for (int64_t x : xs) r = checked_mul(r, x, what);
    return r;
  };
  auto add = [&](std::initializer_list<int64_t> xs) {
    int64_t r = 0;
    for (int64_t x : xs) r = checked_add(r, x, what);
    return r;
  };
  const int64_t hidden = c.get("hidden_size");
  const int64_t n_vocab = c.get("vocab_size");
  const int64_t n_layer = c.get("num_hidden_layers");
  const int64_t n_head = c.get("num_attention_heads");
  const bool tied = c.flag_or("tie_word_embeddings", false);

  int64_t attn = 0;  // per layer
  if (c.has("kv_lora_rank")) {
    // DeepSeek-V2 MLA: q through an optional low-rank q_lora_rank bottleneck (with its norm);
    // kv_a projects to the latent + RoPE key, kv_b expands the latent to per-head K (nope part)
    // and V; the latent has its own norm.
    const int64_t kv_rank = c.get("kv_lora_rank");
    const int64_t rope = c.get("qk_rope_head_dim");
    const int64_t nope = c.get("qk_nope_head_dim");
    const int64_t v_dim = c.get("v_head_dim");
    const int64_t q_rank = c.get_or("q_lora_rank", 0);
    const int64_t q_width = mul({n_head, add({nope, rope})});
    const int64_t q =
        q_rank > 0 ? add({mul({hidden, q_rank}), q_rank, mul({q_rank, q_width})}) : mul({hidden, q_width});
    attn = add({q, mul({hidden, add({kv_rank, rope})}), kv_rank, mul({kv_rank, n_head, add({nope, v_dim})}),
                mul({n_head, v_dim, hidden})});
  } else {
    const int64_t n_head_kv = c.get_or("num_key_value_heads", n_head);
    const int64_t head_dim = c.has("head_dim") ? c.get("head_dim") : hidden / n_head;
    attn = add({mul({2, hidden, n_head, head_dim}), mul({2, hidden, n_head_kv, head_dim})});
    if (c.flag_or("attention_bias", false) || c.string_or("model_type", "") == "qwen2")
      attn = add({attn, mul({add({n_head, mul({2, n_head_kv})}), head_dim})});
  }

  int64_t n_experts = 0;
  for (const char* key : {"num_local_experts", "n_routed_experts", "num_experts"})
    if (n_experts == 0) n_experts = c.get_or(key, 0, 0);
  int64_t n_dense = n_layer;
  int64_t moe_mlp = 0;
  if (n_experts > 0) {
    n_dense = std::min(n_layer, c.get_or("first_k_dense_replace", 0, 0));
    const int64_t ff =
        c.has("moe_intermediate_size") ? c.get("moe_intermediate_size") : c.get("intermediate_size");
    const int64_t n_shared = c.get_or("n_shared_experts", 0, 0);
    moe_mlp =
        add({mul({n_experts, 3, hidden, ff}), mul({hidden, n_experts}), mul({n_shared, 3, hidden, ff})});
  }
  const int64_t dense_mlp = n_dense > 0 ? mul({3, hidden, c.get("intermediate_size")}) : 0;

  const int64_t norms = mul({2, hidden});
  const int64_t layers =
      add({mul({n_layer, add({attn, norms})}), mul({n_dense, dense_mlp}), mul({n_layer - n_dense, moe_mlp})});
  return add({mul({tied ? 1 : 2, n_vocab, hidden}), layers, hidden});
}

}  // namespace kestrel
