// `--load-format dummy` on the kestrel binary: bench runs on a folder holding only a config.json
// (random weights, token-id prompts, no tokenizer); text commands say they need a tokenizer; an
// unknown format, a GGUF file and a folder without config.json are refused with the reason.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "hf_configs.h"
#include "test_util.h"

using kestrel::test::kestrel_binary;
using kestrel::test::run_command;

namespace {

std::string tiny_config_dir(const kestrel::test::TempDir& dir) {
  dir.write_config({{"architectures", {"MixtralForCausalLM"}}, {"hidden_size", 64}, {"intermediate_size", 32},
                    {"num_hidden_layers", 2}, {"num_attention_heads", 4}, {"num_key_value_heads", 2},
                    {"num_local_experts", 4}, {"num_experts_per_tok", 2}, {"vocab_size", 512},
                    {"max_position_embeddings", 256}, {"tie_word_embeddings", false}});
  return dir.path();
}

// stdout and stderr of `kestrel ARGS`, and its exit status.
int run_kestrel(const std::string& args, std::string* out) {
  return run_command(kestrel_binary() + " " + args + " 2>&1", out);
}

}  // namespace

TEST(LoadFormatCli, BenchRunsOnRandomWeightsFromAConfigAlone) {
  kestrel::test::TempDir dir;
  std::string out;
  const int rc = run_kestrel("bench --load-format dummy -m " + tiny_config_dir(dir) + " -p 16 -n 4 -r 1 -t 2", &out);
  ASSERT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("random weights (--load-format dummy), no tokenizer"), std::string::npos) << out;
  EXPECT_NE(out.find("| pp16 |"), std::string::npos) << out;
  EXPECT_NE(out.find("| tg4 |"), std::string::npos) << out;
  // Many sequences through the serving engine too.
  ASSERT_EQ(run_kestrel("bench --load-format dummy -m " + dir.path() + " -p 8 -n 4 -r 1 -t 2 --parallel 1,4", &out), 0)
      << out;
  EXPECT_NE(out.find("| 2 | 4 |"), std::string::npos) << out;
}

TEST(LoadFormatCli, TextCommandsWithoutATokenizerSaySo) {
  kestrel::test::TempDir dir;
  const std::string path = tiny_config_dir(dir);
  std::string out;
  EXPECT_NE(run_kestrel("generate --load-format dummy -m " + path + " -p hello -n 2", &out), 0);
  EXPECT_NE(out.find(path + ": kestrel generate reads and writes text and needs a tokenizer"), std::string::npos) << out;
  EXPECT_NE(out.find("kestrel bench"), std::string::npos) << out;
  // A server that started anyway would never exit: bounded by timeout(1).
  EXPECT_NE(run_command("timeout 60 " + kestrel_binary() + " serve --load-format dummy -m " + path + " 2>&1", &out), 0);
  EXPECT_NE(out.find("kestrel serve reads and writes text and needs a tokenizer"), std::string::npos) << out;
}

TEST(LoadFormatCli, BadFormatsAndPathsAreRefused) {
  kestrel::test::TempDir dir;
  std::string out;
  EXPECT_NE(run_kestrel("bench --load-format pt -m " + tiny_config_dir(dir), &out), 0);
  EXPECT_NE(out.find("--load-format"), std::string::npos) << out;
  EXPECT_NE(out.find("pt"), std::string::npos) << out;
  kestrel::test::TempDir empty;
  EXPECT_NE(run_kestrel("bench --load-format dummy -m " + empty.path(), &out), 0);
  EXPECT_NE(out.find(empty.path() + ": no config.json"), std::string::npos) << out;
  const std::string gguf = kestrel::test::data_dir() + "/stories260K/stories260K.gguf";
  KESTREL_REQUIRE_FILE(gguf);
  EXPECT_NE(run_kestrel("bench --load-format dummy -m " + gguf, &out), 0);
  EXPECT_NE(out.find(gguf + ": --load-format dummy needs a Hugging Face model folder holding a config.json"),
            std::string::npos)
      << out;
}
