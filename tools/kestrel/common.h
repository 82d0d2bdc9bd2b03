// Shared pieces of the kestrel subcommands: finding and loading the model, sampling flags.
#pragma once

#include <CLI/CLI.hpp>

#include <memory>
#include <string>

#include <functional>

#include "engine/engine.h"
#include "engine_config.h"
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
// tokenizer through load_tokenizer, as `kestrel tokenize` reads it), printing a one-line summary to
// stderr unless quiet. With --load-format dummy (config.model.load_format) the weights are
// generated (LlamaModel::load_dummy) and the tokenizer is optional: null when the folder has no
// tokenizer files.
LoadedModel load_model(const std::string& model_flag, const KestrelConfig& config, bool quiet = false);
// The model's tokenizer, for a command that reads or writes text. Throws kestrel::Error naming the
// command when there is none (a --load-format dummy folder without tokenizer files).
const Tokenizer& require_tokenizer(const LoadedModel& lm, const std::string& command);

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

// The engine this config describes, on the device it names: the config validated against the
// model (KestrelConfig::engine_config), the CPU backend made by the Engine, CUDA's by make_runner
// (sizing its KV pool from free memory when the config leaves it to the backend). Throws
// CLI::ValidationError naming the flag for a config the model or the engine rejects, kestrel::Error
// when the device cannot start.
std::unique_ptr<Engine> make_engine(const LoadedModel& lm, const KestrelConfig& config);

// The backend named by --device ("cpu" or "cuda") with these options. Throws kestrel::Error for an
// unknown device, or "cuda" in a build without CUDA or on a machine without a GPU.
std::unique_ptr<ModelRunner> make_runner(const std::string& device, const LlamaModel& model,
                                         const RunnerOptions& options);

// One request run to its end on an engine with nothing else to do: generate, chat and bench.
struct SingleResult {
  std::vector<int32_t> output_ids;  // every sampled id, a final stop id included
  std::string finish_reason;        // "stop" or "length"
  RequestMetrics metrics;
  std::vector<float> prompt_logits; // [n_prompt, n_vocab] when the request asked for them
  // Seconds from the first token to the last, tokens after the first per second (0 when <= 1).
  double decode_tok_per_s() const {
    const double t = metrics.e2e_s - metrics.ttft_s;
    return metrics.n_output_tokens > 1 && t > 0 ? static_cast<double>(metrics.n_output_tokens - 1) / t : 0.0;
  }
  // Prompt tokens computed (prefix-cache hits excluded) per second of time to first token.
  double prefill_tok_per_s() const {
    const double n = static_cast<double>(metrics.n_prompt_tokens - metrics.n_cached_prompt_tokens);
    return metrics.ttft_s > 0 ? n / metrics.ttft_s : 0.0;
  }
};
// Adds `request`, steps the engine until it finishes and calls on_output with each output that
// carries tokens. Throws kestrel::Error with the engine's message when the request is rejected or
// ends with an error (e.g. non-finite logits from corrupt weights).
SingleResult run_single(Engine& engine, Request request, const std::function<void(const RequestOutput&)>& on_output);

// End-of-generation ids of the tokenizer (EOS, EOT, <|im_end|>, ...).
std::vector<int32_t> stop_ids(const Tokenizer& tok);

void register_generate(CLI::App& app);
void register_tokenize(CLI::App& app);
void register_chat(CLI::App& app);
void register_batch(CLI::App& app);
void register_bench(CLI::App& app);
void register_plan(CLI::App& app);
void register_serve(CLI::App& app);
void register_router(CLI::App& app);
void register_perplexity(CLI::App& app);

}  // namespace kestrel::cli
