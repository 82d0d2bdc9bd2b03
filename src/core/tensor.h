// Non-owning views of tensors that live in a mapped model file or in backend buffers.
#pragma once

#include <cstdint>

#include "core/dtype.h"

namespace kestrel {

// A weight matrix of n_out rows, each row n_in elements stored contiguously in `type`
// (a GGUF tensor with ne = {n_in, n_out}); y = W x maps n_in inputs to n_out outputs.
struct WeightView {
  GgmlType type = GgmlType::F32;
  int64_t n_in = 0;
  int64_t n_out = 0;
  const uint8_t* data = nullptr;

  bool empty() const { return data == nullptr; }
  size_t row_size() const { return row_bytes(type, n_in); }
  const uint8_t* row(int64_t r) const { return data + static_cast<size_t>(r) * row_size(); }
};

}  // namespace kestrel
