#include "io/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "core/error.h"

namespace kestrel {

namespace {

const char* file_kind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  return "not a plain file";
}

[[noreturn]] void not_regular(const std::string& path, mode_t mode) {
  throw Error(path + ": not a regular file (" + file_kind(mode) + ")");
}

// An open descriptor of a regular file, and its size.
struct RegularFile {
  int fd = -1;
  size_t size = 0;
  explicit RegularFile(const std::string& path) {
    // stat first: the common case of a FIFO or a device gets its error without being opened.
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0) throw Error(path + ": cannot open: " + std::strerror(errno));
    if (!S_ISREG(st.st_mode)) not_regular(path, st.st_mode);
    // O_NONBLOCK: a FIFO put in its place since the stat does not block the open; fstat then
    // refuses it. (The flag changes nothing for a regular file's reads.)
    fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) throw Error(path + ": cannot open: " + std::strerror(errno));
    if (::fstat(fd, &st) != 0) {
      const int e = errno;
      ::close(fd);
      throw Error(path + ": cannot stat: " + std::strerror(e));
    }
    if (!S_ISREG(st.st_mode)) {
      ::close(fd);
      not_regular(path, st.st_mode);
    }
    size = static_cast<size_t>(st.st_size);
  }
  ~RegularFile() {
    if (fd >= 0) ::close(fd);
  }
  RegularFile(const RegularFile&) = delete;
  RegularFile& operator=(const RegularFile&) = delete;
};

}  // namespace

MappedFile::MappedFile(const std::string& path) : path_(path) {
  const RegularFile f(path);
  size_ = f.size;
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, f.fd, 0);
    if (p == MAP_FAILED) throw Error(path + ": cannot mmap: " + std::strerror(errno));
    data_ = static_cast<const uint8_t*>(p);
  }
}

std::string read_regular_file(const std::string& path) {
  const RegularFile f(path);
  std::string data;
  data.reserve(f.size);
  char buf[1 << 16];
  for (;;) {
    const ssize_t n = ::read(f.fd, buf, sizeof buf);
    if (n == 0) break;
    if (n < 0) {
      if (errno == EINTR) continue;
      throw Error(path + ": read failed: " + std::strerror(errno));
    }
    data.append(buf, static_cast<size_t>(n));
  }
  return data;
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), size_);
}

}  // namespace kestrel
