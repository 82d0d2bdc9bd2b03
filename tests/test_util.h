// Helpers shared by the tests: where the third-party test data and the default model live.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "engine/engine.h"

namespace kestrel::test {

// ../shared/data from the repo root, or $KESTREL_DATA_DIR.
std::string data_dir();
// models/ from the repo root, or $KESTREL_MODEL_DIR.
std::string model_dir();
// The kestrel CLI binary built beside the tests.
std::string kestrel_binary();
std::string read_file(const std::string& path);
bool file_exists(const std::string& path);

// Runs a shell command; returns its exit status and fills *out with stdout.
int run_command(const std::string& cmd, std::string* out);

// The logits of every position of `ids` run from an empty cache on the CPU engine
// (Request::prompt_logits), the prompt in chunks of config.max_num_batched_tokens tokens:
// [ids.size(), n_vocab], f32. config.max_model_len 0 = ids.size() + 1.
std::vector<float> prompt_logits(const LlamaModel& model, const std::vector<int32_t>& ids, EngineConfig config = {});

}  // namespace kestrel::test

// Skips (loudly) when a data file is absent: the shared data and the default model are outside the
// repository, so a machine without them cannot run these tests.
#define KESTREL_REQUIRE_FILE(path)                                                   \
  do {                                                                              \
    if (!::kestrel::test::file_exists(path)) GTEST_SKIP() << "missing test file: " << (path); \
  } while (0)
