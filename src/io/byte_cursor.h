// Bounds-checked little-endian reader over an in-memory binary image (the GGUF reader's cursor).
//
// Every read checks the bytes left first, so a truncated or corrupt file turns into one
// kestrel::Error("<name>: truncated or corrupt file: <context>: ...") instead of a read past the
// end. The context names what was being read ("metadata key #3", "value of 'general.name'") and is
// set by the caller before each group of reads.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>

#include "core/error.h"

namespace kestrel {

// Fields are copied byte for byte, which is a little-endian decode only on little-endian hosts.
static_assert(std::endian::native == std::endian::little,
              "ByteCursor assumes a little-endian host");

class ByteCursor {
 public:
  // data may be null only when size is 0. name prefixes every error message (a path, or
  // "<memory>").
  ByteCursor(const uint8_t* data, size_t size, std::string name)
      : data_(data), size_(size), name_(std::move(name)) {}

  size_t offset() const { return pos_; }
  size_t size() const { return size_; }
  size_t remaining() const { return size_ - pos_; }
  const std::string& name() const { return name_; }
  void set_context(std::string context) { context_ = std::move(context); }

  // Throws Error("<name>: <message>").
  [[noreturn]] void fail(const std::string& message) const { throw Error(name_ + ": " + message); }
  // Throws the "not enough bytes" error, naming the current context.
  [[noreturn]] void fail_short(const std::string& detail) const {
    fail("truncated or corrupt file: " + context_ + ": " + detail);
  }

  // Throws unless n more bytes are available.
  void need(uint64_t n) const {
    if (n > remaining())
      fail_short("needs " + std::to_string(n) + " bytes at offset " + std::to_string(pos_) +
                 ", only " + std::to_string(remaining()) + " left");
  }
  // Throws unless count elements of at least elem_bytes each can still fit; checked before any
  // container is sized from count, so a corrupt count never causes a large allocation.
  void need_elements(uint64_t count, uint64_t elem_bytes, const std::string& what) const {
    if (count > remaining() / elem_bytes)
      fail_short(what + " count " + std::to_string(count) + " at offset " + std::to_string(pos_) +
                 " needs at least " + std::to_string(elem_bytes) + " bytes each, only " +
                 std::to_string(remaining()) + " left");
  }

  template <typename T>
  T read() {
    static_assert(std::is_trivially_copyable_v<T>);
    need(sizeof(T));
    T v;
    std::memcpy(&v, data_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }

  // A GGUF string: u64 byte length, then the bytes (no terminator, any encoding).
  std::string read_string() {
    const auto len = read<uint64_t>();
    if (len > remaining())
      fail_short("string length " + std::to_string(len) + " at offset " + std::to_string(pos_ - 8) +
                 " exceeds the " + std::to_string(remaining()) + " bytes left");
    std::string s(reinterpret_cast<const char*>(data_ + pos_), static_cast<size_t>(len));
    pos_ += static_cast<size_t>(len);
    return s;
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
  std::string name_;
  std::string context_ = "header";
};

}  // namespace kestrel
