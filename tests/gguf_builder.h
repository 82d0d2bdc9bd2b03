// GgufBuilder: writes GGUF images in memory for tests.
//
// By default the image is valid (v3, little-endian, alignment 32): the chosen metadata in the order
// given, then the tensor infos, padding, and each tensor's data at the next aligned offset. The
// last tensor is not padded, so every proper prefix of an image with tensors is a truncated file;
// an image without tensors ends right after its last metadata value, as vocab-only files do.
// build() records where every field landed (Layout), so a test can corrupt exactly one field with
// poke_u32 / poke_u64, or cut the image anywhere.
//
//   using B = kestrel::test::GgufBuilder;
//   B::Layout at;
//   auto img = B().kv("general.architecture", B::str("llama"))
//                 .tensor("output_norm.weight", {64}, GgmlType::F32)
//                 .build(&at);
//   kestrel::test::poke_u64(img, at.offset_at[0], 4);  // misalign the tensor
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/dtype.h"
#include "io/gguf.h"

namespace kestrel::test {

inline void append_bytes(std::vector<uint8_t>& out, const void* p, size_t n) {
  if (n == 0) return;
  const size_t old = out.size();
  out.resize(old +
             n);  // (vector::insert of one byte trips a GCC 12 -Wstringop-overflow false positive)
  std::memcpy(out.data() + old, p, n);
}
// Appends v as it is in memory: little-endian on the hosts kestrel supports.
template <typename T>
void append_le(std::vector<uint8_t>& out, T v) {
  append_bytes(out, &v, sizeof v);
}
inline void append_gguf_string(std::vector<uint8_t>& out, std::string_view s) {
  append_le<uint64_t>(out, s.size());
  append_bytes(out, s.data(), s.size());
}
inline void poke_u32(std::vector<uint8_t>& img, size_t at, uint32_t v) {
  std::memcpy(img.data() + at, &v, sizeof v);
}
inline void poke_u64(std::vector<uint8_t>& img, size_t at, uint64_t v) {
  std::memcpy(img.data() + at, &v, sizeof v);
}
inline std::vector<uint8_t> f32_bytes(const std::vector<float>& v) {
  std::vector<uint8_t> out;
  append_bytes(out, v.data(), v.size() * sizeof(float));
  return out;
}

// A metadata value as written after its key: a type id, then the payload.
struct GgufEncoded {
  uint32_t type = 0;
  std::vector<uint8_t> payload;
};

class GgufBuilder {
 public:
  using VT = GgufValueType;

  // ---- value encoders ----
  template <typename T>
  static GgufEncoded scalar(VT type, T v) {
    GgufEncoded e{static_cast<uint32_t>(type), {}};
    append_le(e.payload, v);
    return e;
  }
  static GgufEncoded u8(uint8_t v) { return scalar(VT::UINT8, v); }
  static GgufEncoded i8(int8_t v) { return scalar(VT::INT8, v); }
  static GgufEncoded u16(uint16_t v) { return scalar(VT::UINT16, v); }
  static GgufEncoded i16(int16_t v) { return scalar(VT::INT16, v); }
  static GgufEncoded u32(uint32_t v) { return scalar(VT::UINT32, v); }
  static GgufEncoded i32(int32_t v) { return scalar(VT::INT32, v); }
  static GgufEncoded f32(float v) { return scalar(VT::FLOAT32, v); }
  static GgufEncoded u64(uint64_t v) { return scalar(VT::UINT64, v); }
  static GgufEncoded i64(int64_t v) { return scalar(VT::INT64, v); }
  static GgufEncoded f64(double v) { return scalar(VT::FLOAT64, v); }
  static GgufEncoded boolean(bool v) { return scalar(VT::BOOL, static_cast<uint8_t>(v)); }
  static GgufEncoded str(std::string_view s) {
    GgufEncoded e{static_cast<uint32_t>(VT::STRING), {}};
    append_gguf_string(e.payload, s);
    return e;
  }
  // Any type id and payload, valid or not (bad type ids, bool bytes other than 0/1, ...).
  static GgufEncoded raw(uint32_t type_id, std::vector<uint8_t> payload) {
    return {type_id, std::move(payload)};
  }
  // An array: element type, count, then each element's payload (elements carry no type id). The
  // elements' own type ids are not checked, so a test can declare one type and write another.
  static GgufEncoded array(VT elem_type, const std::vector<GgufEncoded>& elems) {
    return array_raw(static_cast<uint32_t>(elem_type), elems.size(), elems);
  }
  static GgufEncoded array_raw(uint32_t elem_type, uint64_t count,
                               const std::vector<GgufEncoded>& elems) {
    GgufEncoded e{static_cast<uint32_t>(VT::ARRAY), {}};
    append_le(e.payload, elem_type);
    append_le(e.payload, count);
    for (const auto& x : elems) append_bytes(e.payload, x.payload.data(), x.payload.size());
    return e;
  }
  // An array of fixed-size elements; T must be the on-disk element type (uint8_t for BOOL).
  template <typename T>
  static GgufEncoded array_of(VT elem_type, const std::vector<T>& v) {
    GgufEncoded e{static_cast<uint32_t>(VT::ARRAY), {}};
    append_le(e.payload, static_cast<uint32_t>(elem_type));
    append_le(e.payload, static_cast<uint64_t>(v.size()));
    for (const T& x : v) append_le(e.payload, x);
    return e;
  }
  static GgufEncoded strings(const std::vector<std::string>& v) {
    std::vector<GgufEncoded> elems;
    for (const auto& s : v) elems.push_back(str(s));
    return array(VT::STRING, elems);
  }

  // ---- image contents ----
  GgufBuilder& version(uint32_t v) {
    version_ = v;
    return *this;
  }
  GgufBuilder& kv(std::string key, GgufEncoded value) {
    kvs_.emplace_back(std::move(key), std::move(value));
    return *this;
  }
  // Writes general.alignment (UINT32) here in the metadata and, when a is a nonzero power of two,
  // lays the data out with it (an invalid a is only written, for tests of the check).
  GgufBuilder& alignment(uint32_t a) {
    if (a != 0 && (a & (a - 1)) == 0) alignment_ = a;
    return kv("general.alignment", u32(a));
  }
  // A tensor of a known type; without data its bytes are a fixed pattern of the right size.
  GgufBuilder& tensor(std::string name, const std::vector<int64_t>& ne, GgmlType type,
                      std::vector<uint8_t> data = {}) {
    if (data.empty()) {
      int64_t n = 1;
      for (int64_t d : ne) n *= d;
      data.resize(row_bytes(type, ne.at(0)) * static_cast<size_t>(n / ne.at(0)));
      for (size_t i = 0; i < data.size(); ++i)
        data[i] = static_cast<uint8_t>(i * 31 + tensors_.size() * 7 + 1);
    }
    std::vector<uint64_t> raw_ne(ne.begin(), ne.end());
    return tensor_raw(std::move(name), std::move(raw_ne), static_cast<uint32_t>(type),
                      std::move(data));
  }
  // Any name, dimensions (written as u64, so -1 is 2^64-1), type id and data bytes.
  GgufBuilder& tensor_raw(std::string name, std::vector<uint64_t> ne, uint32_t type_id,
                          std::vector<uint8_t> data) {
    tensors_.push_back({std::move(name), std::move(ne), type_id, std::move(data)});
    return *this;
  }
  // Pads a file without tensors to the alignment too (by default it ends after the metadata).
  GgufBuilder& pad_without_tensors(bool pad) {
    pad_without_tensors_ = pad;
    return *this;
  }

  // File offsets of the fields of the last build.
  struct Layout {
    size_t magic_at = 0, version_at = 4, tensor_count_at = 8, kv_count_at = 16;
    std::vector<size_t> key_at;     // each key's u64 length
    std::vector<size_t> value_at;   // each value's u32 type id (the payload follows)
    std::vector<size_t> tensor_at;  // each tensor info's name length
    std::vector<size_t> n_dims_at, ne_at, type_at, offset_at;
    std::vector<uint64_t> offset;  // each tensor's offset in the data section
    size_t data_offset = 0;        // start of the data section
  };

  std::vector<uint8_t> build(Layout* layout = nullptr) const {
    Layout at;
    std::vector<uint8_t> out;
    append_bytes(out, "GGUF", 4);
    append_le(out, version_);
    append_le(out, static_cast<uint64_t>(tensors_.size()));
    append_le(out, static_cast<uint64_t>(kvs_.size()));
    for (const auto& [key, value] : kvs_) {
      at.key_at.push_back(out.size());
      append_gguf_string(out, key);
      at.value_at.push_back(out.size());
      append_le(out, value.type);
      append_bytes(out, value.payload.data(), value.payload.size());
    }
    uint64_t next = 0;
    for (const auto& t : tensors_) {
      at.tensor_at.push_back(out.size());
      append_gguf_string(out, t.name);
      at.n_dims_at.push_back(out.size());
      append_le(out, static_cast<uint32_t>(t.ne.size()));
      at.ne_at.push_back(out.size());
      for (uint64_t d : t.ne) append_le(out, d);
      at.type_at.push_back(out.size());
      append_le(out, t.type);
      at.offset_at.push_back(out.size());
      append_le(out, next);
      at.offset.push_back(next);
      next = align(next + t.data.size());
    }
    if (!tensors_.empty() || pad_without_tensors_) out.resize(align(out.size()), 0);
    at.data_offset = out.size();
    for (size_t i = 0; i < tensors_.size(); ++i) {
      out.resize(at.data_offset + at.offset[i], 0);
      append_bytes(out, tensors_[i].data.data(), tensors_[i].data.size());
    }
    if (layout != nullptr) *layout = std::move(at);
    return out;
  }

 private:
  struct Tensor {
    std::string name;
    std::vector<uint64_t> ne;
    uint32_t type;
    std::vector<uint8_t> data;
  };
  uint64_t align(uint64_t x) const { return (x + alignment_ - 1) / alignment_ * alignment_; }

  uint32_t version_ = 3;
  uint64_t alignment_ = 32;
  bool pad_without_tensors_ = false;
  std::vector<std::pair<std::string, GgufEncoded>> kvs_;
  std::vector<Tensor> tensors_;
};

}  // namespace kestrel::test
