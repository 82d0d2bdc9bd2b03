// GGUF reader: metadata and tensor directory of a GGUF v2/v3 file, tensor data through mmap.
//
// Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md. Little-endian: magic "GGUF",
// u32 version, u64 tensor_count, u64 metadata_kv_count, the key/value pairs, the tensor infos
// (name, n_dims, ne[n_dims] with ne[0] the fastest-varying dimension, type, offset), padding to
// general.alignment (default 32), then the data section. A vocab-only file has no tensors and may
// end right after the last metadata value.
//
// Every malformed input throws kestrel::Error with a message naming the problem (and the key or
// tensor); nothing is ever allocated beyond what the file size justifies. Besides the spec's own
// rules the reader rejects what ggml could not use or what points at a broken writer: empty keys
// or tensor names, duplicates of either, bool bytes other than 0/1, n_dims outside [1, 4],
// dimensions <= 0, element or byte counts that overflow int64, ne[0] not a multiple of the block
// size, tensor offsets not a multiple of the alignment, and tensors whose bytes overlap. Strings
// are kept as raw bytes (not checked for UTF-8). Arrays may nest up to 8 levels.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <variant>
#include <vector>

#include "core/dtype.h"

namespace kestrel {

class MappedFile;

enum class GgufValueType : uint32_t {
  UINT8 = 0,
  INT8 = 1,
  UINT16 = 2,
  INT16 = 3,
  UINT32 = 4,
  INT32 = 5,
  FLOAT32 = 6,
  BOOL = 7,
  STRING = 8,
  ARRAY = 9,
  UINT64 = 10,
  INT64 = 11,
  FLOAT64 = 12,
};
std::string_view gguf_value_type_name(GgufValueType t);

// One metadata value. Scalars keep their declared type; arrays keep their element type and hold
// their elements in the vector matching that type's storage class.
struct GgufValue {
  GgufValueType type = GgufValueType::UINT8;
  GgufValueType array_type = GgufValueType::UINT8;  // element type when type == ARRAY
  // Scalar storage: integers (signed or unsigned) widen to int64/uint64, floats to double.
  std::variant<std::monostate, int64_t, uint64_t, double, bool, std::string> scalar;
  // Array storage (exactly one is used, by array_type's storage class).
  std::vector<int64_t> ints;        // signed integer element types
  std::vector<uint64_t> uints;      // unsigned integer element types
  std::vector<double> floats;       // FLOAT32 / FLOAT64
  std::vector<uint8_t> bools;       // BOOL
  std::vector<std::string> strings; // STRING
  // Arrays of arrays are legal GGUF; their elements are kept (one level deep is enough in practice).
  std::vector<GgufValue> arrays;

  bool is_array() const { return type == GgufValueType::ARRAY; }
  size_t array_size() const;
};

struct GgufTensorInfo {
  std::string name;
  std::vector<int64_t> ne;   // ne[0] is the row length (fastest-varying), as in ggml
  GgmlType type = GgmlType::F32;
  uint64_t offset = 0;       // relative to the start of the data section
  uint64_t n_bytes = 0;      // size of the data
  const uint8_t* data = nullptr;  // points into the mapping (valid while the GgufFile lives)

  int64_t n_elements() const;
  int64_t n_rows() const { return ne.empty() ? 1 : n_elements() / ne[0]; }
};

class GgufFile {
 public:
  // Opens and validates the file; throws kestrel::Error("<path>: <problem>") on any defect.
  static GgufFile open(const std::string& path);
  // Parses an in-memory image (tests, fuzzing); the buffer must outlive the GgufFile.
  static GgufFile parse(const uint8_t* data, size_t size, std::string name = "<memory>");

  GgufFile(GgufFile&&) noexcept;
  GgufFile& operator=(GgufFile&&) noexcept;
  ~GgufFile();

  const std::string& path() const { return path_; }
  uint32_t version() const { return version_; }
  uint64_t alignment() const { return alignment_; }
  // File offset of the data section: the end of the tensor infos rounded up to alignment(), or the
  // file size for a file without tensors that ends before that (a vocab-only file).
  uint64_t data_offset() const { return data_offset_; }

  // Metadata in file order.
  const std::vector<std::pair<std::string, GgufValue>>& metadata() const { return kv_; }
  const GgufValue* find(std::string_view key) const;
  bool has(std::string_view key) const { return find(key) != nullptr; }

  // Typed getters. The *_or forms return the fallback when the key is absent. All throw
  // kestrel::Error naming the key when the stored type does not convert (integer getters accept
  // any integer type whose value fits; float getters accept FLOAT32/FLOAT64 and integers).
  std::string get_string(std::string_view key) const;
  std::string get_string_or(std::string_view key, std::string fallback) const;
  int64_t get_int(std::string_view key) const;
  int64_t get_int_or(std::string_view key, int64_t fallback) const;
  // get_int, and also throws naming the key and the range when the value is outside [lo, hi].
  int64_t get_int_in(std::string_view key, int64_t lo, int64_t hi) const;
  double get_float(std::string_view key) const;
  double get_float_or(std::string_view key, double fallback) const;
  bool get_bool_or(std::string_view key, bool fallback) const;
  // Array getters throw naming the key when it is absent or is not an array of a matching type
  // (get_float_array also takes integer arrays; get_int_array range-checks each element).
  const std::vector<std::string>& get_string_array(std::string_view key) const;
  std::vector<float> get_float_array(std::string_view key) const;
  std::vector<int64_t> get_int_array(std::string_view key) const;

  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }
  const GgufTensorInfo* find_tensor(std::string_view name) const;

 private:
  friend class GgufParser;  // gguf.cpp: fills the fields below while validating the image
  GgufFile() = default;
  std::string path_;
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  uint64_t data_offset_ = 0;
  std::vector<std::pair<std::string, GgufValue>> kv_;
  std::unordered_map<std::string, size_t> kv_index_;
  std::vector<GgufTensorInfo> tensors_;
  std::unordered_map<std::string, size_t> tensor_index_;
  std::unique_ptr<MappedFile> mapping_;
};

}  // namespace kestrel
