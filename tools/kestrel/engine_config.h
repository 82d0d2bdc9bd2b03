// The configuration of the commands that run the engine (generate, chat, bench, batch, serve): one
// struct, grouped as vLLM groups its engine arguments (model, cache, scheduler, device, parallel,
// speculative), set from the command line by add_flags(), checked as a whole against the loaded
// model in validate() (each error names its flag), and turned into the Engine's EngineConfig and
// the backend's RunnerOptions. A flag's own range is checked as it is parsed (CLI11); validate()
// checks what depends on the model, the device or other flags.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <string>

#include "backend/model_runner.h"
#include "engine/engine.h"
#include "memory/kv_dtype.h"
#include "model/llama_weights.h"
#include "spec/speculative_config.h"

namespace kestrel::cli {

// Which flags a command offers and what their defaults are.
enum class EngineMode {
  // generate, chat, bench: one request at a time. -c/--ctx-size (default 4096, capped at the
  // model's context) is the context; the KV pool holds one sequence of it; --prefill-chunk.
  Single,
  // batch, serve: --max-model-len, --max-num-seqs, --max-num-batched-tokens, --num-kv-blocks,
  // --no-prefix-cache, --swap-space, --preemption-mode.
  Serving,
};

struct KestrelConfig {
  EngineMode mode = EngineMode::Serving;
  struct Model {
    // Prompt + output tokens per request. Serving (--max-model-len): 0 = the model's context, at
    // most 8192; more than the model's context is an error. Single (-c/--ctx-size): capped at the
    // model's context.
    int64_t max_model_len = 0;
    // --load-format (vLLM's): auto reads the weights from the model's files; dummy makes random
    // weights in the shapes of the model folder's config.json (LlamaModel::load_dummy).
    std::string load_format = "auto";
    // --quantization (vLLM's): auto takes the checkpoint's config.json quantization_config; none,
    // fp8, awq or gptq must agree with it (LlamaModel::load_hf_dir); fp8 and rtn quantize a GGUF
    // file's dense projections at load (model/load_quantize.h).
    std::string quantization = "auto";
  } model;
  struct Cache {
    int32_t block_size = 16;              // --block-size: tokens per KV block
    int32_t num_kv_blocks = 0;            // --num-kv-blocks; 0 = sized by the engine (CUDA: from free memory)
    std::string kv_cache_dtype = "auto";  // --kv-cache-dtype / --kv-dtype (see resolve_kv_dtype)
    bool enable_prefix_caching = true;    // --no-prefix-cache turns it off
    double gpu_memory_utilization = 0.9;  // --gpu-memory-utilization (CUDA)
    bool populate_kv = false;             // CPU: the whole pool resident at start (serve's choice)
    double swap_space_gib = 0;            // --swap-space: GiB of host memory for swapped-out KV blocks
    double cpu_offload_kv_gib = 0;        // --cpu-offload-kv-gb: GiB of host memory for the prefix cache's host tier
  } cache;
  struct Scheduler {
    int32_t max_num_seqs = 64;             // --max-num-seqs (Single: 1)
    int64_t max_num_batched_tokens = 512;  // --max-num-batched-tokens; --prefill-chunk in Single mode
    std::string preemption_mode = "auto";  // --preemption-mode: auto, recompute or swap
  } scheduler;
  struct Device {
    std::string device = "cpu";  // --device: cpu or cuda
    int threads = 0;             // -t/--threads (CPU); 0 = every hardware thread
    bool enforce_eager = false;  // --enforce-eager (CUDA: no CUDA graphs)
    CudaTuning cuda;             // --cuda-* kernel choices
  } device;
  struct Parallel {
    int32_t tensor_parallel_size = 1;    // -tp/--tensor-parallel-size
    int32_t pipeline_parallel_size = 1;  // -pp/--pipeline-parallel-size
  } parallel;
  struct Speculative {
    // --speculative-config: vLLM's JSON object ({"method": "ngram", "num_speculative_tokens": K,
    // ...}; parse_speculative_config); empty = no speculative decoding.
    std::string config;
    // --speculative-verify: device (CUDA: verify rows sampled there, token ids back) or host
    // (logits back, verify_drafts); EngineConfig::speculative_verify_on_device.
    std::string verify = "device";
  } speculative;

  // Adds the flags of `mode` to a subcommand and sets this config's defaults for it. The CPU
  // kernel choices --cpu-isa and --no-amx are process-wide and applied as they are parsed.
  void add_flags(CLI::App& app, EngineMode mode);
  // --prefill-chunk (generate, chat): prompt tokens per forward pass.
  void add_prefill_chunk_flag(CLI::App& app);

  // Checks the flags together against the model. Throws CLI::ValidationError naming the flag: a
  // context beyond the model's, a KV pool that cannot hold one sequence, a KV dtype the device's
  // cache does not store, a parallel or speculative setting this build does not run.
  void validate(const LlamaModel& model) const;
  // validate(), then the Engine's config: auto values resolved, the Single mode's context capped
  // and its pool sized for one sequence.
  EngineConfig engine_config(const LlamaModel& model) const;
  // The backend's options for an engine with this (resolved) config.
  RunnerOptions runner_options(const EngineConfig& engine) const;
};

// The speculative decoding a --speculative-config value asks for (method None when empty).
// Throws CLI::ValidationError naming the flag and the field: a malformed object or a bad field.
SpeculativeConfig resolve_speculative_config(const std::string& json);

// The KV cache element type a --kv-cache-dtype value names, "auto" resolved as vLLM does: the
// weights' float type where that is f32 on the CPU, else f16 on the CPU and bf16 on the GPU.
// Throws CLI::ValidationError naming the flag for an unknown name.
KvDtype resolve_kv_dtype(const std::string& flag, const LlamaModel& model, const std::string& device);

}  // namespace kestrel::cli
