// Shared pieces of the kestrel subcommands: finding and loading the model, sampling flags.
#pragma once

#include <CLI/CLI.hpp>

#include <memory>
#include <string>

#include "engine/engine.h"
#include <functional>
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

// The KV cache element type a --kv-dtype / --kv-cache-dtype value names, "auto" resolved as vLLM
// does: the weights' float type where that is f32 on the CPU, else f16 on the CPU and bf16 on the
// GPU. Throws kestrel::Error naming the flag for an unknown name.
KvDtype resolve_kv_dtype(const std::string& flag, const LlamaModel& model, const std::string& device);

// Flags of the commands that run one request at a time through the engine (generate, chat, bench).
struct EngineFlags {
  int threads = 0;
  int64_t ctx_size = 4096;
  int block_size = 16;
  std::string kv_dtype = "auto";
  int64_t prefill_chunk = 256;  // prompt tokens per forward pass
  DeviceFlags device;
  void add_to(CLI::App& app);
  // --prefill-chunk, for generate and chat (bench runs its prompt in one pass).
  void add_prefill_chunk(CLI::App& app);
  // The engine for one sequence of up to --ctx-size tokens (capped at the model's context), its
  // prompt run --prefill-chunk tokens per step, with the prefix cache on (a chat turn reuses the
  // KV of the conversation before it).
  EngineConfig config(const LlamaModel& model) const;
};

// The engine for this config on the device these flags name (make_engine_runner). Throws
// CLI::ValidationError when the engine rejects the config (each flag is in range on its own),
// kestrel::Error when the device cannot start.
std::unique_ptr<Engine> make_engine(const LoadedModel& lm, const EngineConfig& config, const DeviceFlags& device);

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
  std::string kv_dtype = "auto";
  DeviceFlags device;
  void add_to(CLI::App& app);
  // The engine these flags describe (make_engine).
  std::unique_ptr<Engine> make_engine(const LoadedModel& lm) const;
};

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

}  // namespace kestrel::cli
