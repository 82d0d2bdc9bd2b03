// Whole-file access for model files: a read-only memory mapping (RAII) and a read into a string.
// Both accept only regular files: a FIFO, a socket, a device or a directory is an error at once
// (checked with stat before opening, and opened with O_NONBLOCK so that even a FIFO swapped in
// between cannot block the open), never a read that waits for a writer that does not come.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace kestrel {

// Throws kestrel::Error naming the path and the OS error when the file cannot be opened or mapped,
// or "<path>: not a regular file (a FIFO)" and the like. An empty file maps to data() == nullptr.
class MappedFile {
 public:
  explicit MappedFile(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

// The whole contents of a regular file. Errors as MappedFile's, and "<path>: read failed: ...".
std::string read_regular_file(const std::string& path);

}  // namespace kestrel
