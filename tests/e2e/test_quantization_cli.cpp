// `--quantization` on the kestrel binary with the hf-tiny quantized folders: auto and the
// checkpoint's own method generate; a disagreeing method, fp8 on a float checkpoint on the CPU
// (quantized at load on the GPU only) and an unknown value are refused naming the flag.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "hf_configs.h"
#include "test_util.h"

using kestrel::test::data_dir;
using kestrel::test::kestrel_binary;
using kestrel::test::run_command;

namespace {

// stdout and stderr of `kestrel ARGS`, and its exit status.
int run_kestrel(const std::string& args, std::string* out) {
  return run_command(kestrel_binary() + " " + args + " 2>&1", out);
}

TEST(QuantizationCli, CheckpointMethodRunsOthersAreRefused) {
  const std::string awq = data_dir() + "/hf-tiny/llama-awq-tiny";
  const std::string plain = data_dir() + "/hf-tiny/mistral-swa-tiny";
  KESTREL_REQUIRE_FILE(awq + "/model.safetensors");
  KESTREL_REQUIRE_FILE(plain + "/model.safetensors");
  std::string out;
  for (const char* q : {"auto", "awq"}) {
    EXPECT_EQ(run_kestrel("generate -m " + awq + " -p hello -n 4 --temp 0 -t 2 --quantization " + q, &out), 0) << out;
    EXPECT_NE(out.find("generated 4 tokens"), std::string::npos) << out;
  }
  EXPECT_NE(run_kestrel("generate -m " + awq + " -p hello -n 4 -q gptq", &out), 0);
  EXPECT_NE(out.find("--quantization gptq disagrees with the checkpoint, which is quantized with awq"), std::string::npos)
      << out;
  EXPECT_NE(run_kestrel("generate -m " + plain + " -p hello -n 4 --quantization fp8", &out), 0);
  EXPECT_NE(out.find("fp8 on float weights quantizes them at load on the GPU"), std::string::npos) << out;
  EXPECT_NE(run_kestrel("generate -m " + awq + " -p hello -n 4 --quantization int4", &out), 0);
  EXPECT_NE(out.find("--quantization"), std::string::npos) << out;
}

TEST(QuantizationCli, MisplacedQuantizedFilesGetTheRightHint) {
  const std::string gptq = data_dir() + "/hf-tiny/llama-gptq-tiny";
  KESTREL_REQUIRE_FILE(gptq + "/model.safetensors");
  std::string out;
  // The safetensors file of a folder, with -q: pass the folder (not "a GGUF file").
  EXPECT_NE(run_kestrel("generate -m " + gptq + "/model.safetensors -p hello -n 2 -q gptq", &out), 0);
  EXPECT_NE(out.find("pass the folder"), std::string::npos) << out;
  EXPECT_EQ(out.find("GGUF"), std::string::npos) << out;
  // A GPTQ folder whose config.json lost quantization_config: the error names the qweight found.
  kestrel::test::TempDir dir;
  for (const auto& e : std::filesystem::directory_iterator(gptq))
    if (e.path().filename() != "config.json" && e.path().extension() != ".npy")
      std::filesystem::copy_file(e.path(), dir.path() + "/" + e.path().filename().string());
  nlohmann::json config = nlohmann::json::parse(std::ifstream(gptq + "/config.json"));
  config.erase("quantization_config");
  dir.write_config(config);
  EXPECT_NE(run_kestrel("generate -m " + dir.path() + " -p hello -n 2", &out), 0);
  EXPECT_NE(out.find("q_proj.qweight', a quantized layout, but config.json has no quantization_config"),
            std::string::npos)
      << out;
}

}  // namespace
