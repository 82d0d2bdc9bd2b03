// `kestrel generate -m DIR` where DIR/config.json is a FIFO hung for good (the open waited for a
// writer). It must fail at once, naming the file; `timeout` turns a hang into exit 124.
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <string>

#include "test_util.h"

namespace {

namespace fs = std::filesystem;

TEST(CliModelFiles, GenerateOnAFolderWhoseConfigIsAFifoFailsAtOnce) {
  std::string dir = (fs::temp_directory_path() / "kestrel_fifo_XXXXXX").string();
  ASSERT_NE(::mkdtemp(dir.data()), nullptr);
  const std::string fifo = dir + "/config.json";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  std::string out;
  const int rc = kestrel::test::run_command(
      "timeout 20 " + kestrel::test::kestrel_binary() + " generate -m " + dir + " -p hi -n 1 2>&1", &out);
  EXPECT_EQ(rc, 1) << out;  // 124: it hung until timeout killed it
  EXPECT_NE(out.find(fifo + ": not a regular file (a FIFO)"), std::string::npos) << out;
  std::error_code ec;
  fs::remove_all(dir, ec);
}

}  // namespace
