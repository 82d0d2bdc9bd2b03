// The weights of a Llama-family model, viewed in place in the mapped GGUF file.
//
// Matrices stay in their file type (Q4_1, Q8_0, ...) and are read by the kernels as they are;
// only the small norm vectors and biases are converted to owned f32 copies at load time.
#pragma once

#include <memory>
#include <vector>

#include "core/tensor.h"
#include "io/gguf.h"
#include "model/hparams.h"

namespace kestrel {

struct LlamaLayerWeights {
  std::vector<float> attn_norm;  // [n_embd], f32
  WeightView wq;                 // [q_dim rows, n_embd]
  WeightView wk;                 // [kv_dim rows, n_embd]
  WeightView wv;                 // [kv_dim rows, n_embd]
  WeightView wo;                 // [n_embd rows, q_dim]
  std::vector<float> bq, bk, bv; // optional biases (Qwen2): [q_dim], [kv_dim], [kv_dim], f32
  std::vector<float> ffn_norm;   // [n_embd], f32
  WeightView w_gate;             // [n_ff rows, n_embd]
  WeightView w_up;               // [n_ff rows, n_embd]
  WeightView w_down;             // [n_embd rows, n_ff]
};

struct LlamaWeights {
  WeightView token_embd;          // [n_vocab rows, n_embd]
  std::vector<LlamaLayerWeights> layers;
  std::vector<float> output_norm; // [n_embd], f32
  WeightView output;              // [n_vocab rows, n_embd]; == token_embd when tied
  bool tied_output = false;
  std::vector<float> rope_freq_factors;  // [rope_dim/2] divisors of the RoPE frequencies
                                         // (Llama 3 scaling, GGUF tensor rope_freqs.weight), or empty
};

// A loaded model: the mapped file, its hyperparameters and weight views into it.
class LlamaModel {
 public:
  // Opens a GGUF file and checks every tensor the architecture needs: present and with the
  // expected shape. Throws kestrel::Error naming the tensor otherwise. Whether a backend can
  // multiply with a tensor's type is the backend's check (CpuModelRunner's constructor).
  static std::unique_ptr<LlamaModel> load_gguf(const std::string& path);

  const GgufFile& file() const { return file_; }
  const ModelHparams& hparams() const { return hparams_; }
  const LlamaWeights& weights() const { return weights_; }
  uint64_t weight_bytes() const { return weight_bytes_; }

 private:
  explicit LlamaModel(GgufFile file) : file_(std::move(file)) {}
  GgufFile file_;
  ModelHparams hparams_;
  LlamaWeights weights_;
  uint64_t weight_bytes_ = 0;
};

}  // namespace kestrel
