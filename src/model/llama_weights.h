// The weights of a Llama-family model, viewed in place in its mapped files: one GGUF file, or the
// safetensors files of a Hugging Face model folder.
//
// Matrices stay in their file type (Q4_1, Q8_0, BF16, ...) and are read by the kernels as they
// are; only the small norm vectors and biases are converted to owned f32 copies at load time.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/tensor.h"
#include "io/gguf.h"
#include "model/hparams.h"
#include "model/model_weights.h"
#include "model/quant_config.h"

namespace kestrel {

class SafetensorsCheckpoint;
class GeneratedWeights;
class QuantizedWeights;

enum class ModelFormat {
  Gguf,      // one .gguf file
  HfFolder,  // a Hugging Face folder: config.json + *.safetensors (+ tokenizer files)
};

// Where the weights come from (vLLM's --load-format names): Auto reads them from the model's files;
// Dummy generates random bf16 weights in the shapes a Hugging Face config.json describes
// (model/dummy_weights.h), for measuring speed without a checkpoint.
enum class LoadFormat { Auto, Dummy };
// "auto" or "dummy". Throws kestrel::Error naming the value and the supported ones otherwise.
LoadFormat parse_load_format(std::string_view name);

// A loaded model: its mapped files, hyperparameters and weight views into the files.
class LlamaModel {
 public:
  // Opens a GGUF file and checks every tensor the architecture needs: present and with the
  // expected shape. Throws kestrel::Error naming the tensor otherwise. Whether a backend can
  // multiply with a tensor's type is the backend's check (CpuModelRunner's constructor).
  static std::unique_ptr<LlamaModel> load_gguf(const std::string& path);

  // Opens a Hugging Face model folder (model/hf_loader.cpp): config.json (HfModelConfig), the
  // weights in model.safetensors or the shards of model.safetensors.index.json
  // (SafetensorsCheckpoint), and the chat template of tokenizer_config.json (or
  // chat_template.jinja / chat_template.json). Matrices must be F32, F16 or BF16 [out, in] and are
  // viewed in place; norms and biases are converted to f32. A quantized checkpoint
  // (config.json quantization_config: GPTQ, AWQ, FP8; model/quant_config.h) keeps its quantized
  // matrices in the mapped files (WeightView::quant) beside f32 host copies made by
  // ensure_host_weights(). `quantization` (--quantization) must agree with the checkpoint. Throws
  // kestrel::Error naming the file and the tensor for a missing tensor, a wrong shape, an
  // unsupported dtype or misaligned data, inconsistent quantization metadata, and the config's or
  // the reader's errors.
  static std::unique_ptr<LlamaModel> load_hf_dir(const std::string& dir, Quantization quantization = Quantization::Auto);
  // The chat template of a Hugging Face folder, as load_hf_dir reads it; "" when none.
  static std::string hf_chat_template(const std::string& dir);

  // load_hf_dir for a directory, load_gguf for anything else. Throws kestrel::Error pointing at the
  // folder when given a *.safetensors, config.json or index file of one.
  static std::unique_ptr<LlamaModel> load(const std::string& path);
  // load() for LoadFormat::Auto, load_dummy() for Dummy; `quantization` is load_hf_dir's, or for a
  // GGUF file fp8 or rtn: its dense projections quantized at load (model/load_quantize.h). Throws
  // kestrel::Error for awq or gptq with a GGUF file (its block types are its own), rtn with an HF
  // folder or generated weights, and load_quantize.h's errors.
  static std::unique_ptr<LlamaModel> load(const std::string& path, LoadFormat format,
                                          Quantization quantization = Quantization::Auto);

  // A model with random weights (model/dummy_weights.cpp): the shapes of the Hugging Face folder
  // `dir`'s config.json (no weight files are read; tokenizer files and a chat template are used
  // when present), every tensor the architecture lists generated as bf16 from a fixed seed
  // (core/random_fill.h). Matrices are not made on the host until ensure_host_weights(): a GPU
  // upload generates them on the device. Throws kestrel::Error for a path that is not a folder
  // holding a config.json, and the config's errors.
  static std::unique_ptr<LlamaModel> load_dummy(const std::string& dir);

  ~LlamaModel();
  LlamaModel(const LlamaModel&) = delete;
  LlamaModel& operator=(const LlamaModel&) = delete;

  ModelFormat format() const { return format_; }
  // The GGUF file or the HF folder the model was loaded from.
  const std::string& path() const { return path_; }
  // The GGUF file of a model from load_gguf. Throws kestrel::Error for a model from an HF folder,
  // which has no GGUF metadata.
  const GgufFile& file() const;
  // Chat template source (Jinja): GGUF tokenizer.chat_template, or the HF folder's; "" when none.
  const std::string& chat_template() const { return chat_template_; }
  const ModelHparams& hparams() const { return hparams_; }
  const ModelWeights& weights() const { return weights_; }
  // Bytes of the tensors the weights use (matrices in their file type, vectors as stored).
  uint64_t weight_bytes() const { return weight_bytes_; }
  // Whether the weights are generated (load_dummy).
  bool generated_weights() const { return generated_ != nullptr; }
  // --quantization fp8 on float weights (a float checkpoint or --load-format dummy): the GPU backend
  // quantizes the dense projections to FP8 E4M3 at load; the CPU backend refuses it.
  bool online_fp8() const { return online_fp8_; }
  // The checkpoint's weights are FP8 (quantization_config), or online_fp8(): what the GPU backend
  // runs as FP8.
  bool fp8_weights() const;
  // Makes every weight's values readable through its WeightView::data on the host: generates the
  // matrices of a load_dummy model there and dequantizes a quantized checkpoint's into f32 (once;
  // the CPU backend calls it), nothing for other models read from files. Thread-safe. Throws kestrel::Error when the host memory cannot be had.
  void ensure_host_weights() const;

  // Rank `rank` of `size`'s slice of the model for tensor parallelism (model/tensor_parallel.cpp;
  // Megatron-LM's layout, Shoeybi et al. 2019): Q, K, V, gate and up by output rows (whole heads;
  // when n_head_kv < size each KV head is replicated on the size / n_head_kv ranks whose query
  // heads read it), the output and down projections by input columns (their biases on rank 0
  // only), the token embedding and the LM head by vocabulary rows (weights().vocab_begin); norms
  // whole. hparams() gives the rank's n_head, n_head_kv and n_ff; n_vocab stays the whole
  // vocabulary (token ids) and the LM head's rows are the rank's n_vocab / size logits. Row slices are views into this model's
  // memory, column slices owned copies: this model must outlive the shard. Makes the host weights
  // first (ensure_host_weights). Errors: validate_tensor_parallel's, and kestrel::Error when a
  // column slice would split a quantization block.
  std::unique_ptr<LlamaModel> tensor_parallel_shard(int rank, int size) const;

  // Stage `stage` of `size` for pipeline parallelism (model/pipeline_parallel.cpp): the layers of
  // pipeline_stage_layers(hparams(), stage, size), renumbered from 0 (hparams().n_layer is the
  // stage's count), beside the model-level tensors (embedding, final norm, LM head), all views
  // into this model's memory: this model must outlive the stage. Makes the host weights first
  // (ensure_host_weights). Errors: validate_pipeline_parallel's, and kestrel::Error for a stage
  // outside [0, size).
  std::unique_ptr<LlamaModel> pipeline_stage(int stage, int size) const;

 private:
  LlamaModel();  // defined where every owned type is complete (llama_weights.cpp)
  // Replaces the dense projections by FP8 or RTN INT4 matrices (model/load_quantize.cpp).
  void quantize_at_load(Quantization q);
  ModelFormat format_ = ModelFormat::Gguf;
  std::string path_;
  // Exactly one of these owns the memory the weight views point into.
  std::unique_ptr<GgufFile> gguf_;
  std::unique_ptr<SafetensorsCheckpoint> safetensors_;
  std::unique_ptr<GeneratedWeights> generated_;  // load_dummy's memory and generators
  std::unique_ptr<QuantizedWeights> quantized_;  // a quantized checkpoint's matrices and f32 host copies
  // Matrices the GGUF loader assembles (f32) from tensors the file lays out otherwise: DeepSeek-V2's
  // kv_b from attn_k_b and attn_v_b.
  std::vector<std::vector<float>> assembled_;
  // A tensor-parallel shard's column slices (tensor_parallel_shard), in their file type.
  std::vector<std::vector<uint8_t>> shard_columns_;
  std::string chat_template_;
  ModelHparams hparams_;
  ModelWeights weights_;
  uint64_t weight_bytes_ = 0;
  bool online_fp8_ = false;
  QuantMethod quant_method_ = QuantMethod::None;  // the checkpoint's (quantization_config)
};

}  // namespace kestrel
