// Safetensors reader: the tensor directory of one .safetensors file, tensor data through mmap.
//
// Format (https://huggingface.co/docs/safetensors, "Format"): an 8-byte little-endian u64 N, then
// N bytes of UTF-8 JSON, then the data section. The JSON is an object mapping each tensor name to
// {"dtype": "F32" | ..., "shape": [d0, d1, ...], "data_offsets": [begin, end]}, offsets relative
// to the start of the data section, shape row-major with the outermost dimension first (a PyTorch
// Linear weight is [out_features, in_features]); an optional "__metadata__" entry maps strings to
// strings.
//
// Every malformed input throws kestrel::Error("<path>: <problem>") naming the tensor: a file
// shorter than 8 bytes; a header length beyond the file or over 100 MB (the reference
// implementation's limit); a header that is not JSON, not an object, or repeats a name; an entry
// that is not an object or lacks dtype / shape / data_offsets or has them of the wrong JSON type;
// an unknown dtype; a negative dimension or an element or byte count that overflows; data_offsets
// that are not [begin, end] with begin <= end; a byte range that does not match product(shape) x
// the dtype's size; a range past the end of the data section (a truncated file); and tensors whose
// bytes overlap. Unknown fields of an entry are ignored, and so are unused bytes between or after
// tensors (the reference writer leaves none, but they are harmless to a reader).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/dtype.h"

namespace kestrel {

class MappedFile;

enum class SafetensorsDtype { BOOL, U8, I8, I16, I32, I64, F8_E4M3, F8_E5M2, F16, BF16, F32, F64 };

// "F32", "BF16", ...: the spelling used in the header.
std::string_view safetensors_dtype_name(SafetensorsDtype t);
// The dtype spelled `name`, or nullopt for a name this reader does not know.
std::optional<SafetensorsDtype> parse_safetensors_dtype(std::string_view name);
// Bytes per element (1 for BOOL and the FP8 types).
size_t safetensors_dtype_size(SafetensorsDtype t);
// The GgmlType with the same element layout for the types the kernels read as weights (F32, F16,
// BF16), else nullopt.
std::optional<GgmlType> to_ggml_type(SafetensorsDtype t);

struct SafetensorsTensor {
  std::string name;
  SafetensorsDtype dtype = SafetensorsDtype::F32;
  std::vector<int64_t> shape;     // outermost dimension first; empty for a scalar
  uint64_t begin = 0;             // byte range [begin, end) in the data section
  uint64_t end = 0;
  const uint8_t* data = nullptr;  // into the mapping (valid while the SafetensorsFile lives)

  uint64_t n_bytes() const { return end - begin; }
  int64_t n_elements() const;  // 1 for a scalar; no overflow (checked by the parser)
};

class SafetensorsFile {
 public:
  // Maps and validates the file; throws kestrel::Error("<path>: <problem>") on any defect.
  static SafetensorsFile open(const std::string& path);
  // Parses an in-memory image (tests, fuzzing); the buffer must outlive the SafetensorsFile.
  static SafetensorsFile parse(const uint8_t* data, size_t size, std::string name = "<memory>");

  SafetensorsFile(SafetensorsFile&&) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&&) noexcept;
  ~SafetensorsFile();

  const std::string& path() const { return path_; }
  // File offset of the data section: 8 + the header length.
  uint64_t data_offset() const { return data_offset_; }
  uint64_t file_size() const { return file_size_; }
  // Tensors sorted by name.
  const std::vector<SafetensorsTensor>& tensors() const { return tensors_; }
  const SafetensorsTensor* find(std::string_view name) const;
  // The "__metadata__" entry (empty when absent).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  friend class SafetensorsParser;  // safetensors.cpp: fills the fields below while validating
  SafetensorsFile() = default;
  std::string path_;
  uint64_t data_offset_ = 0;
  uint64_t file_size_ = 0;
  std::vector<SafetensorsTensor> tensors_;
  std::unordered_map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
  std::unique_ptr<MappedFile> mapping_;
};

}  // namespace kestrel
