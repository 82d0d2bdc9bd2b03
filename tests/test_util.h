// Helpers shared by the tests: where the third-party test data and the default model live, files
// under the temp folder, and checks on the kestrel::Error a call throws.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "backend/model_runner.h"
#include "core/error.h"
#include "engine/engine.h"
#include "tokenizer/tokenizer.h"

namespace kestrel::test {

// ../shared/data from the repo root, or $KESTREL_DATA_DIR.
std::string data_dir();
// models/ from the repo root, or $KESTREL_MODEL_DIR.
std::string model_dir();
// data_dir()/stories260K/stories260K.gguf: the tiny trained Llama most engine tests run.
std::string stories_path();

// A GGUF model and the tokenizer it carries, loaded together. Errors: as LlamaModel::load_gguf.
struct LoadedModel {
  std::unique_ptr<LlamaModel> model;
  std::unique_ptr<Tokenizer> tokenizer;
};
LoadedModel load_model(const std::string& gguf_path);
// The kestrel CLI binary built beside the tests.
std::string kestrel_binary();
std::string read_file(const std::string& path);
bool file_exists(const std::string& path);

// <system temp folder>/kestrel_<stem>_<pid><suffix>: a path of this process's own. Nothing is created.
std::string temp_path(const std::string& stem, const std::string& suffix = "");
// Writes bytes to path (replacing the file); returns path.
std::string write_file(const std::string& path, const std::vector<uint8_t>& bytes);
// A copy of the F32 GGUF at src (stories260K) at a temp path of this process, every element of
// every F32 matrix of its blocks ("blk.*", 2-D) multiplied by 1 + rel_noise * N(0, 1) (mt19937_64
// with this seed): another model with the same tokenizer, for an imperfect draft. Returns the path.
std::string write_perturbed_gguf(const std::string& src, double rel_noise, uint64_t seed);
// The bytes as a std::string, for writers that take text.
inline std::string bytes_of(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }

// The message of the kestrel::Error fn throws ("" when it throws none). Any other exception
// escapes and fails the test.
template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// Succeeds when fn throws a kestrel::Error whose message starts with "<name>: " and contains
// phrase, as the file readers' errors name their file. Any other exception escapes and fails the test.
template <typename Fn>
::testing::AssertionResult fails_naming(const std::string& name, const std::string& phrase, Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    const std::string msg = e.what();
    if (msg.rfind(name + ": ", 0) != 0)
      return ::testing::AssertionFailure() << "message lacks the name prefix: " << msg;
    if (msg.find(phrase) == std::string::npos)
      return ::testing::AssertionFailure() << "message lacks \"" << phrase << "\": " << msg;
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure() << "no error thrown; expected \"" << phrase << "\"";
}

// Runs a shell command; returns its exit status and fills *out with stdout.
int run_command(const std::string& cmd, std::string* out);

// The logits of every position of `ids` run from an empty cache on the CPU engine
// (Request::prompt_logits), the prompt in chunks of config.max_num_batched_tokens tokens:
// [ids.size(), n_vocab], f32. config.max_model_len 0 = ids.size() + 1.
std::vector<float> prompt_logits(const LlamaModel& model, const std::vector<int32_t>& ids, EngineConfig config = {});
// The same on an existing engine (any backend), as one request.
std::vector<float> prompt_logits(Engine& engine, const std::vector<int32_t>& ids);

// Submits every request at once and steps the engine to the end: each request's generated ids. An
// output that ends other than by "stop" or "length" fails the calling test.
std::vector<std::vector<int32_t>> run_to_end(Engine& engine, const std::vector<Request>& requests);

// run_to_end of greedy requests (max_tokens new tokens, no stop ids) for the prompts.
std::vector<std::vector<int32_t>> greedy_ids(Engine& engine, const std::vector<std::vector<int32_t>>& prompts,
                                             int64_t max_tokens);

// The bytes of one KV block under config (an engine built once to ask its backend).
int64_t kv_block_bytes(const LoadedModel& loaded, const EngineConfig& config);

// The tokenizer's end-of-generation ids (Tokenizer::is_eog), ascending: a request's stop_ids.
std::vector<int32_t> eog_ids(const Tokenizer& tok);

// 32 different story openings (4 starts x 8 characters) for stories260K-style prompts.
std::vector<std::string> story_prompts();

// One hand-made forward pass straight to a runner: tokens [from[s], to[s]) of each sequence s of
// `prompts`, sequence s's blocks tables[s * blocks_per_seq ..] of block_size tokens, the logits of
// each sequence with tokens in the pass at its last token, listed last sequence first (rows in
// another order than the tokens'). Returns [rows, n_vocab] f32.
std::vector<float> forward_token_ranges(ModelRunner& runner, const std::vector<std::vector<int32_t>>& prompts,
                                        const std::vector<int32_t>& tables, int32_t blocks_per_seq,
                                        int32_t block_size, const std::vector<int32_t>& from,
                                        const std::vector<int32_t>& to);

}  // namespace kestrel::test

// Skips (loudly) when a data file is absent: the shared data and the default model are outside the
// repository, so a machine without them cannot run these tests.
#define KESTREL_REQUIRE_FILE(path)                                                   \
  do {                                                                              \
    if (!::kestrel::test::file_exists(path)) GTEST_SKIP() << "missing test file: " << (path); \
  } while (0)
