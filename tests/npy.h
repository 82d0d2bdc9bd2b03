// Reads a NumPy .npy file (format versions 1.0 and 2.0; NumPy's "format.py" spec): little-endian
// float32 ('<f4') or int32/int64 ('<i4', '<i8') arrays in C order, as the reference generators
// write them. The test machines have no numpy, so the C++ tests read the references themselves.
#pragma once

#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include "core/error.h"

namespace kestrel::test {

struct NpyArray {
  std::vector<int64_t> shape;
  std::vector<double> values;  // every element, converted (f32 and i32 are exact in double)
  int64_t size() const { return static_cast<int64_t>(values.size()); }
};

// Throws kestrel::Error naming the file for a missing file, a bad header, an unsupported dtype,
// Fortran order, or data shorter than the shape says.
inline NpyArray read_npy(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw Error(path + ": cannot open");
  const std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (bytes.size() < 10 || bytes.compare(0, 6, "\x93NUMPY") != 0) throw Error(path + ": not a .npy file");
  const int major = static_cast<uint8_t>(bytes[6]);
  size_t header_len = 0, at = 0;
  if (major == 1) {
    header_len = static_cast<uint8_t>(bytes[8]) | static_cast<size_t>(static_cast<uint8_t>(bytes[9])) << 8;
    at = 10;
  } else if (major == 2 || major == 3) {
    if (bytes.size() < 12) throw Error(path + ": truncated header");
    for (int i = 0; i < 4; ++i) header_len |= static_cast<size_t>(static_cast<uint8_t>(bytes[8 + i])) << (8 * i);
    at = 12;
  } else {
    throw Error(path + ": .npy version " + std::to_string(major) + " is not supported");
  }
  if (bytes.size() < at + header_len) throw Error(path + ": truncated header");
  const std::string header = bytes.substr(at, header_len);
  at += header_len;
  auto field = [&](const std::string& key) {
    const size_t k = header.find("'" + key + "'");
    if (k == std::string::npos) throw Error(path + ": header lacks '" + key + "'");
    return header.substr(header.find(':', k) + 1);
  };
  const std::string descr_field = field("descr");
  const size_t q0 = descr_field.find('\''), q1 = descr_field.find('\'', q0 + 1);
  const std::string descr = descr_field.substr(q0 + 1, q1 - q0 - 1);
  const std::string order = field("fortran_order");
  if (order.substr(0, order.find(',')).find("True") != std::string::npos)
    throw Error(path + ": Fortran order is not supported");
  NpyArray a;
  const std::string shape_field = field("shape");
  std::stringstream shape(shape_field.substr(shape_field.find('(') + 1, shape_field.find(')') - shape_field.find('(') - 1));
  for (std::string dim; std::getline(shape, dim, ',');)
    if (dim.find_first_not_of(' ') != std::string::npos) a.shape.push_back(std::stoll(dim));
  int64_t n = 1;
  for (int64_t d : a.shape) n *= d;
  const size_t width = descr == "<f4" || descr == "<i4" ? 4 : descr == "<i8" ? 8 : 0;
  if (width == 0) throw Error(path + ": dtype " + descr + " is not supported (<f4, <i4, <i8)");
  if (bytes.size() < at + static_cast<size_t>(n) * width) throw Error(path + ": data shorter than the shape");
  a.values.resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const char* p = bytes.data() + at + static_cast<size_t>(i) * width;
    if (descr == "<f4") {
      float v;
      std::memcpy(&v, p, 4);
      a.values[static_cast<size_t>(i)] = v;
    } else if (descr == "<i4") {
      int32_t v;
      std::memcpy(&v, p, 4);
      a.values[static_cast<size_t>(i)] = v;
    } else {
      int64_t v;
      std::memcpy(&v, p, 8);
      a.values[static_cast<size_t>(i)] = static_cast<double>(v);
    }
  }
  return a;
}

}  // namespace kestrel::test
