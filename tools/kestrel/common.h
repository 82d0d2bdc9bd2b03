// Shared pieces of the kestrel subcommands: finding and loading the model, sampling flags.
#pragma once

#include <CLI/CLI.hpp>

#include <memory>
#include <string>

#include "engine/engine.h"
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
// tokenizer through load_tokenizer, as `kestrel tokenize` reads it), printing a one-line summary to
// stderr unless quiet.
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

// --device and the options of the GPU backend.
struct DeviceFlags {
  std::string device = "cpu";
  double gpu_memory_utilization = 0.9;
  bool enforce_eager = false;  // CUDA: no CUDA graphs (RunnerOptions::enforce_eager)
  CudaTuning cuda;             // CUDA: kernel choices (--cuda-*)
  // Adds --device and the backends' flags, --cpu-isa and --no-amx among them: those two are
  // process-wide and applied as they are parsed.
  void add_to(CLI::App& app);
  void apply(RunnerOptions& o) const;  // fills the device options of o
};

struct EngineFlags {
  int threads = 0;
  int64_t ctx_size = 4096;
  int block_size = 16;
  std::string kv_dtype = "f16";
  int64_t prefill_chunk = 256;  // prompt tokens per forward pass
  DeviceFlags device;
  void add_to(CLI::App& app);
  // --prefill-chunk, for the commands that run one Session (generate, chat); the engine's commands
  // chunk by --max-num-batched-tokens instead and bench by -p.
  void add_prefill_chunk(CLI::App& app);
  // The backend for a Session of these options: null for the CPU (the Session makes its own).
  std::unique_ptr<ModelRunner> session_runner(const LlamaModel& model, const SessionOptions& so) const;
  SessionOptions session_options() const;
};

// The backend named by --device ("cpu" or "cuda") with these options. Throws kestrel::Error for an
// unknown device, or "cuda" in a build without CUDA or on a machine without a GPU.
std::unique_ptr<ModelRunner> make_runner(const std::string& device, const LlamaModel& model,
                                         const RunnerOptions& options);
// The backend for an Engine with this config: null for the CPU (the Engine makes its own, sized
// by the config), else make_runner's (CUDA sizes its KV pool from free memory when
// config.n_kv_blocks is 0).
std::unique_ptr<ModelRunner> make_engine_runner(const DeviceFlags& device, const LlamaModel& model,
                                                const EngineConfig& config);

// Flags of the commands that drive the serving engine (batch, serve): scheduling, KV pool, device.
struct EngineServingFlags {
  EngineConfig engine;
  bool no_prefix_cache = false;
  std::string kv_dtype = "f16";
  DeviceFlags device;
  void add_to(CLI::App& app);
  // The engine these flags describe. Throws CLI::ValidationError when the engine rejects their
  // combination (each flag is in range on its own), kestrel::Error when the device cannot start.
  std::unique_ptr<Engine> make_engine(const LoadedModel& lm) const;
};

// End-of-generation ids of the tokenizer (EOS, EOT, <|im_end|>, ...).
std::vector<int32_t> stop_ids(const Tokenizer& tok);

void register_generate(CLI::App& app);
void register_tokenize(CLI::App& app);
void register_chat(CLI::App& app);
void register_batch(CLI::App& app);
void register_bench(CLI::App& app);
void register_plan(CLI::App& app);
void register_serve(CLI::App& app);

}  // namespace kestrel::cli
