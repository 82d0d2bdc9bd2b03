// KestrelConfig: the engine flags parsed as the CLI parses them, validated against a real model
// (stories260K: f32 weights, a context of 2048 tokens), each error naming its flag, and the
// EngineConfig / RunnerOptions they resolve to.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "engine_config.h"
#include "test_util.h"

namespace kestrel::cli {
namespace {

using test::data_dir;

using test::stories_path;

// The config a subcommand with these flags ends up with.
KestrelConfig parse(EngineMode mode, std::vector<std::string> args) {
  CLI::App app;
  KestrelConfig c;
  c.add_flags(app, mode);
  if (mode == EngineMode::Single) c.add_prefill_chunk_flag(app);
  std::reverse(args.begin(), args.end());  // CLI11 takes the arguments last first
  app.parse(args);
  return c;
}

// The flag a validation error names ("" when validate() accepts the config), and its message.
std::pair<std::string, std::string> rejection(const KestrelConfig& c, const LlamaModel& m) {
  try {
    c.validate(m);
  } catch (const CLI::ValidationError& e) {
    const std::string what = e.what();
    return {what.substr(0, what.find(':')), what};
  }
  return {"", ""};
}

class EngineConfigTest : public ::testing::Test {
 protected:
  void SetUp() override {
    KESTREL_REQUIRE_FILE(stories_path());
    model_ = LlamaModel::load(stories_path());
    ASSERT_EQ(model_->hparams().n_ctx_train, 2048);
  }
  std::unique_ptr<LlamaModel> model_;
};

TEST_F(EngineConfigTest, SingleModeCapsTheContextAndSizesThePoolForOneSequence) {
  const KestrelConfig c = parse(EngineMode::Single, {"-c", "100000", "--block-size", "32", "--prefill-chunk", "7"});
  const EngineConfig e = c.engine_config(*model_);
  EXPECT_EQ(e.max_model_len, 2048);
  EXPECT_EQ(e.max_num_seqs, 1);
  EXPECT_EQ(e.n_kv_blocks, 64);  // 2048 / 32
  EXPECT_EQ(e.max_num_batched_tokens, 7);
  EXPECT_TRUE(e.enable_prefix_caching);
  EXPECT_EQ(e.kv_dtype, KvDtype::F32);  // auto: the weights are f32
}

TEST_F(EngineConfigTest, ServingFlagsReachTheEngineAndTheRunner) {
  const KestrelConfig c = parse(EngineMode::Serving,
                                {"--max-model-len", "300", "--max-num-seqs", "5", "--max-num-batched-tokens", "64",
                                 "--num-kv-blocks", "40", "--no-prefix-cache", "--kv-cache-dtype", "f16", "-t", "2",
                                 "--gpu-memory-utilization", "0.5", "--enforce-eager", "--cuda-pdl", "off",
                                 "--swap-space", "1.5", "--preemption-mode", "swap",
                                 "--tensor-parallel-size", "2"});
  const EngineConfig e = c.engine_config(*model_);
  EXPECT_EQ(e.max_model_len, 300);
  EXPECT_EQ(e.max_num_seqs, 5);
  EXPECT_EQ(e.max_num_batched_tokens, 64);
  EXPECT_EQ(e.n_kv_blocks, 40);
  EXPECT_FALSE(e.enable_prefix_caching);
  EXPECT_EQ(e.kv_dtype, KvDtype::F16);
  EXPECT_EQ(e.n_threads, 2);
  EXPECT_EQ(e.swap_space_bytes, int64_t{3} << 29);  // 1.5 GiB
  EXPECT_EQ(e.preemption_mode, PreemptionMode::Swap);
  EXPECT_EQ(e.tensor_parallel_size, 2);
  const RunnerOptions o = c.runner_options(e);
  EXPECT_EQ(o.tensor_parallel_size, 2);
  EXPECT_EQ(o.n_kv_blocks, 40);
  EXPECT_EQ(o.kv_dtype, KvDtype::F16);
  EXPECT_DOUBLE_EQ(o.gpu_memory_utilization, 0.5);
  EXPECT_TRUE(o.enforce_eager);
  EXPECT_FALSE(o.cuda.pdl);
  EXPECT_TRUE(o.cuda.fused_norm);  // untouched choices keep their defaults
}

TEST_F(EngineConfigTest, HostTierFlagReachesTheEngine) {
  const EngineConfig e = parse(EngineMode::Serving, {"--cpu-offload-kv-gb", "0.5"}).engine_config(*model_);
  EXPECT_EQ(e.cpu_offload_kv_bytes, int64_t{1} << 29);
  EXPECT_EQ(parse(EngineMode::Serving, {}).engine_config(*model_).cpu_offload_kv_bytes, 0);
}

TEST_F(EngineConfigTest, ServingDefaultContextIsTheModels) {
  EXPECT_EQ(parse(EngineMode::Serving, {}).engine_config(*model_).max_model_len, 2048);
}

TEST_F(EngineConfigTest, EachRejectionNamesItsFlag) {
  struct Case {
    EngineMode mode;
    std::vector<std::string> args;
    std::string flag;
    std::string phrase;
  };
  const std::vector<Case> cases = {
      {EngineMode::Serving, {"--max-model-len", "2049"}, "--max-model-len", "exceeds the model's context of 2048"},
      {EngineMode::Serving, {"--num-kv-blocks", "127"}, "--num-kv-blocks", "needs 128 blocks"},
      {EngineMode::Serving, {"--num-kv-blocks", "3", "--max-model-len", "64", "--block-size", "32"}, "", ""},
      {EngineMode::Serving, {"--max-model-len", "64", "--num-kv-blocks", "3"}, "--num-kv-blocks", "needs 4 blocks"},
      {EngineMode::Single, {"--kv-cache-dtype", "bf16"}, "--kv-cache-dtype", "CPU backend's KV cache stores f16, f32 or int8"},
      {EngineMode::Single, {"--device", "cpu", "--kv-cache-dtype", "fp8"}, "--kv-cache-dtype", "fp8: the CPU backend's"},
      {EngineMode::Serving, {"--kv-cache-dtype", "INT8"}, "", ""},
      {EngineMode::Single, {"--device", "cuda", "--kv-dtype", "f16"}, "--kv-cache-dtype", "CUDA backend's KV cache stores bf16"},
      {EngineMode::Single, {"--device", "cuda"}, "", ""},
      {EngineMode::Single, {"--device", "cuda", "--kv-cache-dtype", "fp8"}, "", ""},
      {EngineMode::Single, {"--kv-cache-dtype", "fp8"}, "--kv-cache-dtype", "CPU backend's KV cache stores f16, f32 or int8"},
      {EngineMode::Single, {"--device", "cuda", "--kv-cache-dtype", "int8"}, "--kv-cache-dtype", "CUDA backend's KV cache stores bf16 or fp8"},
      {EngineMode::Serving, {"--preemption-mode", "swap"}, "--preemption-mode", "swap needs --swap-space > 0"},
      {EngineMode::Serving, {"--preemption-mode", "swap", "--swap-space", "0.25"}, "", ""},
      {EngineMode::Serving, {"--cpu-offload-kv-gb", "1", "--no-prefix-cache"}, "--cpu-offload-kv-gb", "needs the prefix cache"},
      {EngineMode::Serving, {"--cpu-offload-kv-gb", "0.25", "--swap-space", "0.25"}, "", ""},
      {EngineMode::Serving, {"--tensor-parallel-size", "2"}, "", ""},
      {EngineMode::Serving, {"--tensor-parallel-size", "3"}, "--tensor-parallel-size", "does not divide the model's attention heads (8)"},
      {EngineMode::Single, {"--device", "cuda", "--tensor-parallel-size", "2"}, "--tensor-parallel-size", "needs 2 GPUs"},
      {EngineMode::Serving, {"--pipeline-parallel-size", "5"}, "", ""},
      {EngineMode::Serving, {"--pipeline-parallel-size", "6"}, "--pipeline-parallel-size", "exceeds the model's layers (5)"},
      {EngineMode::Single, {"--device", "cuda", "--pipeline-parallel-size", "2"}, "--pipeline-parallel-size", "needs 2 GPUs"},
      {EngineMode::Serving, {"--pipeline-parallel-size", "2", "--tensor-parallel-size", "2"}, "--pipeline-parallel-size", "one way at a time"},
      {EngineMode::Serving, {"--speculative-config", R"({"method": "ngram", "num_speculative_tokens": 3})"}, "", ""},
      {EngineMode::Single, {"--speculative-config", R"({"method": "ngram"})"}, "--speculative-config", "\"num_speculative_tokens\" is missing"},
      {EngineMode::Single, {"--speculative-config", R"({"method": "ngram", "num_speculative_tokens": 17})"}, "--speculative-config", "must be in [1, 16], got 17"},
      {EngineMode::Single, {"--speculative-config", R"({"method": "eagle", "num_speculative_tokens": 2})"}, "--speculative-config", "\"method\" must be"},
      {EngineMode::Single, {"--speculative-config", R"({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 3})"}, "--speculative-config", "\"prompt_lookup_max\" 3 must be >="},
      {EngineMode::Single, {"--speculative-config", R"({"method": "ngram", "num_speculative_tokens": 2, "lookup": 3})"}, "--speculative-config", "unknown field \"lookup\""},
      {EngineMode::Single, {"--speculative-config", R"({"method": "ngram", "num_speculative_tokens": "2"})"}, "--speculative-config", "must be an integer, got \"2\""},
      {EngineMode::Single, {"--speculative-config", R"({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": -1})"}, "--speculative-config", "\"disable_by_batch_size\" must be in [0"},
      {EngineMode::Single, {"--speculative-config", "[1, 2]"}, "--speculative-config", "must be a JSON object"},
      {EngineMode::Single, {"--speculative-config", "{\"method\": "}, "--speculative-config", "not valid JSON"},
      {EngineMode::Serving, {"--speculative-config", R"({"method": "draft_model", "num_speculative_tokens": 2})"}, "--speculative-config", "needs \"model\""},
      {EngineMode::Serving, {"--speculative-config", R"({"model": "/m/draft", "num_speculative_tokens": 4})"}, "", ""},
      {EngineMode::Serving, {"--speculative-config", R"({"model": "/m/draft", "num_speculative_tokens": 4, "quantization": "int3"})"}, "--speculative-config", "\"quantization\": "},
      {EngineMode::Single, {"--speculative-config", R"({"method": "ngram", "num_speculative_tokens": 4, "quantization": "rtn"})"}, "--speculative-config", "\"quantization\" is for"},
      {EngineMode::Single, {"--speculative-config", R"({"method": "ngram", "num_speculative_tokens": 4, "draft_length": "fixed"})"}, "", ""},
      {EngineMode::Single, {"--speculative-config", R"({"method": "ngram", "num_speculative_tokens": 4, "draft_length": "short"})"}, "--speculative-config", "\"draft_length\" must be \"adaptive\" or \"fixed\", got \"short\""},
      {EngineMode::Serving, {"--speculative-config", R"({"model": "/m/draft", "num_speculative_tokens": 4, "draft_length": "fixed"})"}, "--speculative-config", "\"draft_length\" is for \"method\": \"ngram\""},
  };
  for (const Case& k : cases) {
    const auto [flag, what] = rejection(parse(k.mode, k.args), *model_);
    EXPECT_EQ(flag, k.flag) << what;
    EXPECT_NE(what.find(k.phrase), std::string::npos) << what;
  }
}

// --speculative-config reaches the engine's config with vLLM's field names and the defaults filled.
TEST_F(EngineConfigTest, SpeculativeConfigReachesTheEngine) {
  const KestrelConfig none = parse(EngineMode::Serving, {});
  EXPECT_FALSE(none.engine_config(*model_).speculative.enabled());
  const KestrelConfig c = parse(EngineMode::Serving, {"--speculative-config",
                                                      R"({"method": "ngram", "num_speculative_tokens": 4, )"
                                                      R"("prompt_lookup_max": 3, "disable_by_batch_size": 8})"});
  const SpeculativeConfig s = c.engine_config(*model_).speculative;
  EXPECT_TRUE(s.enabled());
  EXPECT_EQ(s.method, SpecMethod::Ngram);
  EXPECT_EQ(s.num_speculative_tokens, 4);
  EXPECT_EQ(s.prompt_lookup_max, 3);
  EXPECT_EQ(s.prompt_lookup_min, 3);  // a lone max sets the min to it
  EXPECT_EQ(s.disable_by_batch_size, 8);
  EXPECT_TRUE(s.adaptive_draft_length);  // "draft_length": "adaptive" by default
  EXPECT_FALSE(parse_speculative_config(R"({"method": "ngram", "num_speculative_tokens": 2, "draft_length": "fixed"})")
                   .adaptive_draft_length);
  EXPECT_TRUE(c.engine_config(*model_).speculative_verify_on_device);  // --speculative-verify device by default
  EXPECT_FALSE(parse(EngineMode::Serving, {"--speculative-verify", "host"}).engine_config(*model_).speculative_verify_on_device);
  const SpeculativeConfig d = parse_speculative_config(R"({"prompt_lookup_min": 1, "num_speculative_tokens": 2})");
  EXPECT_EQ(d.method, SpecMethod::Ngram);  // implied by the lookup sizes
  EXPECT_EQ(d.prompt_lookup_min, 1);
  EXPECT_EQ(d.prompt_lookup_max, 1);
}

// --kv-cache-dtype fp8 on the GPU reaches the runner; an MLA model's latent cache stays bf16 there,
// so fp8 is refused for it by name.
TEST_F(EngineConfigTest, Fp8KvOnTheGpuReachesTheRunner) {
  const KestrelConfig c = parse(EngineMode::Single, {"--device", "cuda", "--kv-cache-dtype", "FP8"});
  EXPECT_EQ(c.runner_options(c.engine_config(*model_)).kv_dtype, KvDtype::FP8);
  const std::string folder = data_dir() + "/hf-tiny/deepseek-v2-tiny";
  KESTREL_REQUIRE_FILE(folder + "/config.json");
  const auto mla = LlamaModel::load_hf_dir(folder);
  const auto [flag, what] = rejection(c, *mla);
  EXPECT_EQ(flag, "--kv-cache-dtype");
  EXPECT_NE(what.find("MLA"), std::string::npos) << what;
}

// mistral-swa-tiny: every layer windowed (16), so a pool needs only ceil((16 + 16) / 4) + 1 = 9
// blocks of 4 for any --max-model-len when a step holds 16 tokens; more per step needs more.
TEST(EngineConfigFlags, AWindowedModelsPoolHoldsTheWindowAndOneStep) {
  const std::string folder = data_dir() + "/hf-tiny/mistral-swa-tiny";
  KESTREL_REQUIRE_FILE(folder + "/config.json");
  const auto m = LlamaModel::load_hf_dir(folder);
  const std::vector<std::string> base = {"--max-model-len", "1024", "--block-size", "4"};
  auto with = [&](std::vector<std::string> more) {
    more.insert(more.begin(), base.begin(), base.end());
    return parse(EngineMode::Serving, more);
  };
  EXPECT_EQ(rejection(with({"--num-kv-blocks", "9", "--max-num-batched-tokens", "16"}), *m).first, "");
  const auto [flag, what] = rejection(with({"--num-kv-blocks", "8", "--max-num-batched-tokens", "16"}), *m);
  EXPECT_EQ(flag, "--num-kv-blocks");
  EXPECT_NE(what.find("sliding window of 16 tokens plus a step of 16 (--max-num-batched-tokens; needs 9 blocks)"),
            std::string::npos)
      << what;
  EXPECT_EQ(with({"--num-kv-blocks", "9", "--max-num-batched-tokens", "16"}).engine_config(*m).n_kv_blocks, 9);
  // generate / chat size their one sequence's pool the same way: ceil((16 + 7) / 16) + 1 blocks.
  const KestrelConfig single = parse(EngineMode::Single, {"-c", "1000", "--prefill-chunk", "7"});
  EXPECT_EQ(single.engine_config(*m).n_kv_blocks, 3);
}

TEST(EngineConfigFlags, OutOfRangeValuesAreRefusedAsTheyAreParsed) {
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"--max-num-seqs", "0"}, {"--block-size", "0"}, {"--kv-cache-dtype", "f12"},
        {"--gpu-memory-utilization", "1.5"}, {"--tensor-parallel-size", "0"}, {"--device", "tpu"},
        {"--quantization", "int4"}, {"--speculative-verify", "gpu"}, {"--swap-space", "-1"},
        {"--preemption-mode", "never"}}) {
    EXPECT_THROW(parse(EngineMode::Serving, args), CLI::ValidationError) << args[0];
  }
  // Each mode offers its own flags only.
  EXPECT_THROW(parse(EngineMode::Single, {"--num-kv-blocks", "8"}), CLI::ExtrasError);
  EXPECT_THROW(parse(EngineMode::Single, {"--swap-space", "1"}), CLI::ExtrasError);
  EXPECT_THROW(parse(EngineMode::Serving, {"--prefill-chunk", "8"}), CLI::ExtrasError);
}

}  // namespace
}  // namespace kestrel::cli
