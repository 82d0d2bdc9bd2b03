#include "test_util.h"

#include "core/env.h"

#include <sys/stat.h>
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

namespace kestrel::test {

std::string data_dir() {
  if (auto e = env_var(EnvVar::DataDir)) return *e;
  return KESTREL_DEFAULT_DATA_DIR;
}

std::string model_dir() {
  if (auto e = env_var(EnvVar::ModelDir)) return *e;
  return KESTREL_DEFAULT_MODEL_DIR;
}

std::string kestrel_binary() { return KESTREL_BINARY; }

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

bool file_exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

int run_command(const std::string& cmd, std::string* out) {
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return -1;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0)
    if (out != nullptr) out->append(buf, n);
  const int status = ::pclose(p);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

}  // namespace kestrel::test
