// `kestrel plan` end to end: the binary on HF config.json files written here and on the default
// GGUF model, its JSON and table output, and one clear error line for every bad input.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <regex>
#include <string>
#include <vector>

#include "hf_configs.h"
#include "test_util.h"

using kestrel::test::kestrel_binary;
using kestrel::test::model_dir;
using kestrel::test::run_command;
using kestrel::test::TempDir;

namespace {

// Runs `kestrel plan ARGS --json`; fails the test unless it exits 0 with one JSON object.
nlohmann::json plan_json(const std::string& args) {
  std::string out;
  const std::string cmd = kestrel_binary() + " plan " + args + " --json 2>&1";
  const int rc = run_command(cmd, &out);
  EXPECT_EQ(rc, 0) << cmd << " -> " << out;
  if (rc != 0) return {};
  return nlohmann::json::parse(out);
}

std::string default_model() { return model_dir() + "/SmolLM2-135M-Instruct.Q4_1.gguf"; }

}  // namespace

TEST(PlanCli, Llama2_70bConfigJson) {
  TempDir dir;
  const std::string config = dir.write_config(kestrel::test::llama2_70b_config());
  const auto j = plan_json("--config " + config + " --memory 160GB");
  EXPECT_EQ(j["n_layer"], 80);
  EXPECT_EQ(j["n_head_kv"], 8);
  EXPECT_EQ(j["head_dim"], 128);
  EXPECT_EQ(j["kv_dtype"], "f16");
  EXPECT_EQ(j["kv_bytes_per_token"], 327680);
  EXPECT_EQ(j["context"], 4096);  // max_position_embeddings
  EXPECT_EQ(j["kv_bytes_per_seq"], int64_t{4096} * 327680);
  EXPECT_EQ(j["weight_source"], "config_estimate");
  EXPECT_EQ(j["n_params"], 68'976'648'192);
  EXPECT_EQ(j["weight_bytes"], 137'953'296'384);
  EXPECT_EQ(j["memory_bytes"], 160'000'000'000);
  EXPECT_EQ(j["weights_fit"], true);
  // 160e9 - 137,953,296,384 = 22,046,703,616; / 327,680 = 67,281.4; / 1,342,177,280 = 16.4.
  EXPECT_EQ(j["kv_budget_bytes"], 22'046'703'616);
  EXPECT_EQ(j["max_tokens"], 67281);
  EXPECT_EQ(j["max_seqs"], 16);
  EXPECT_DOUBLE_EQ(j["bandwidth_bytes_per_s"].get<double>(), 4.8e12);
  EXPECT_DOUBLE_EQ(j["decode_tok_per_s_ceiling"].get<double>(), 4.8e12 / (137953296384.0 + 1342177280.0));
}

TEST(PlanCli, Llama2_70bDoesNotFitIn80GB) {
  TempDir dir;
  const std::string config = dir.write_config(kestrel::test::llama2_70b_config());
  const auto j = plan_json("--config " + config);  // default --memory 80GB
  EXPECT_EQ(j["memory_bytes"], 80'000'000'000);
  EXPECT_EQ(j["weights_fit"], false);
  EXPECT_EQ(j["kv_budget_bytes"], 0);
  EXPECT_EQ(j["max_tokens"], 0);
  EXPECT_EQ(j["max_seqs"], 0);
  EXPECT_EQ(j["weight_shortfall_bytes"], 57'953'296'384);

  std::string out;
  ASSERT_EQ(run_command(kestrel_binary() + " plan --config " + config + " 2>&1", &out), 0) << out;
  EXPECT_NE(out.find("do not fit"), std::string::npos) << out;
  EXPECT_FALSE(std::regex_search(out, std::regex("-[0-9]"))) << "a negative number in:\n" << out;
}

TEST(PlanCli, Llama2_7bSequenceAt4096) {
  TempDir dir;
  const std::string config = dir.write_config(kestrel::test::llama2_7b_config());
  const auto j = plan_json("--config " + config + " --context 4096 --kv-dtype f16");
  EXPECT_EQ(j["kv_bytes_per_token"], 524288);
  EXPECT_EQ(j["kv_bytes_per_seq"], 2'147'483'648);
  EXPECT_EQ(j["n_params"], 6'738'415'616);
}

TEST(PlanCli, DeepSeekV2Mla) {
  TempDir dir;
  const std::string config = dir.write_config(kestrel::test::deepseek_v2_config());
  const auto j = plan_json("--config " + config + " --kv-dtype bf16 --context 1000 --memory 1TB");
  EXPECT_EQ(j["attention"], "mla");
  EXPECT_EQ(j["kv_lora_rank"], 512);
  EXPECT_EQ(j["rope_dim"], 64);
  EXPECT_TRUE(j["n_head_kv"].is_null());
  EXPECT_EQ(j["kv_bytes_per_token"], 69120);  // 60 x 576 x 2
  EXPECT_EQ(j["kv_bytes_per_seq"], 69'120'000);
}

TEST(PlanCli, UnitsAndDtypesReachThePlan) {
  TempDir dir;
  const std::string config = dir.write_config(kestrel::test::llama2_7b_config());
  const auto j =
      plan_json("--config " + config + " --memory 64GiB --bandwidth 3.35e12 --kv-dtype fp8 --context 100");
  EXPECT_EQ(j["memory_bytes"], 68'719'476'736);
  EXPECT_DOUBLE_EQ(j["bandwidth_bytes_per_s"].get<double>(), 3.35e12);
  EXPECT_EQ(j["kv_bytes_per_token"], 270336);  // 2 x 32 x 32 x (128 x 1 + 4 B row scale)
  EXPECT_EQ(j["kv_scale_bytes"], 4);
}

TEST(PlanCli, DefaultModelJson) {
  KESTREL_REQUIRE_FILE(default_model());
  const auto j = plan_json("-m " + default_model());
  EXPECT_EQ(j["n_layer"], 30);
  EXPECT_EQ(j["n_head_kv"], 3);
  EXPECT_EQ(j["head_dim"], 64);
  EXPECT_EQ(j["kv_bytes_per_token"], 23040);
  EXPECT_EQ(j["context"], 8192);
  EXPECT_EQ(j["weight_source"], "gguf_tensors");
  EXPECT_EQ(j["weight_bytes"], 96'576'768);
  // 80e9 - 96,576,768 = 79,903,423,232; / 23,040 = 3,468,030; / 188,743,680 = 423.
  EXPECT_EQ(j["max_tokens"], 3'468'030);
  EXPECT_EQ(j["max_seqs"], 423);
  EXPECT_NEAR(j["decode_tok_per_s_ceiling"].get<double>(), 16823.19, 0.01);  // 4.8e12 / 285,320,448
}

TEST(PlanCli, DefaultModelTable) {
  KESTREL_REQUIRE_FILE(default_model());
  std::string out;
  ASSERT_EQ(run_command(kestrel_binary() + " plan -m " + default_model() + " 2>&1", &out), 0) << out;
  for (const char* s :
       {"KV per token", "23,040 B (22.50 KiB)", "2 (K,V) x 30 layers x 3 KV heads x head_dim 64",
        "180.00 MiB", "96,576,768 B", "tensor sizes", "74.51 GiB", "3,468,030 tokens", "423 sequences",
        "16,823.2 tok/s", "4.80 TB/s"})
    EXPECT_NE(out.find(s), std::string::npos) << "missing '" << s << "' in:\n" << out;
}

TEST(PlanCli, BadInputGivesOneClearLineAndNonZeroExit) {
  TempDir dir;
  const std::string good = dir.write_config(kestrel::test::llama2_7b_config());
  const std::string bad_json = dir.write("bad.json", "{\"num_hidden_layers\": ");
  nlohmann::json no_layers = kestrel::test::llama2_7b_config();
  no_layers.erase("num_hidden_layers");
  const std::string missing = dir.write("missing.json", no_layers.dump());
  nlohmann::json zero_heads = kestrel::test::llama2_7b_config();
  zero_heads["num_key_value_heads"] = 0;
  const std::string zero = dir.write("zero.json", zero_heads.dump());
  struct Case {
    std::string args;
    std::string phrase;
  };
  const std::vector<Case> cases = {
      {"--config " + good + " --memory 80XB", "--memory"},
      {"--config " + good + " --memory 0", "--memory"},
      {"--config " + good + " --bandwidth fast", "--bandwidth"},
      {"--config " + good + " --bandwidth -1TB/s", "--bandwidth"},
      {"--config " + good + " --kv-dtype f12", "--kv-dtype"},
      {"--config " + good + " --context 0", "--context"},
      {"--config " + good + " --context -5", "--context"},
      {"-m /x.gguf --config " + good, "not both"},
      {"--config " + dir.path() + "/none.json", "cannot open"},
      {"--config " + bad_json, "invalid JSON"},
      {"--config " + missing, "num_hidden_layers"},
      {"--config " + zero, "num_key_value_heads"},
      {"-m /nonexistent/model.gguf", "cannot open"},
  };
  for (const auto& c : cases) {
    std::string err;
    const int rc = run_command(kestrel_binary() + " plan " + c.args + " 2>&1 >/dev/null", &err);
    EXPECT_NE(rc, 0) << c.args;
    EXPECT_NE(err.find(c.phrase), std::string::npos) << c.args << " -> " << err;
    EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 1) << c.args << " -> " << err;
  }
}
