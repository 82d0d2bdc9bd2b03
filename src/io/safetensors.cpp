// Safetensors reader. The header is parsed with nlohmann::json (a callback rejects repeated names,
// which the JSON library would otherwise resolve silently), then each entry is checked field by
// field and placed in the data section; finally the byte ranges, sorted by start, must not
// overlap. See safetensors.h for the rules.
#include "io/safetensors.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <unordered_set>

#include "core/error.h"
#include "io/mapped_file.h"
#include "io/quoted.h"
#include "io/json_text.h"

namespace kestrel {
namespace {

using nlohmann::json;

constexpr uint64_t kMaxHeaderBytes = 100'000'000;  // as the reference implementation
constexpr const char* kMetadataKey = "__metadata__";

struct DtypeInfo {
  SafetensorsDtype dtype;
  std::string_view name;
  size_t size;
};
constexpr DtypeInfo kDtypes[] = {
    {SafetensorsDtype::BOOL, "BOOL", 1},       {SafetensorsDtype::U8, "U8", 1},
    {SafetensorsDtype::I8, "I8", 1},           {SafetensorsDtype::I16, "I16", 2},
    {SafetensorsDtype::I32, "I32", 4},         {SafetensorsDtype::I64, "I64", 8},
    {SafetensorsDtype::F8_E4M3, "F8_E4M3", 1}, {SafetensorsDtype::F8_E5M2, "F8_E5M2", 1},
    {SafetensorsDtype::F16, "F16", 2},         {SafetensorsDtype::BF16, "BF16", 2},
    {SafetensorsDtype::F32, "F32", 4},         {SafetensorsDtype::F64, "F64", 8},
};

const DtypeInfo& info(SafetensorsDtype t) {
  for (const auto& d : kDtypes)
    if (d.dtype == t) return d;
  KESTREL_ASSERT(false, "invalid SafetensorsDtype");
}

std::string known_dtypes() {
  std::string s;
  for (const auto& d : kDtypes) s += (s.empty() ? "" : ", ") + std::string(d.name);
  return s;
}

std::string shown(const json& j) { return json_shown(j); }

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

}  // namespace

std::string_view safetensors_dtype_name(SafetensorsDtype t) { return info(t).name; }
size_t safetensors_dtype_size(SafetensorsDtype t) { return info(t).size; }

std::optional<SafetensorsDtype> parse_safetensors_dtype(std::string_view name) {
  for (const auto& d : kDtypes)
    if (d.name == name) return d.dtype;
  return std::nullopt;
}

std::optional<GgmlType> to_ggml_type(SafetensorsDtype t) {
  switch (t) {
    case SafetensorsDtype::F32: return GgmlType::F32;
    case SafetensorsDtype::F16: return GgmlType::F16;
    case SafetensorsDtype::BF16: return GgmlType::BF16;
    default: return std::nullopt;
  }
}

int64_t SafetensorsTensor::n_elements() const {
  int64_t n = 1;
  for (const int64_t d : shape) n *= d;
  return n;
}

// Fills a SafetensorsFile from an image; every defect ends in one Error naming the file.
class SafetensorsParser {
 public:
  SafetensorsParser(SafetensorsFile& file, const uint8_t* data, size_t size)
      : file_(file), data_(data), size_(size) {}

  void run() {
    file_.file_size_ = size_;
    const json header = read_header();
    for (const auto& [name, entry] : header.items()) {
      if (name == kMetadataKey)
        read_metadata(entry);
      else
        read_tensor(name, entry);
    }
    std::sort(file_.tensors_.begin(), file_.tensors_.end(),
              [](const auto& a, const auto& b) { return a.name < b.name; });
    for (size_t i = 0; i < file_.tensors_.size(); ++i) file_.index_.emplace(file_.tensors_[i].name, i);
    check_overlaps();
  }

 private:
  [[noreturn]] void fail(const std::string& message) const { throw Error(file_.path_ + ": " + message); }

  json read_header() {
    if (size_ < 8)
      fail("truncated or corrupt file: " + std::to_string(size_) +
           " bytes, shorter than the 8-byte header length field");
    uint64_t n = 0;
    std::memcpy(&n, data_, 8);  // little-endian on the hosts kestrel supports
    if (n > kMaxHeaderBytes)
      fail("header length " + std::to_string(n) + " exceeds the limit of " +
           std::to_string(kMaxHeaderBytes) + " bytes (not a safetensors file?)");
    if (n > size_ - 8)
      fail("truncated or corrupt file: header length " + std::to_string(n) + " exceeds the " +
           std::to_string(size_ - 8) + " bytes after the length field");
    file_.data_offset_ = 8 + n;
    data_size_ = size_ - file_.data_offset_;

    // Rejects a name given twice at the top level; the library would keep only the last one.
    std::unordered_set<std::string> seen;
    const json::parser_callback_t on_event = [&](int depth, json::parse_event_t event, json& parsed) {
      if (depth == 1 && event == json::parse_event_t::key) {
        const auto& key = parsed.get_ref<const std::string&>();
        if (!seen.insert(key).second) fail("header names " + quoted_name(key) + " twice");
      }
      return true;
    };
    const auto* first = reinterpret_cast<const char*>(data_ + 8);
    json header;
    try {
      header = json::parse(first, first + n, on_event);
    } catch (const json::exception& e) {
      fail("header is not valid JSON: " + std::string(e.what()));
    }
    if (!header.is_object()) fail("header is not a JSON object but " + std::string(header.type_name()));
    return header;
  }

  void read_metadata(const json& entry) {
    if (!entry.is_object())
      fail(std::string(kMetadataKey) + " must be an object of strings, got " + entry.type_name());
    for (const auto& [key, value] : entry.items()) {
      if (!value.is_string())
        fail(std::string(kMetadataKey) + " value of " + quoted_name(key) + " must be a string, got " +
             shown(value));
      file_.metadata_.emplace(key, value.get<std::string>());
    }
  }

  // A non-negative integer of a JSON field, or an error naming the tensor and the field.
  uint64_t non_negative(const json& v, const std::string& who, const std::string& field) const {
    if (v.is_number_unsigned()) return v.get<uint64_t>();
    if (v.is_number_integer()) fail(who + ": " + field + " is negative: " + shown(v));
    fail(who + ": " + field + " must be an integer, got " + shown(v));
  }

  const json& field(const json& entry, const char* name, const std::string& who) const {
    const auto it = entry.find(name);
    if (it == entry.end()) fail(who + ": missing field '" + name + "'");
    return *it;
  }

  void read_tensor(const std::string& name, const json& entry) {
    const std::string who = "tensor " + quoted_name(name);
    if (!entry.is_object()) fail(who + ": entry must be an object, got " + shown(entry));
    SafetensorsTensor t;
    t.name = name;

    const json& dtype = field(entry, "dtype", who);
    if (!dtype.is_string()) fail(who + ": field 'dtype' must be a string, got " + shown(dtype));
    const auto dt = parse_safetensors_dtype(dtype.get_ref<const std::string&>());
    if (!dt) fail(who + ": unknown dtype " + quoted_name(dtype.get_ref<const std::string&>()) + " (known: " +
                  known_dtypes() + ")");
    t.dtype = *dt;

    const json& shape = field(entry, "shape", who);
    if (!shape.is_array()) fail(who + ": field 'shape' must be an array, got " + shown(shape));
    int64_t n_elements = 1;
    for (size_t i = 0; i < shape.size(); ++i) {
      const uint64_t d = non_negative(shape[i], who, "shape[" + std::to_string(i) + "]");
      if (d > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) ||
          __builtin_mul_overflow(n_elements, static_cast<int64_t>(d), &n_elements))
        fail(who + ": element count of shape " + shown(shape) + " overflows int64");
      t.shape.push_back(static_cast<int64_t>(d));
    }
    uint64_t expected_bytes = 0;
    if (__builtin_mul_overflow(static_cast<uint64_t>(n_elements), safetensors_dtype_size(t.dtype),
                               &expected_bytes))
      fail(who + ": byte size of " + std::string(safetensors_dtype_name(t.dtype)) + " " +
           shape_text(t.shape) + " overflows 64 bits");

    const json& offsets = field(entry, "data_offsets", who);
    if (!offsets.is_array() || offsets.size() != 2)
      fail(who + ": field 'data_offsets' must be an array [begin, end], got " + shown(offsets));
    t.begin = non_negative(offsets[0], who, "data_offsets[0]");
    t.end = non_negative(offsets[1], who, "data_offsets[1]");
    if (t.begin > t.end)
      fail(who + ": data_offsets [" + std::to_string(t.begin) + ", " + std::to_string(t.end) +
           "] end before they begin");
    if (t.n_bytes() != expected_bytes)
      fail(who + ": data_offsets [" + std::to_string(t.begin) + ", " + std::to_string(t.end) + "] hold " +
           std::to_string(t.n_bytes()) + " bytes, but " + std::string(safetensors_dtype_name(t.dtype)) +
           " " + shape_text(t.shape) + " needs " + std::to_string(expected_bytes));
    if (t.end > data_size_)
      fail("truncated or corrupt file: " + who + " data_offsets [" + std::to_string(t.begin) + ", " +
           std::to_string(t.end) + "] run past the end of the data section, which has " +
           std::to_string(data_size_) + " bytes (from byte " + std::to_string(file_.data_offset_) +
           " of a " + std::to_string(size_) + "-byte file)");
    t.data = data_ + file_.data_offset_ + t.begin;
    file_.tensors_.push_back(std::move(t));
  }

  // Tensors may be stored in any order; sorted by start, each must end before the next starts.
  // Empty tensors occupy no bytes and cannot overlap anything.
  void check_overlaps() const {
    std::vector<const SafetensorsTensor*> by_begin;
    for (const auto& t : file_.tensors_)
      if (t.n_bytes() > 0) by_begin.push_back(&t);
    std::sort(by_begin.begin(), by_begin.end(),
              [](const auto* a, const auto* b) { return a->begin < b->begin; });
    for (size_t i = 1; i < by_begin.size(); ++i) {
      const auto& p = *by_begin[i - 1];
      const auto& q = *by_begin[i];
      if (p.end > q.begin)
        fail("tensors " + quoted_name(p.name) + " (bytes " + std::to_string(p.begin) + ".." +
             std::to_string(p.end) + ") and " + quoted_name(q.name) + " (from byte " + std::to_string(q.begin) +
             ") overlap in the data section");
    }
  }

  SafetensorsFile& file_;
  const uint8_t* data_;
  size_t size_;
  uint64_t data_size_ = 0;
};

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  auto mapping = std::make_unique<MappedFile>(path);
  SafetensorsFile f = parse(mapping->data(), mapping->size(), path);
  f.mapping_ = std::move(mapping);  // the tensors' data pointers stay valid: the mapping moves
  return f;
}

SafetensorsFile SafetensorsFile::parse(const uint8_t* data, size_t size, std::string name) {
  if (data == nullptr && size != 0)
    throw Error(name + ": null buffer of " + std::to_string(size) + " bytes");
  SafetensorsFile f;
  f.path_ = std::move(name);
  SafetensorsParser(f, data, size).run();
  return f;
}

SafetensorsFile::SafetensorsFile(SafetensorsFile&&) noexcept = default;
SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&&) noexcept = default;
SafetensorsFile::~SafetensorsFile() = default;

const SafetensorsTensor* SafetensorsFile::find(std::string_view name) const {
  const auto it = index_.find(std::string(name));
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

}  // namespace kestrel
