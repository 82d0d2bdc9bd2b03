// SafetensorsBuilder: writes safetensors images in memory for tests.
//
// By default the image is valid: the u64 header length, the JSON header (tensors in the order
// given, then "__metadata__" when set) padded with spaces to a multiple of 8 as the reference
// writer does, then each tensor's bytes back to back. header() and data() give the two parts so a
// test can edit the header JSON and reassemble a malformed image with image(); build() records
// where each tensor's bytes landed.
//
//   using kestrel::test::SafetensorsBuilder;
//   auto h = SafetensorsBuilder().f32("a", {2, 3}).header();
//   h["a"]["dtype"] = "F4";
//   auto img = SafetensorsBuilder::image(h.dump(), SafetensorsBuilder().f32("a", {2, 3}).data());
#pragma once

#include <cstdint>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "core/dtype.h"
#include "io/safetensors.h"

namespace kestrel::test {

class SafetensorsBuilder {
 public:
  // A tensor of dtype `dtype` (any string) and shape. Without data its bytes are a fixed pattern
  // of product(shape) x the dtype's size (1 for an unknown dtype).
  SafetensorsBuilder& tensor(std::string name, std::string dtype, std::vector<int64_t> shape,
                             std::vector<uint8_t> data = {}) {
    if (data.empty()) {
      const auto dt = parse_safetensors_dtype(dtype);
      int64_t n = 1;
      for (int64_t d : shape) n *= d;
      data.resize(static_cast<size_t>(n) * (dt ? safetensors_dtype_size(*dt) : 1));
      for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i * 29 + tensors_.size() * 11 + 3);
    }
    tensors_.push_back({std::move(name), std::move(dtype), std::move(shape), std::move(data)});
    return *this;
  }
  // An F32 tensor with the given values (or a pattern when values is empty).
  SafetensorsBuilder& f32(std::string name, std::vector<int64_t> shape, const std::vector<float>& values = {}) {
    std::vector<uint8_t> bytes(values.size() * 4);
    if (!values.empty()) std::memcpy(bytes.data(), values.data(), bytes.size());
    return tensor(std::move(name), "F32", std::move(shape), std::move(bytes));
  }
  // F16 / BF16 tensors from float values, rounded as dtype.h does.
  SafetensorsBuilder& half(std::string name, const std::string& dtype, std::vector<int64_t> shape,
                           const std::vector<float>& values) {
    std::vector<uint8_t> bytes(values.size() * 2);
    for (size_t i = 0; i < values.size(); ++i) {
      const uint16_t h = dtype == "BF16" ? fp32_to_bf16(values[i]) : fp32_to_fp16(values[i]);
      std::memcpy(bytes.data() + 2 * i, &h, 2);
    }
    return tensor(std::move(name), dtype, std::move(shape), std::move(bytes));
  }
  SafetensorsBuilder& metadata(std::string key, std::string value) {
    metadata_[std::move(key)] = std::move(value);
    return *this;
  }

  // The header object (ordered as given), with consecutive data_offsets.
  nlohmann::ordered_json header() const {
    nlohmann::ordered_json h = nlohmann::ordered_json::object();
    uint64_t at = 0;
    for (const auto& t : tensors_) {
      h[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {at, at + t.data.size()}}};
      at += t.data.size();
    }
    if (!metadata_.empty()) h["__metadata__"] = metadata_;
    return h;
  }
  // The data section: every tensor's bytes back to back.
  std::vector<uint8_t> data() const {
    std::vector<uint8_t> out;
    for (const auto& t : tensors_) out.insert(out.end(), t.data.begin(), t.data.end());
    return out;
  }

  // Where the parts of the last build() are.
  struct Layout {
    size_t data_offset = 0;             // start of the data section: 8 + header length
    std::vector<size_t> tensor_begin;   // each tensor's first byte in the file
  };

  std::vector<uint8_t> build(Layout* layout = nullptr) const {
    std::string text = header().dump();
    text.append((8 - text.size() % 8) % 8, ' ');
    const std::vector<uint8_t> img = image(text, data());
    if (layout != nullptr) {
      layout->data_offset = 8 + text.size();
      layout->tensor_begin.clear();
      size_t at = layout->data_offset;
      for (const auto& t : tensors_) {
        layout->tensor_begin.push_back(at);
        at += t.data.size();
      }
    }
    return img;
  }

  // u64 length of header_text, header_text, then data.
  static std::vector<uint8_t> image(const std::string& header_text, const std::vector<uint8_t>& data) {
    std::vector<uint8_t> out(8 + header_text.size() + data.size());
    const uint64_t n = header_text.size();
    std::memcpy(out.data(), &n, 8);
    if (!header_text.empty()) std::memcpy(out.data() + 8, header_text.data(), header_text.size());
    if (!data.empty()) std::memcpy(out.data() + 8 + header_text.size(), data.data(), data.size());
    return out;
  }

 private:
  struct Tensor {
    std::string name;
    std::string dtype;
    std::vector<int64_t> shape;
    std::vector<uint8_t> data;
  };
  std::vector<Tensor> tensors_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace kestrel::test
