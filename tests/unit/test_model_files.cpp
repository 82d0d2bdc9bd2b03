// Model files that are not regular files (a FIFO in place of config.json, tokenizer.json, a
// safetensors or GGUF file): every reader fails at once naming the file, where opening a FIFO used
// to block until a writer came (`kestrel generate -m DIR` hung for good).
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <thread>

#include "core/error.h"
#include "io/gguf.h"
#include "io/hf_fields.h"
#include "io/mapped_file.h"
#include "io/safetensors.h"
#include "model/hf_config.h"
#include "tokenizer/tokenizer.h"

namespace kestrel {
namespace {

namespace fs = std::filesystem;

class TempDir {
 public:
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "kestrel_files_XXXXXX").string();
    if (::mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// The message f throws when `fifo` is a FIFO. A watchdog opens the FIFO's write end after 5 s, so
// that a reader blocked in open() returns (and the test fails) instead of hanging the suite.
std::string error_on_fifo(const std::string& fifo, const std::function<void()>& f) {
  std::atomic<bool> done{false};
  std::atomic<bool> blocked{false};
  std::thread watchdog([&] {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (!done && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    while (!done) {
      blocked = true;
      const int fd = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);  // succeeds once a reader waits
      if (fd >= 0) ::close(fd);
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  });
  std::string message = "<no error>";
  try {
    f();
  } catch (const Error& e) {
    message = e.what();
  }
  done = true;
  watchdog.join();
  EXPECT_FALSE(blocked) << "the reader blocked on the FIFO";
  return message;
}

void make_fifo(const std::string& path) { ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0) << path; }

TEST(ModelFiles, EveryReaderRefusesAFifoAtOnce) {
  TempDir dir;
  const std::string fifo = dir / "config.json";
  make_fifo(fifo);
  const auto expect_named = [&](const std::string& what, const std::function<void()>& f) {
    const std::string e = error_on_fifo(fifo, f);
    EXPECT_NE(e.find(fifo + ": not a regular file (a FIFO)"), std::string::npos) << what << ": " << e;
  };
  expect_named("read_regular_file", [&] { read_regular_file(fifo); });
  expect_named("MappedFile", [&] { MappedFile m(fifo); });
  expect_named("read_json_file", [&] { read_json_file(fifo); });
  expect_named("HfModelConfig", [&] { HfModelConfig::from_file(fifo); });
  expect_named("GgufFile", [&] { GgufFile::open(fifo); });
  expect_named("SafetensorsFile", [&] { SafetensorsFile::open(fifo); });

  // A directory and a missing file: named, too.
  EXPECT_NE(error_on_fifo(fifo, [&] { read_regular_file(dir.path()); }).find("not a regular file (a directory)"),
            std::string::npos);
  EXPECT_NE(error_on_fifo(fifo, [&] { read_regular_file(dir / "missing.json"); }).find("cannot open"),
            std::string::npos);
}

// A tokenizer folder whose tokenizer.json is a FIFO fails at once naming it.
TEST(ModelFiles, TokenizerFolderWithAFifo) {
  TempDir dir;
  const std::string fifo = dir / "tokenizer.json";
  make_fifo(fifo);
  const std::string e = error_on_fifo(fifo, [&] { Tokenizer::from_hf_dir(dir.path()); });
  EXPECT_NE(e.find("tokenizer.json: not a regular file (a FIFO)"), std::string::npos) << e;
}

TEST(ModelFiles, RegularFilesReadWhole) {
  TempDir dir;
  const std::string path = dir / "a.json";
  std::string text(200000, 'x');
  text[0] = '"';
  text.back() = '"';
  {
    std::ofstream(path, std::ios::binary) << text;
  }
  EXPECT_EQ(read_regular_file(path), text);
  EXPECT_EQ(read_json_file(path).get<std::string>().size(), text.size() - 2);
  const MappedFile m(path);
  EXPECT_EQ(m.size(), text.size());
}

}  // namespace
}  // namespace kestrel
