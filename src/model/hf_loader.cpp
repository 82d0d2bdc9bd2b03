// LlamaModel::load_hf_dir: a Hugging Face model folder into the same ModelWeights the GGUF path
// fills, tensor by tensor as the architecture lists them (Architecture::tensors: transformers'
// state-dict names). A PyTorch Linear weight is stored [out_features, in_features]
// row-major, which is WeightView's layout (n_out rows of n_in), so matrices are viewed in place.
// q_proj / k_proj rows stay in HF's order, which RoPE reads in rotate-half pairs (RopeStyle).
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <unordered_set>

#include "core/error.h"
#include "io/hf_fields.h"
#include "io/mapped_file.h"
#include "io/quoted.h"
#include "io/safetensors_checkpoint.h"
#include "model/forward_ops.h"
#include "model/hf_config.h"
#include "model/llama_weights.h"
#include "model/quant_config.h"
#include "model/quantized_matrix.h"

namespace kestrel {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// Checks and views the tensors of one checkpoint, counting the bytes used.
class HfTensorLoader {
 public:
  HfTensorLoader(const SafetensorsCheckpoint& ckpt, uint64_t& bytes) : ckpt_(ckpt), bytes_(bytes) {}

  bool has(const std::string& name) const { return ckpt_.find(name) != nullptr; }
  bool has_module(const std::string& prefix) const {
    return has(prefix + ".weight") || has(prefix + ".qweight");
  }

  // The [n_out, n_in] matrix of HF module `prefix`: prefix.weight in float viewed in place, or the
  // quantized tensors `quant` describes (kept in `store`, viewed through their f32 host copy).
  WeightView module_matrix(const std::string& prefix, int64_t n_in, int64_t n_out, const QuantConfig* quant,
                           QuantizedWeights* store) {
    if (quant == nullptr) return matrix(prefix + ".weight", n_in, n_out);
    std::vector<std::string> names;
    QuantizedMatrix m = read_quantized_matrix(ckpt_, prefix, *quant, n_in, n_out, names, bytes_);
    used_.insert(names.begin(), names.end());
    return store->add(std::move(m));
  }

  const SafetensorsTensor& require(const std::string& name) {
    const SafetensorsTensor* t = ckpt_.find(name);
    if (t == nullptr) {
      // A quantized checkpoint whose config.json lost its quantization_config: say so.
      const std::string stem = name.ends_with(".weight") ? name.substr(0, name.size() - 7) : std::string();
      if (!stem.empty() && (has(stem + ".qweight") || has(stem + ".weight_packed")))
        throw Error(ckpt_.dir() + ": missing tensor " + quoted_name(name) + "; the checkpoint holds " +
                    quoted_name(stem + (has(stem + ".qweight") ? ".qweight" : ".weight_packed")) +
                    ", a quantized layout, but config.json has no quantization_config to read it by");
      throw Error(ckpt_.dir() + ": missing tensor " + quoted_name(name));
    }
    used_.insert(name);
    return *t;
  }

  // Throws for a tensor that nothing read: a weight the model would silently go without (a bias
  // the config does not announce, another architecture's tensor). RoPE's inv_freq buffer of older
  // checkpoints and an lm_head.weight beside tied embeddings are not weights and are allowed.
  void check_all_used(const std::string& arch) const {
    for (const std::string& name : ckpt_.names()) {
      if (used_.count(name) != 0 || name == "lm_head.weight" || name.ends_with(".rotary_emb.inv_freq")) continue;
      throw Error(ckpt_.file_of(name) + ": tensor " + quoted_name(name) + " is not part of a " + arch +
                  " model as config.json describes it (a bias without attention_bias, or another architecture?)");
    }
  }

  // A [n_out, n_in] matrix of F32 / F16 / BF16, viewed in place.
  WeightView matrix(const std::string& name, int64_t n_in, int64_t n_out) {
    const SafetensorsTensor& t = require(name);
    if (t.shape != std::vector<int64_t>{n_out, n_in})
      fail(t, "has shape " + shape_text(t.shape) + ", expected [" + std::to_string(n_out) + ", " +
                  std::to_string(n_in) + "]");
    const GgmlType type = float_type(t);
    bytes_ += t.n_bytes();
    return WeightView{type, n_in, n_out, t.data};
  }

  // A [n] vector converted to f32.
  std::vector<float> vector(const std::string& name, int64_t n) {
    const SafetensorsTensor& t = require(name);
    if (t.shape != std::vector<int64_t>{n})
      fail(t, "has shape " + shape_text(t.shape) + ", expected [" + std::to_string(n) + "]");
    const GgmlType type = float_type(t);
    std::vector<float> out(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      if (type == GgmlType::F32) {
        std::memcpy(&out[static_cast<size_t>(i)], t.data + 4 * i, 4);
      } else {
        uint16_t h;
        std::memcpy(&h, t.data + 2 * i, 2);
        out[static_cast<size_t>(i)] = type == GgmlType::F16 ? fp16_to_fp32(h) : bf16_to_fp32(h);
      }
    }
    bytes_ += t.n_bytes();
    return out;
  }

 private:
  [[noreturn]] void fail(const SafetensorsTensor& t, const std::string& problem) const {
    throw Error(ckpt_.file_of(t.name) + ": tensor " + quoted_name(t.name) + " " + problem);
  }

  // The kernels' element type of t; its data must be aligned to whole elements, as the kernels
  // load them (the reference writer pads the header to 8 bytes, so real files always are).
  GgmlType float_type(const SafetensorsTensor& t) const {
    const auto type = to_ggml_type(t.dtype);
    if (!type)
      fail(t, "has dtype " + std::string(safetensors_dtype_name(t.dtype)) + ", expected F32, F16 or BF16");
    const size_t align = safetensors_dtype_size(t.dtype);
    if (reinterpret_cast<uintptr_t>(t.data) % align != 0)
      fail(t, "data at byte " + std::to_string(t.begin) + " of the data section is not aligned to its " +
                  std::to_string(align) + "-byte elements (is the header length a multiple of 8?)");
    return *type;
  }

  const SafetensorsCheckpoint& ckpt_;
  uint64_t& bytes_;
  std::unordered_set<std::string> used_;
};

// The chat template of a folder: tokenizer_config.json "chat_template" (a string, or a list of
// {name, template} of which "default" or else the first is taken), else chat_template.jinja, else
// chat_template.json {"chat_template": ...}; "" when there is none.
std::string read_chat_template(const fs::path& dir) {
  std::error_code ec;
  const fs::path cfg_path = dir / "tokenizer_config.json";
  if (fs::exists(cfg_path, ec)) {  // any kind: a FIFO gets read_regular_file's error
    const json cfg = read_json_file(cfg_path.string());
    const HfFields c(cfg, cfg_path.string());
    if (c.has("chat_template")) {
      const json& t = c.at("chat_template");
      if (t.is_string()) return t.get<std::string>();
      if (t.is_array() && !t.empty()) {
        const json* pick = &t[0];
        for (const json& e : t)
          if (e.is_object() && e.value("name", "") == "default") pick = &e;
        if (pick->is_object() && pick->contains("template") && (*pick)["template"].is_string())
          return (*pick)["template"].get<std::string>();
      }
      c.fail("field 'chat_template' must be a string or a list of {name, template}, got " +
             std::string(t.type_name()));
    }
  }
  const fs::path jinja = dir / "chat_template.jinja";
  if (fs::exists(jinja, ec)) {
    return read_regular_file(jinja.string());
  }
  const fs::path json_path = dir / "chat_template.json";
  if (fs::exists(json_path, ec)) {
    const json j = read_json_file(json_path.string());
    return HfFields(j, json_path.string()).string_or("chat_template", "");
  }
  return "";
}

// Whether the checkpoint stores the matrix of `spec` quantized: every linear layer of the decoder
// except the routers (vLLM keeps MoE gates in float), the embedding, and the LM head unless GPTQ's
// lm_head says so; minus the modules the config leaves in float.
bool is_quantized(const QuantConfig& q, const TensorSpec& spec) {
  if (!q.quantized() || spec.n_in == 0) return false;
  switch (spec.role) {
    case WeightRole::TokenEmbd:
    case WeightRole::Router:
    case WeightRole::ShRouter: return false;
    case WeightRole::Output:
      if (!(q.method == QuantMethod::Gptq && q.lm_head)) return false;
      break;
    default: break;
  }
  return !q.is_not_converted(spec.hf);
}

}  // namespace

std::string LlamaModel::hf_chat_template(const std::string& dir) { return read_chat_template(dir); }

std::unique_ptr<LlamaModel> LlamaModel::load_hf_dir(const std::string& dir, Quantization quantization) {
  const fs::path root(dir);
  const std::string config_path = (root / "config.json").string();
  HfModelConfig cfg = HfModelConfig::from_file(config_path);
  cfg.quant = resolve_quantization(quantization, cfg.quant, config_path);
  std::unique_ptr<LlamaModel> m(new LlamaModel());
  m->quant_method_ = cfg.quant.method;
  m->online_fp8_ = quantization == Quantization::Fp8 && !cfg.quant.quantized();
  m->format_ = ModelFormat::HfFolder;
  m->path_ = dir;
  m->safetensors_ = std::make_unique<SafetensorsCheckpoint>(SafetensorsCheckpoint::open_dir(dir));
  m->hparams_ = cfg.hparams;
  ModelHparams& hp = m->hparams_;
  // The folder's name ("Llama-3.2-1B-Instruct"), for display; "models/x/" has an empty filename.
  const fs::path abs = fs::absolute(root).lexically_normal();
  hp.name = abs.has_filename() ? abs.filename().string() : abs.parent_path().filename().string();
  m->chat_template_ = read_chat_template(root);

  HfTensorLoader ld(*m->safetensors_, m->weight_bytes_);
  if (cfg.quant.quantized()) m->quantized_ = std::make_unique<QuantizedWeights>();
  ModelWeights& w = m->weights_;
  const Architecture& arch = architecture(hp.arch);
  w.resize(hp.n_layer);
  for (int32_t l = -1; l < static_cast<int32_t>(hp.n_layer); ++l)
    for (const TensorSpec& spec : arch.tensors(hp, l)) {
      if (spec.role == WeightRole::Output && cfg.tie_word_embeddings) {
        // Tied as transformers ties them: a stored lm_head.weight is ignored.
        w.put({l, spec.role}, LayerTensor{w.at({-1, WeightRole::TokenEmbd}).matrix, {}, {}, {}});
        w.tied_output = true;
        continue;
      }
      const QuantConfig* quant = is_quantized(cfg.quant, spec) ? &cfg.quant : nullptr;
      if (spec.n_expert > 0) {
        LayerTensor lt;
        const size_t at = spec.hf.find("{e}");
        KESTREL_ASSERT(at != std::string::npos, "an expert tensor's HF name has an {e} placeholder");
        for (int64_t e = 0; e < spec.n_expert; ++e) {
          std::string name = spec.hf;
          name.replace(at, 3, std::to_string(e));
          lt.experts.push_back(ld.module_matrix(name, spec.n_in, spec.n_out, quant, m->quantized_.get()));
        }
        w.put({l, spec.role}, std::move(lt));
        continue;
      }
      const std::string name = spec.hf + ".weight";
      if (spec.role == WeightRole::Output && !ld.has_module(spec.hf))
        throw Error(dir + ": missing tensor '" + name + "' (config.json has tie_word_embeddings false)");
      LayerTensor lt;
      if (spec.n_in == 0) {
        lt.vector = ld.vector(name, spec.n_out);
        for (float& v : lt.vector) v += spec.hf_add;
      } else {
        lt.matrix = ld.module_matrix(spec.hf, spec.n_in, spec.n_out, quant, m->quantized_.get());
      }
      if (spec.may_have_bias && cfg.has_bias(spec.role)) lt.bias = ld.vector(spec.hf + ".bias", spec.n_out);
      w.put({l, spec.role}, std::move(lt));
    }
  w.rope_freq_factors = cfg.rope_freq_factors;
  ld.check_all_used(hp.arch);
  return m;
}

}  // namespace kestrel
