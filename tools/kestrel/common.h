// Shared pieces of the kestrel subcommands: finding and loading the model, sampling flags.
#pragma once

#include <CLI/CLI.hpp>

#include <memory>
#include <string>

#include "engine/session.h"
#include "model/llama_weights.h"
#include "sampling/sampling_params.h"
#include "tokenizer/tokenizer.h"

namespace kestrel::cli {

inline constexpr const char* kDefaultModelFile = "SmolLM2-135M-Instruct.Q4_1.gguf";
inline constexpr const char* kModelHelp =
    "GGUF model file, or Hugging Face model folder (config.json, *.safetensors, tokenizer files); "
    "default: the SmolLM2 model from setup";

// -m PATH, or the default model: $KESTREL_MODEL, then models/<default> under the current
// directory, the binary's directory and its parent. Throws kestrel::Error naming where it looked.
std::string resolve_model_path(const std::string& flag);

struct LoadedModel {
  std::unique_ptr<LlamaModel> model;
  std::unique_ptr<Tokenizer> tokenizer;
  double load_seconds = 0;
};
// Loads model and tokenizer from a GGUF file or a Hugging Face folder (LlamaModel::load; the
// folder's tokenizer through Tokenizer::from_hf_dir), printing a one-line summary to stderr unless
// quiet.
LoadedModel load_model(const std::string& model_flag, bool quiet = false);

// Sampling flags shared by generate and chat.
struct SamplingFlags {
  float temperature = 0.8f;
  int top_k = 40;
  float top_p = 0.95f;
  float min_p = 0.05f;
  float repeat_penalty = 1.0f;
  int64_t seed = -1;  // -1: a random seed
  void add_to(CLI::App& app);
  SamplingParams params() const;
};

struct EngineFlags {
  int threads = 0;
  int64_t ctx_size = 4096;
  int block_size = 16;
  std::string kv_dtype = "f16";
  void add_to(CLI::App& app);
  SessionOptions session_options() const;
};

// End-of-generation ids of the tokenizer (EOS, EOT, <|im_end|>, ...).
std::vector<int32_t> stop_ids(const Tokenizer& tok);

void register_generate(CLI::App& app);
void register_tokenize(CLI::App& app);
void register_chat(CLI::App& app);
void register_batch(CLI::App& app);
void register_bench(CLI::App& app);
void register_plan(CLI::App& app);

}  // namespace kestrel::cli
