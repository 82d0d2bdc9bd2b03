// The memory behind a model with generated weights (LlamaModel::load_dummy, --load-format dummy):
// one reserved range of host address space holding every matrix at a page-aligned offset, made
// readable and filled only when a host copy is wanted, so a GPU run of a 93 GB model never holds
// its weights on the host (the GPU upload generates them on the device from WeightView::random).
//
// Values (core/random_fill.h, from kDummyWeightSeed and the tensor's Hugging Face name, e.g.
// "model.layers.3.mlp.experts.5.gate_proj.weight"): a matrix [n_out, n_in] is uniform in [-a, a)
// with a = 1 / sqrt(n_in), so a projection of a unit-RMS input has RMS about 1 / sqrt(3) and the
// residual stream stays finite through any depth; norm weights are 1 + uniform[-1/16, 1/16);
// biases uniform[-1/16, 1/16).
// With a GPTQ 4-bit quantization_config (quant_method gptq, bits 4) the dense projections (q, k,
// v, o, gate, up, down; not the experts, embeddings or head) are generated in the GPTQ v1 layout
// instead (model/quantized_matrix.h): uniform random codes, symmetric zero 8 (stored as 7), f16
// scales of 1 / (4.6 sqrt(n_in)) times 0.75 .. 1.25 per group and row (a code minus 8 has RMS about 4.6),
// one group of group_size inputs (-1: the row) in order (no act order); they are held on the host.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/random_fill.h"

namespace kestrel {

inline constexpr uint64_t kDummyWeightSeed = 0;

// The generator of a [n_out, n_in] matrix named `name`: uniform in [-a, a), a = 1 / sqrt(n_in).
RandomFill matrix_fill(const std::string& name, int64_t n_in);
// A vector of n f32 values named `name`: 1 + uniform[-1/16, 1/16) for a norm weight, else (a bias)
// uniform[-1/16, 1/16).
std::vector<float> generated_vector(const std::string& name, int64_t n, bool norm);
// Elements [begin, end) of a generated tensor as bf16 bits, written to out[0, end - begin).
void fill_random_bf16_host(const RandomFill& f, uint16_t* out, int64_t begin, int64_t end);

class GeneratedWeights {
 public:
  struct Matrix {
    std::string name;  // the Hugging Face tensor name, for the key and for errors
    int64_t n_in = 0, n_out = 0;
    RandomFill fill;
    size_t offset = 0;      // bytes from the start of the range (set by the constructor)
    bool on_host = false;   // filled on the host
  };

  // Reserves address space for the matrices (bf16, each at a page-aligned offset), readable by
  // nobody yet. Throws kestrel::Error when the address space cannot be reserved.
  explicit GeneratedWeights(std::vector<Matrix> matrices);
  ~GeneratedWeights();
  GeneratedWeights(const GeneratedWeights&) = delete;
  GeneratedWeights& operator=(const GeneratedWeights&) = delete;

  size_t size() const { return m_.size(); }
  const Matrix& matrix(size_t i) const { return m_[i]; }
  const uint8_t* data(size_t i) const { return base_ + m_[i].offset; }
  const RandomFill* fill(size_t i) const { return &m_[i].fill; }
  // Makes matrix i readable on the host and fills it (once).
  void make_host(size_t i);
  // make_host for every matrix, in parallel (once; thread-safe).
  void make_all_host();
  // Bytes of the reserved range (address space, not memory).
  size_t reserved_bytes() const { return bytes_; }
  // n uint32 words of host memory kept as long as the weights: the packed tensors of a generated
  // GPTQ matrix (load_dummy with a quantization_config).
  uint32_t* hold_words(size_t n);

 private:
  void protect_rw(size_t offset, size_t bytes);
  std::vector<Matrix> m_;
  uint8_t* base_ = nullptr;
  size_t bytes_ = 0;
  std::mutex mu_;
  bool all_on_host_ = false;
  std::vector<std::unique_ptr<uint32_t[]>> held_;
};

}  // namespace kestrel
