// GGUF reader. One pass of a ByteCursor over the image reads the header, the metadata and the
// tensor infos, checking each count against the bytes left before anything is sized from it; then
// the tensors are placed in the data section and checked for bounds and overlaps. The layout comes
// from ggml's docs/gguf.md; see gguf.h for the rules enforced beyond it.
#include "io/gguf.h"

#include <algorithm>
#include <cstdio>
#include <limits>

#include "core/error.h"
#include "io/byte_cursor.h"
#include "io/mapped_file.h"
#include "io/quoted.h"

namespace kestrel {
namespace {

using VT = GgufValueType;

constexpr uint32_t kMagic = 0x46554747;  // "GGUF" read as a little-endian u32
constexpr uint32_t kMaxDims = 4;         // GGML_MAX_DIMS: ggml cannot hold more
constexpr int kMaxArrayDepth = 8;        // bounds the recursion on arrays of arrays
// The smallest encoding each counted item can have, whether or not its contents are then valid
// (so a file with an empty key still gets the empty-key error). A count that the bytes left cannot
// hold at this size is rejected before any container is reserved.
constexpr uint64_t kMinKvBytes = 8 + 4 + 1;              // key length, type id, a 1-byte value
constexpr uint64_t kMinTensorInfoBytes = 8 + 4 + 4 + 8;  // name length, n_dims, type, offset
constexpr uint64_t kMinStringBytes = 8;                  // the length field
constexpr uint64_t kMinNestedArrayBytes = 4 + 8;         // element type, count

// How a value type is stored in GgufValue.
enum class Storage { Int, Uint, Float, Bool, String, Array };

Storage storage_of(VT t) {
  switch (t) {
    case VT::INT8:
    case VT::INT16:
    case VT::INT32:
    case VT::INT64: return Storage::Int;
    case VT::UINT8:
    case VT::UINT16:
    case VT::UINT32:
    case VT::UINT64: return Storage::Uint;
    case VT::FLOAT32:
    case VT::FLOAT64: return Storage::Float;
    case VT::BOOL: return Storage::Bool;
    case VT::STRING: return Storage::String;
    case VT::ARRAY: return Storage::Array;
  }
  KESTREL_ASSERT(false, "invalid GgufValueType " + std::to_string(static_cast<uint32_t>(t)));
}

// Bytes of one element on disk; 0 for the variable-size STRING and ARRAY.
uint64_t fixed_size(VT t) {
  switch (t) {
    case VT::UINT8:
    case VT::INT8:
    case VT::BOOL: return 1;
    case VT::UINT16:
    case VT::INT16: return 2;
    case VT::UINT32:
    case VT::INT32:
    case VT::FLOAT32: return 4;
    case VT::UINT64:
    case VT::INT64:
    case VT::FLOAT64: return 8;
    case VT::STRING:
    case VT::ARRAY: return 0;
  }
  return 0;
}

std::string type_desc(const GgufValue& v) {
  std::string d(gguf_value_type_name(v.type));
  if (v.is_array()) d += " of " + std::string(gguf_value_type_name(v.array_type));
  return d;
}

}  // namespace

std::string_view gguf_value_type_name(GgufValueType t) {
  switch (t) {
    case VT::UINT8: return "UINT8";
    case VT::INT8: return "INT8";
    case VT::UINT16: return "UINT16";
    case VT::INT16: return "INT16";
    case VT::UINT32: return "UINT32";
    case VT::INT32: return "INT32";
    case VT::FLOAT32: return "FLOAT32";
    case VT::BOOL: return "BOOL";
    case VT::STRING: return "STRING";
    case VT::ARRAY: return "ARRAY";
    case VT::UINT64: return "UINT64";
    case VT::INT64: return "INT64";
    case VT::FLOAT64: return "FLOAT64";
  }
  return "INVALID";
}

size_t GgufValue::array_size() const {
  if (!is_array()) return 0;
  switch (storage_of(array_type)) {
    case Storage::Int: return ints.size();
    case Storage::Uint: return uints.size();
    case Storage::Float: return floats.size();
    case Storage::Bool: return bools.size();
    case Storage::String: return strings.size();
    case Storage::Array: return arrays.size();
  }
  return 0;
}

int64_t GgufTensorInfo::n_elements() const {
  int64_t n = 1;
  for (const int64_t d : ne) n *= d;  // no overflow: the parser checked the product
  return n;
}

// Fills a GgufFile from an image; every defect ends in one Error from the cursor.
class GgufParser {
 public:
  GgufParser(GgufFile& file, const uint8_t* data, size_t size)
      : file_(file), data_(data), cur_(data, size, file.path_) {}

  void run() {
    read_header();
    file_.kv_.reserve(static_cast<size_t>(n_kv_));
    for (uint64_t i = 0; i < n_kv_; ++i) read_kv(i);
    read_alignment();
    file_.tensors_.reserve(static_cast<size_t>(n_tensors_));
    for (uint64_t i = 0; i < n_tensors_; ++i) read_tensor_info(i);
    place_tensors();
  }

 private:
  [[noreturn]] void fail(const std::string& message) const { cur_.fail(message); }

  // Throws the truncation error unless count items of at least min_bytes each fit in what is left.
  void check_count(uint64_t count, uint64_t min_bytes, const std::string& what) const {
    if (count > cur_.remaining() / min_bytes)
      cur_.fail_short(what + " " + std::to_string(count) + " at offset " +
                      std::to_string(cur_.offset()) + " needs at least " +
                      std::to_string(min_bytes) + " bytes each, only " +
                      std::to_string(cur_.remaining()) + " left");
  }

  void read_header() {
    const auto magic = cur_.read<uint32_t>();
    if (magic != kMagic) {
      char hex[16];
      std::snprintf(hex, sizeof hex, "0x%08x", magic);
      fail(std::string("bad magic ") + hex + " (not a GGUF file; expected \"GGUF\")");
    }
    file_.version_ = cur_.read<uint32_t>();
    if (file_.version_ != 2 && file_.version_ != 3) {
      std::string msg = "unsupported GGUF version " + std::to_string(file_.version_);
      if (file_.version_ == 1) msg += " (v1 used 32-bit counts; kestrel reads v2 and v3)";
      if (file_.version_ > 0xffff) msg += " (a big-endian file? kestrel reads little-endian)";
      fail(msg);
    }
    n_tensors_ = cur_.read<uint64_t>();
    n_kv_ = cur_.read<uint64_t>();
    check_count(n_kv_, kMinKvBytes, "metadata_kv_count");
    check_count(n_tensors_, kMinTensorInfoBytes, "tensor_count");
    // Each product is at most remaining(), so the sum cannot overflow.
    if (n_kv_ * kMinKvBytes + n_tensors_ * kMinTensorInfoBytes > cur_.remaining())
      cur_.fail_short("tensor_count " + std::to_string(n_tensors_) + " and metadata_kv_count " +
                      std::to_string(n_kv_) + " cannot both fit in the " +
                      std::to_string(cur_.remaining()) + " bytes left");
  }

  VT read_type(const std::string& what) {
    const auto id = cur_.read<uint32_t>();
    if (id > static_cast<uint32_t>(VT::FLOAT64))
      fail("bad value type id " + std::to_string(id) + " for " + what + " (valid: 0..12)");
    return static_cast<VT>(id);
  }

  void read_kv(uint64_t index) {
    cur_.set_context("key of metadata entry #" + std::to_string(index));
    std::string key = cur_.read_string();
    if (key.empty()) fail("metadata entry #" + std::to_string(index) + " has an empty key");
    if (file_.kv_index_.count(key) != 0) fail("duplicate metadata key " + quoted_name(key));
    const std::string who = "key " + quoted_name(key);
    cur_.set_context("value of " + who);
    GgufValue v;
    v.type = read_type(who);
    if (v.type == VT::ARRAY)
      read_array(v, who, 1);
    else
      read_scalar(v, who);
    file_.kv_index_.emplace(key, file_.kv_.size());
    file_.kv_.emplace_back(std::move(key), std::move(v));
  }

  int64_t read_int(VT t) {
    switch (t) {
      case VT::INT8: return cur_.read<int8_t>();
      case VT::INT16: return cur_.read<int16_t>();
      case VT::INT32: return cur_.read<int32_t>();
      default: return cur_.read<int64_t>();
    }
  }
  uint64_t read_uint(VT t) {
    switch (t) {
      case VT::UINT8: return cur_.read<uint8_t>();
      case VT::UINT16: return cur_.read<uint16_t>();
      case VT::UINT32: return cur_.read<uint32_t>();
      default: return cur_.read<uint64_t>();
    }
  }
  double read_float(VT t) {
    return t == VT::FLOAT32 ? static_cast<double>(cur_.read<float>()) : cur_.read<double>();
  }
  bool read_bool(const std::string& who) {
    const auto b = cur_.read<uint8_t>();
    if (b > 1)
      fail("bad bool value " + std::to_string(b) + " at offset " +
           std::to_string(cur_.offset() - 1) + " in " + who + " (must be 0 or 1)");
    return b == 1;
  }

  void read_scalar(GgufValue& v, const std::string& who) {
    switch (storage_of(v.type)) {
      case Storage::Int: v.scalar = read_int(v.type); break;
      case Storage::Uint: v.scalar = read_uint(v.type); break;
      case Storage::Float: v.scalar = read_float(v.type); break;
      case Storage::Bool: v.scalar = read_bool(who); break;
      case Storage::String: v.scalar = cur_.read_string(); break;
      case Storage::Array: KESTREL_ASSERT(false, "arrays go through read_array");
    }
  }

  // Reads an array's element type, count and elements into v (v.type is already ARRAY). depth is
  // 1 for a metadata value, 2 for an array inside it, and so on.
  void read_array(GgufValue& v, const std::string& who, int depth) {
    if (depth > kMaxArrayDepth)
      fail(who + " nests arrays deeper than " + std::to_string(kMaxArrayDepth) + " levels");
    v.array_type = read_type("array elements in " + who);
    const auto n = cur_.read<uint64_t>();
    const VT t = v.array_type;
    const uint64_t min_bytes = t == VT::STRING  ? kMinStringBytes
                               : t == VT::ARRAY ? kMinNestedArrayBytes
                                                : fixed_size(t);
    check_count(n, min_bytes,
                "array of " + std::string(gguf_value_type_name(t)) + ": element count");
    const auto count = static_cast<size_t>(n);
    switch (storage_of(t)) {
      case Storage::Int:
        v.ints.reserve(count);
        for (size_t i = 0; i < count; ++i) v.ints.push_back(read_int(t));
        break;
      case Storage::Uint:
        v.uints.reserve(count);
        for (size_t i = 0; i < count; ++i) v.uints.push_back(read_uint(t));
        break;
      case Storage::Float:
        v.floats.reserve(count);
        for (size_t i = 0; i < count; ++i) v.floats.push_back(read_float(t));
        break;
      case Storage::Bool:
        v.bools.reserve(count);
        for (size_t i = 0; i < count; ++i) v.bools.push_back(read_bool(who) ? 1 : 0);
        break;
      case Storage::String:
        v.strings.reserve(count);
        for (size_t i = 0; i < count; ++i) v.strings.push_back(cur_.read_string());
        break;
      case Storage::Array:
        v.arrays.reserve(count);
        for (size_t i = 0; i < count; ++i) {
          GgufValue e;
          e.type = VT::ARRAY;
          read_array(e, who, depth + 1);
          v.arrays.push_back(std::move(e));
        }
        break;
    }
  }

  void read_alignment() {
    const GgufValue* v = file_.find("general.alignment");
    if (v == nullptr) return;
    if (v->type != VT::UINT32) fail("general.alignment must be UINT32, not " + type_desc(*v));
    const auto a = std::get<uint64_t>(v->scalar);
    if (a == 0 || (a & (a - 1)) != 0)
      fail("general.alignment " + std::to_string(a) + " is not a nonzero power of two");
    file_.alignment_ = a;
  }

  void read_tensor_info(uint64_t index) {
    cur_.set_context("name of tensor #" + std::to_string(index));
    GgufTensorInfo t;
    t.name = cur_.read_string();
    if (t.name.empty()) fail("tensor #" + std::to_string(index) + " has an empty name");
    if (file_.tensor_index_.count(t.name) != 0) fail("duplicate tensor name " + quoted_name(t.name));
    const std::string who = "tensor " + quoted_name(t.name);
    cur_.set_context("info of " + who);

    const auto n_dims = cur_.read<uint32_t>();
    if (n_dims == 0 || n_dims > kMaxDims)
      fail(who + ": n_dims " + std::to_string(n_dims) + " is outside [1, " +
           std::to_string(kMaxDims) + "]");
    for (uint32_t d = 0; d < n_dims; ++d)
      t.ne.push_back(static_cast<int64_t>(cur_.read<uint64_t>()));
    int64_t n_elements = 1;
    for (uint32_t d = 0; d < n_dims; ++d) {
      if (t.ne[d] <= 0)
        fail(who + ": dimension ne[" + std::to_string(d) + "] = " + std::to_string(t.ne[d]) +
             " is not positive");
      if (__builtin_mul_overflow(n_elements, t.ne[d], &n_elements))
        fail(who + ": element count " + shape(t.ne) + " overflows int64");
    }

    const auto type_id = cur_.read<uint32_t>();
    const auto traits = type_traits(type_id);
    if (!traits) fail(who + ": unknown tensor type " + std::to_string(type_id));
    t.type = static_cast<GgmlType>(type_id);
    if (t.ne[0] % traits->block_size != 0)
      fail(who + ": ne[0] = " + std::to_string(t.ne[0]) + " is not a multiple of the " +
           std::string(traits->name) + " block size " + std::to_string(traits->block_size));
    // Bytes = blocks per row * block bytes * rows, each step checked before row_bytes computes it.
    const auto blocks_per_row = static_cast<uint64_t>(t.ne[0] / traits->block_size);
    const auto n_rows = static_cast<uint64_t>(n_elements / t.ne[0]);
    if (blocks_per_row > std::numeric_limits<uint64_t>::max() / traits->block_bytes ||
        n_rows > std::numeric_limits<uint64_t>::max() / (blocks_per_row * traits->block_bytes))
      fail(who + ": byte size of " + std::string(traits->name) + " " + shape(t.ne) +
           " overflows 64 bits");
    t.n_bytes = static_cast<uint64_t>(row_bytes(t.type, t.ne[0])) * n_rows;

    t.offset = cur_.read<uint64_t>();
    if (t.offset % file_.alignment_ != 0)
      fail(who + ": data offset " + std::to_string(t.offset) +
           " is misaligned (not a multiple of " + "the alignment " +
           std::to_string(file_.alignment_) + ")");
    file_.tensor_index_.emplace(t.name, file_.tensors_.size());
    file_.tensors_.push_back(std::move(t));
  }

  static std::string shape(const std::vector<int64_t>& ne) {
    std::string s = "[";
    for (size_t i = 0; i < ne.size(); ++i) s += (i ? ", " : "") + std::to_string(ne[i]);
    return s + "]";
  }

  void place_tensors() {
    const uint64_t size = cur_.size();
    const uint64_t a = file_.alignment_;
    const uint64_t aligned = (cur_.offset() + a - 1) / a * a;
    // A vocab-only file may stop before the padding; its (empty) data section then starts at EOF.
    file_.data_offset_ = file_.tensors_.empty() ? std::min(aligned, size) : aligned;
    const uint64_t data_size = file_.data_offset_ <= size ? size - file_.data_offset_ : 0;
    for (auto& t : file_.tensors_) {
      if (t.offset > data_size || t.n_bytes > data_size - t.offset)
        fail("truncated or corrupt file: tensor " + quoted_name(t.name) +
             " data is out of bounds: " + std::to_string(t.n_bytes) + " bytes at offset " +
             std::to_string(t.offset) + " of the data section, which starts at byte " +
             std::to_string(file_.data_offset_) + " of a " + std::to_string(size) + "-byte file");
      t.data = data_ + file_.data_offset_ + t.offset;
    }
    // Tensors may be stored in any order; sorted by offset, each must end before the next starts.
    std::vector<const GgufTensorInfo*> by_offset;
    by_offset.reserve(file_.tensors_.size());
    for (const auto& t : file_.tensors_) by_offset.push_back(&t);
    std::sort(by_offset.begin(), by_offset.end(),
              [](const auto* x, const auto* y) { return x->offset < y->offset; });
    for (size_t i = 1; i < by_offset.size(); ++i) {
      const auto& p = *by_offset[i - 1];
      const auto& q = *by_offset[i];
      if (p.offset + p.n_bytes > q.offset)
        fail("tensors " + quoted_name(p.name) + " (bytes " + std::to_string(p.offset) + ".." +
             std::to_string(p.offset + p.n_bytes) + ") and " + quoted_name(q.name) + " (from byte " +
             std::to_string(q.offset) + ") overlap in the data section");
    }
  }

  GgufFile& file_;
  const uint8_t* data_;
  ByteCursor cur_;
  uint64_t n_tensors_ = 0;
  uint64_t n_kv_ = 0;
};

GgufFile GgufFile::open(const std::string& path) {
  auto mapping = std::make_unique<MappedFile>(path);
  GgufFile f = parse(mapping->data(), mapping->size(), path);
  f.mapping_ = std::move(mapping);  // the tensors' data pointers stay valid: the mapping moves
  return f;
}

GgufFile GgufFile::parse(const uint8_t* data, size_t size, std::string name) {
  if (data == nullptr && size != 0)
    throw Error(name + ": null buffer of " + std::to_string(size) + " bytes");
  GgufFile f;
  f.path_ = std::move(name);
  GgufParser(f, data, size).run();
  return f;
}

GgufFile::GgufFile(GgufFile&&) noexcept = default;
GgufFile& GgufFile::operator=(GgufFile&&) noexcept = default;
GgufFile::~GgufFile() = default;

const GgufValue* GgufFile::find(std::string_view key) const {
  const auto it = kv_index_.find(std::string(key));
  return it == kv_index_.end() ? nullptr : &kv_[it->second].second;
}

const GgufTensorInfo* GgufFile::find_tensor(std::string_view name) const {
  const auto it = tensor_index_.find(std::string(name));
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

// ---- typed getters ----
namespace {

[[noreturn]] void key_error(const GgufFile& f, std::string_view key, const std::string& problem) {
  throw Error(f.path() + ": key " + quoted_name(key) + " " + problem);
}

const GgufValue& require(const GgufFile& f, std::string_view key) {
  if (const GgufValue* v = f.find(key)) return *v;
  key_error(f, key, "is missing");
}

[[noreturn]] void type_error(const GgufFile& f, std::string_view key, const GgufValue& v,
                             const char* expected) {
  key_error(f, key, "is " + type_desc(v) + ", expected " + expected);
}

int64_t checked_int(const GgufFile& f, std::string_view key, uint64_t u) {
  if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
    key_error(f, key, "value " + std::to_string(u) + " does not fit in int64");
  return static_cast<int64_t>(u);
}

int64_t as_int(const GgufFile& f, std::string_view key, const GgufValue& v) {
  if (const auto* i = std::get_if<int64_t>(&v.scalar)) return *i;
  if (const auto* u = std::get_if<uint64_t>(&v.scalar)) return checked_int(f, key, *u);
  type_error(f, key, v, "an integer");
}

double as_float(const GgufFile& f, std::string_view key, const GgufValue& v) {
  if (const auto* d = std::get_if<double>(&v.scalar)) return *d;
  if (const auto* i = std::get_if<int64_t>(&v.scalar)) return static_cast<double>(*i);
  if (const auto* u = std::get_if<uint64_t>(&v.scalar)) return static_cast<double>(*u);
  type_error(f, key, v, "a number");
}

}  // namespace

std::string GgufFile::get_string(std::string_view key) const {
  const GgufValue& v = require(*this, key);
  if (const auto* s = std::get_if<std::string>(&v.scalar)) return *s;
  type_error(*this, key, v, "STRING");
}

std::string GgufFile::get_string_or(std::string_view key, std::string fallback) const {
  return has(key) ? get_string(key) : std::move(fallback);
}

int64_t GgufFile::get_int(std::string_view key) const {
  return as_int(*this, key, require(*this, key));
}

int64_t GgufFile::get_int_or(std::string_view key, int64_t fallback) const {
  const GgufValue* v = find(key);
  return v == nullptr ? fallback : as_int(*this, key, *v);
}

int64_t GgufFile::get_int_in(std::string_view key, int64_t lo, int64_t hi) const {
  const int64_t x = get_int(key);
  if (x < lo || x > hi)
    key_error(*this, key,
              "value " + std::to_string(x) + " is outside [" + std::to_string(lo) + ", " +
                  std::to_string(hi) + "]");
  return x;
}

double GgufFile::get_float(std::string_view key) const {
  return as_float(*this, key, require(*this, key));
}

double GgufFile::get_float_or(std::string_view key, double fallback) const {
  const GgufValue* v = find(key);
  return v == nullptr ? fallback : as_float(*this, key, *v);
}

bool GgufFile::get_bool_or(std::string_view key, bool fallback) const {
  const GgufValue* v = find(key);
  if (v == nullptr) return fallback;
  if (const auto* b = std::get_if<bool>(&v->scalar)) return *b;
  type_error(*this, key, *v, "BOOL");
}

const std::vector<std::string>& GgufFile::get_string_array(std::string_view key) const {
  const GgufValue& v = require(*this, key);
  if (!v.is_array() || v.array_type != VT::STRING) type_error(*this, key, v, "ARRAY of STRING");
  return v.strings;
}

std::vector<float> GgufFile::get_float_array(std::string_view key) const {
  const GgufValue& v = require(*this, key);
  if (!v.is_array()) type_error(*this, key, v, "an ARRAY of numbers");
  switch (storage_of(v.array_type)) {
    case Storage::Float: return std::vector<float>(v.floats.begin(), v.floats.end());
    case Storage::Int: return std::vector<float>(v.ints.begin(), v.ints.end());
    case Storage::Uint: return std::vector<float>(v.uints.begin(), v.uints.end());
    default: type_error(*this, key, v, "an ARRAY of numbers");
  }
}

std::vector<int64_t> GgufFile::get_int_array(std::string_view key) const {
  const GgufValue& v = require(*this, key);
  if (!v.is_array()) type_error(*this, key, v, "an ARRAY of integers");
  switch (storage_of(v.array_type)) {
    case Storage::Int: return v.ints;
    case Storage::Uint: {
      std::vector<int64_t> out;
      out.reserve(v.uints.size());
      for (const uint64_t u : v.uints) out.push_back(checked_int(*this, key, u));
      return out;
    }
    default: type_error(*this, key, v, "an ARRAY of integers");
  }
}

}  // namespace kestrel
