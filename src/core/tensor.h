// Non-owning views of tensors that live in a mapped model file or in backend buffers.
#pragma once

#include <cstdint>

#include "core/dtype.h"

namespace kestrel {

struct RandomFill;
struct QuantizedMatrix;

// How a weight tensor's elements are stored: the data's encoding plus, for quantized data, where
// its scales are. The schemes read today keep the scales inside the data: plain floats (F32, F16,
// BF16) and GGUF's block formats (Q4_0 ... Q8_0, the k-quants: every block of block_size elements
// carries its own scales). Schemes with scales stored apart (AWQ/GPTQ INT4 groups, FP8 with
// per-channel scales) are named here so a backend can refuse what it lacks; a quantized Hugging
// Face checkpoint's matrices are described by WeightView::quant instead (model/quantized_matrix.h).
enum class QuantScheme : uint8_t {
  None,        // floats
  GgmlBlocks,  // GGUF block quantization, scales inside each block
  Int4Groups,  // 4-bit integers in groups of block_size along a row, scales (and zeros) apart
  Fp8,         // 8-bit floats, scales apart
};
struct TensorType {
  GgmlType storage = GgmlType::F32;  // the data's element or block encoding
  QuantScheme scheme = QuantScheme::None;
  int64_t block_size = 1;            // elements sharing one scale (GGUF block, INT4 group); 1 for floats
  const void* scales = nullptr;      // scales stored apart from the data; null when they are inside it

  TensorType() = default;
  // A GGUF encoding (F32, F16, BF16 or a block format) names a whole type: scales inside, block
  // size from its traits. Implicit, so a view can be written {GgmlType::Q4_1, n_in, n_out, data}.
  TensorType(GgmlType t)  // NOLINT(google-explicit-constructor)
      : storage(t),
        scheme(t == GgmlType::F32 || t == GgmlType::F16 || t == GgmlType::BF16 ? QuantScheme::None
                                                                                : QuantScheme::GgmlBlocks),
        block_size(type_traits(t).block_size) {}
  // Scales inside the data: readable from `storage` alone.
  bool self_contained() const { return scheme == QuantScheme::None || scheme == QuantScheme::GgmlBlocks; }
  // The type is exactly that GGUF encoding (scales inside).
  friend bool operator==(const TensorType& a, GgmlType b) { return a.self_contained() && a.storage == b; }
};

// A weight matrix of n_out rows, each row n_in elements stored contiguously in `type`
// (a GGUF tensor with ne = {n_in, n_out}); y = W x maps n_in inputs to n_out outputs.
struct WeightView {
  TensorType type;
  int64_t n_in = 0;
  int64_t n_out = 0;
  const uint8_t* data = nullptr;
  // Generated weights (--load-format dummy, core/random_fill.h): element i of the n_out * n_in
  // bf16 values is random_fill_bf16(*random, i), which a GPU upload computes on the device; `data`
  // holds the same values on the host only once the model's host copy is made
  // (LlamaModel::ensure_host_weights). Null for weights read from a file.
  const RandomFill* random = nullptr;
  // A matrix of a quantized Hugging Face checkpoint (GPTQ, AWQ, FP8; model/quantized_matrix.h): its
  // stored tensors in the mapped files. `type` and `data` are then its F32 host copy, whose values
  // are there only once the model's host copy is made (LlamaModel::ensure_host_weights); a GPU
  // upload dequantizes from `quant`. Null for other weights.
  const QuantizedMatrix* quant = nullptr;

  bool empty() const { return data == nullptr; }
  size_t row_size() const { return row_bytes(type.storage, n_in); }
  const uint8_t* row(int64_t r) const { return data + static_cast<size_t>(r) * row_size(); }
};

}  // namespace kestrel
