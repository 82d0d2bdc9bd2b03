#include "model/llama_weights.h"

#include <filesystem>

#include "backend/cpu/matmul.h"
#include "core/error.h"
#include "model/dummy_weights.h"
#include "model/forward_ops.h"
#include "model/hf_config.h"
#include "model/quantized_matrix.h"
#include "io/safetensors_checkpoint.h"

namespace kestrel {

namespace {

class Loader {
 public:
  Loader(const GgufFile& f, uint64_t& bytes) : f_(f), bytes_(bytes) {}

  const GgufTensorInfo* find(const std::string& name) const { return f_.find_tensor(name); }

  const GgufTensorInfo& require(const std::string& name) const {
    const auto* t = f_.find_tensor(name);
    if (t == nullptr) throw Error(f_.path() + ": missing tensor '" + name + "'");
    return *t;
  }

  WeightView matrix(const std::string& name, int64_t n_in, int64_t n_out) {
    return matrix(require(name), n_in, n_out);
  }

  WeightView matrix(const GgufTensorInfo& t, int64_t n_in, int64_t n_out) {
    // A one-row matrix may be stored 1-D (qwen2moe's ffn_gate_inp_shexp).
    const bool one_row = n_out == 1 && t.ne.size() == 1 && t.ne[0] == n_in;
    if (!one_row && (t.ne.size() != 2 || t.ne[0] != n_in || t.ne[1] != n_out))
      throw Error(f_.path() + ": tensor '" + t.name + "' has shape " + shape(t) + ", expected [" +
                  std::to_string(n_in) + ", " + std::to_string(n_out) + "]");
    bytes_ += t.n_bytes;
    return WeightView{t.type, n_in, n_out, t.data};
  }

  // n_expert [n_out, n_in] matrices stored as one 3-D tensor ne {n_in, n_out, n_expert}, viewed
  // in place expert by expert.
  std::vector<WeightView> experts(const GgufTensorInfo& t, int64_t n_in, int64_t n_out, int64_t n_expert) {
    if (t.ne.size() != 3 || t.ne[0] != n_in || t.ne[1] != n_out || t.ne[2] != n_expert)
      throw Error(f_.path() + ": tensor '" + t.name + "' has shape " + shape(t) + ", expected [" +
                  std::to_string(n_in) + ", " + std::to_string(n_out) + ", " + std::to_string(n_expert) + "]");
    bytes_ += t.n_bytes;
    std::vector<WeightView> v;
    for (int64_t e = 0; e < n_expert; ++e) {
      WeightView w{t.type, n_in, n_out, nullptr};
      w.data = t.data + static_cast<size_t>(e * n_out) * w.row_size();
      v.push_back(w);
    }
    return v;
  }

  // A 1-D vector of n elements converted to f32.
  std::vector<float> vector(const std::string& name, int64_t n) { return vector(require(name), n); }

  std::vector<float> vector(const GgufTensorInfo& t, int64_t n) {
    if (t.n_elements() != n)
      throw Error(f_.path() + ": tensor '" + t.name + "' has shape " + shape(t) + ", expected [" +
                  std::to_string(n) + "]");
    std::vector<float> out(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      switch (t.type) {
        case GgmlType::F32: {
          float v;
          std::memcpy(&v, t.data + 4 * i, 4);
          out[i] = v;
          break;
        }
        case GgmlType::F16: {
          uint16_t h;
          std::memcpy(&h, t.data + 2 * i, 2);
          out[i] = fp16_to_fp32(h);
          break;
        }
        case GgmlType::BF16: {
          uint16_t h;
          std::memcpy(&h, t.data + 2 * i, 2);
          out[i] = bf16_to_fp32(h);
          break;
        }
        default:
          throw Error(f_.path() + ": tensor '" + t.name + "' has type " +
                      std::string(type_name(t.type)) + ", expected F32, F16 or BF16");
      }
    }
    bytes_ += t.n_bytes;
    return out;
  }

  std::vector<float> optional_vector(const std::string& name, int64_t n) {
    const auto* t = find(name);
    return t == nullptr ? std::vector<float>{} : vector(*t, n);
  }

  // DeepSeek-V2's kv_b [H (nope + v), r] (rows of head h: its nope key rows, then its v value rows)
  // from the two tensors llama.cpp's converter writes since its MLA rework in its place: attn_k_b
  // ne {nope, r, H} (head h's key block transposed, [r, nope]) and attn_v_b ne {r, v, H}. Values
  // dequantized to f32 into `out`, which the returned view points into.
  WeightView kv_b_from_split(const GgufTensorInfo& k_b, const GgufTensorInfo& v_b, int64_t H, int64_t nope,
                             int64_t v, int64_t r, std::vector<float>& out) {
    for (const auto& [t, want] : {std::pair{&k_b, std::vector<int64_t>{nope, r, H}},
                                  std::pair{&v_b, std::vector<int64_t>{r, v, H}}})
      if (t->ne != want)
        throw Error(f_.path() + ": tensor '" + t->name + "' has shape " + shape(*t) + ", expected [" +
                    std::to_string(want[0]) + ", " + std::to_string(want[1]) + ", " + std::to_string(want[2]) + "]");
    for (const GgufTensorInfo* t : {&k_b, &v_b})
      if (!cpu::matmul_supports(t->type) || t->ne[0] % type_traits(t->type).block_size != 0)
        throw Error(f_.path() + ": tensor '" + t->name + "' has type " + std::string(type_name(t->type)) +
                    ", which kv_b cannot be assembled from");
    out.assign(static_cast<size_t>(H * (nope + v) * r), 0.0f);
    std::vector<float> row(static_cast<size_t>(std::max(nope, r)));
    const size_t k_row = static_cast<size_t>(k_b.n_bytes / static_cast<uint64_t>(H * r));
    const size_t v_row = static_cast<size_t>(v_b.n_bytes / static_cast<uint64_t>(H * v));
    for (int64_t h = 0; h < H; ++h) {
      float* head = out.data() + h * (nope + v) * r;
      for (int64_t c = 0; c < r; ++c) {  // k_b row (h, c) holds kv_b[h nope + i][c] for i < nope
        cpu::dequantize_row(k_b.type, k_b.data + static_cast<size_t>(h * r + c) * k_row, row.data(), nope);
        for (int64_t i = 0; i < nope; ++i) head[i * r + c] = row[static_cast<size_t>(i)];
      }
      for (int64_t j = 0; j < v; ++j)
        cpu::dequantize_row(v_b.type, v_b.data + static_cast<size_t>(h * v + j) * v_row, head + (nope + j) * r, r);
    }
    bytes_ += k_b.n_bytes + v_b.n_bytes;
    return WeightView{GgmlType::F32, r, H * (nope + v), reinterpret_cast<const uint8_t*>(out.data())};
  }

 private:
  static std::string shape(const GgufTensorInfo& t) {
    std::string s = "[";
    for (size_t i = 0; i < t.ne.size(); ++i) s += (i ? ", " : "") + std::to_string(t.ne[i]);
    return s + "]";
  }
  const GgufFile& f_;
  uint64_t& bytes_;
};

}  // namespace

LlamaModel::LlamaModel() = default;
LlamaModel::~LlamaModel() = default;

const GgufFile& LlamaModel::file() const {
  if (gguf_ == nullptr)
    throw Error(path_ + ": the model was loaded from a Hugging Face folder and has no GGUF metadata");
  return *gguf_;
}

LoadFormat parse_load_format(std::string_view name) {
  if (name == "auto") return LoadFormat::Auto;
  if (name == "dummy") return LoadFormat::Dummy;
  throw Error("unknown load format '" + std::string(name) + "' (supported: auto, dummy)");
}

std::unique_ptr<LlamaModel> LlamaModel::load(const std::string& path, LoadFormat format, Quantization quantization) {
  const bool asked = quantization != Quantization::Auto && quantization != Quantization::None;
  if (format == LoadFormat::Dummy) {
    if (asked && quantization != Quantization::Fp8)
      throw Error(path + ": --load-format dummy makes bf16 weights (or GPTQ 4-bit ones from the config.json's "
                         "quantization_config, with --quantization auto); of the other --quantization values only fp8 "
                         "(quantized at load on the GPU) applies to them");
    auto m = load_dummy(path);
    m->online_fp8_ = quantization == Quantization::Fp8;
    return m;
  }
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) return load_hf_dir(path, quantization);
  // A file of an HF folder gets load()'s "pass the folder" error, not the GGUF one.
  const std::filesystem::path p(path);
  const bool hf_file = p.extension() == ".safetensors" || p.filename() == "config.json" ||
                       p.filename() == "model.safetensors.index.json";
  if (asked && !hf_file && quantization != Quantization::Fp8 && quantization != Quantization::Rtn)
    throw Error(path + ": --quantization " + std::string(quantization == Quantization::Awq ? "awq" : "gptq") +
                " reads a Hugging Face checkpoint's quantized tensors; a GGUF file's block types are its own (use "
                "--quantization auto, or fp8 / rtn to quantize its weights at load)");
  auto m = load(path);
  if (asked && !hf_file) m->quantize_at_load(quantization);
  return m;
}

std::unique_ptr<LlamaModel> LlamaModel::load(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::is_directory(path, ec)) return load_hf_dir(path);
  const fs::path p(path);
  if (p.extension() == ".safetensors" || p.filename() == "config.json" ||
      p.filename() == "model.safetensors.index.json")
    throw Error(path + ": a file of a Hugging Face model folder; pass the folder (" +
                p.parent_path().string() + ") instead");
  return load_gguf(path);
}

std::unique_ptr<LlamaModel> LlamaModel::load_gguf(const std::string& path) {
  std::unique_ptr<LlamaModel> m(new LlamaModel());
  m->format_ = ModelFormat::Gguf;
  m->path_ = path;
  m->gguf_ = std::make_unique<GgufFile>(GgufFile::open(path));
  const GgufFile& f = *m->gguf_;
  m->hparams_ = ModelHparams::from_gguf(f);
  m->chat_template_ = f.get_string_or("tokenizer.chat_template", "");
  const ModelHparams& hp = m->hparams_;
  Loader ld(f, m->weight_bytes_);
  ModelWeights& w = m->weights_;
  const Architecture& arch = architecture(hp.arch);
  w.resize(hp.n_layer);
  for (int32_t l = -1; l < static_cast<int32_t>(hp.n_layer); ++l)
    for (const TensorSpec& spec : arch.tensors(hp, l)) {
      const GgufTensorInfo* t = ld.find(spec.gguf + ".weight");
      if (t == nullptr && spec.role == WeightRole::Output) {  // no LM head: tied to the embedding
        w.put({l, spec.role}, LayerTensor{w.at({-1, WeightRole::TokenEmbd}).matrix, {}, {}, {}});
        w.tied_output = true;
        continue;
      }
      if (t == nullptr && spec.role == WeightRole::KvB) {
        // kv_b split by head into attn_k_b and attn_v_b (llama.cpp files since its MLA rework).
        const std::string b = "blk." + std::to_string(l) + ".";
        const GgufTensorInfo* k_b = ld.find(b + "attn_k_b.weight");
        const GgufTensorInfo* v_b = ld.find(b + "attn_v_b.weight");
        if (k_b != nullptr && v_b != nullptr) {
          const MlaHparams& mla = hp.mla;
          m->assembled_.emplace_back();
          LayerTensor lt;
          lt.matrix = ld.kv_b_from_split(*k_b, *v_b, hp.n_head, mla.qk_nope, mla.v_head_dim, mla.kv_lora_rank,
                                         m->assembled_.back());
          w.put({l, spec.role}, std::move(lt));
          continue;
        }
      }
      if (t == nullptr) t = &ld.require(spec.gguf + ".weight");
      LayerTensor lt;
      if (spec.n_expert > 0) {
        lt.experts = ld.experts(*t, spec.n_in, spec.n_out, spec.n_expert);
      } else if (spec.n_in == 0) {
        lt.vector = ld.vector(*t, spec.n_out);
      } else {
        lt.matrix = ld.matrix(*t, spec.n_in, spec.n_out);
      }
      if (spec.may_have_bias) lt.bias = ld.optional_vector(spec.gguf + ".bias", spec.n_out);
      w.put({l, spec.role}, std::move(lt));
    }
  if (const auto* rf = ld.find("rope_freqs.weight"); rf != nullptr) {
    w.rope_freq_factors = ld.vector(*rf, hp.rope_dim / 2);
  } else if (hp.yarn_factor > 0) {  // YaRN with transformers' defaults: beta_fast 32, beta_slow 1, truncated bounds
    w.rope_freq_factors =
        yarn_rope_freq_factors(hp.rope_dim, hp.rope_theta, hp.yarn_factor, hp.yarn_original_ctx, 32, 1, true);
  }
  return m;
}

bool LlamaModel::fp8_weights() const { return online_fp8_ || quant_method_ == QuantMethod::Fp8; }

}  // namespace kestrel
