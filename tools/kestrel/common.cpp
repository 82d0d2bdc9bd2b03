#include "common.h"

#if defined(KESTREL_HAS_CUDA)
#include "backend/cuda/cuda_runner.h"
#endif

#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <random>
#include <thread>

#include "backend/cpu/matmul.h"
#include "core/cpu_features.h"
#include "core/env.h"
#include "core/error.h"
#include "tokenizer/tokenizer_source.h"

namespace kestrel::cli {

namespace fs = std::filesystem;

std::string resolve_model_path(const std::string& flag) {
  if (!flag.empty()) return flag;
  if (auto env = env_var(EnvVar::Model)) return *env;
  std::vector<fs::path> dirs = {fs::current_path() / "models"};
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    dirs.push_back(exe.parent_path() / "models");
    dirs.push_back(exe.parent_path().parent_path() / "models");
  }
  std::string looked;
  for (const auto& d : dirs) {
    const fs::path p = d / kDefaultModelFile;
    if (fs::exists(p, ec)) return p.string();
    looked += (looked.empty() ? "" : ", ") + d.string();
  }
  throw Error(std::string("no model given (-m PATH) and the default model ") + kDefaultModelFile +
              " is not in " + looked + "; run scripts/setup.sh to fetch it");
}

LoadedModel load_model(const std::string& model_flag, bool quiet) {
  const auto t0 = std::chrono::steady_clock::now();
  LoadedModel lm;
  const std::string path = resolve_model_path(model_flag);
  lm.model = LlamaModel::load(path);
  lm.tokenizer = load_tokenizer(path, lm.model->format() == ModelFormat::Gguf ? &lm.model->file() : nullptr);
  if (lm.tokenizer->n_vocab() > lm.model->hparams().n_vocab)
    throw Error(path + ": tokenizer has " + std::to_string(lm.tokenizer->n_vocab()) +
                " tokens but the model's output has " + std::to_string(lm.model->hparams().n_vocab));
  lm.load_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!quiet) {
    std::cerr << "kestrel: loaded " << path << " in " << lm.load_seconds << " s ("
              << lm.model->hparams().summary() << "; " << (lm.model->weight_bytes() >> 20)
              << " MiB of weights; SIMD " << simd_level_name(simd_level()) << ")\n";
  }
  return lm;
}

void SamplingFlags::add_to(CLI::App& app) {
  app.add_option("--temperature,--temp", temperature, "Sampling temperature; 0 = greedy")->capture_default_str();
  app.add_option("--top-k", top_k, "Keep the k most likely tokens; 0 = off")->capture_default_str();
  app.add_option("--top-p", top_p, "Nucleus sampling threshold; 1 = off")->capture_default_str();
  app.add_option("--min-p", min_p, "Drop tokens below min_p x the top probability; 0 = off")->capture_default_str();
  app.add_option("--repeat-penalty", repeat_penalty, "Repetition penalty; 1 = off")->capture_default_str();
  app.add_option("--seed", seed, "RNG seed; -1 = random")->capture_default_str();
}

SamplingParams SamplingFlags::params() const {
  SamplingParams p;
  p.temperature = temperature;
  p.top_k = top_k;
  p.top_p = top_p;
  p.min_p = min_p;
  p.repetition_penalty = repeat_penalty;
  if (seed < -1) throw Error("--seed must be >= 0, or -1 for a random seed, got " + std::to_string(seed));
  p.seed = seed >= 0 ? static_cast<uint64_t>(seed) : std::random_device{}();
  p.validate();
  return p;
}

namespace {
// More threads than cores only makes the spinning fork-join pool slower; allow some headroom.
int max_threads() { return 4 * static_cast<int>(std::max(1u, std::thread::hardware_concurrency())); }

void add_kv_dtype(CLI::App& app, std::string& field) {
  app.add_option("--kv-cache-dtype,--kv-dtype", field,
                 "KV cache element type: auto (f32 for f32 weights on the CPU, else f16; bf16 on the GPU), "
                 "f16 or f32 (CPU)")
      ->check(CLI::IsMember({"auto", "f16", "fp16", "float16", "f32", "fp32", "float32", "bf16"}, CLI::ignore_case))
      ->capture_default_str();
}
}  // namespace

KvDtype resolve_kv_dtype(const std::string& flag, const LlamaModel& model, const std::string& device) {
  if (flag != "auto") return parse_kv_dtype(flag, "--kv-cache-dtype");
  if (device == "cuda") return KvDtype::BF16;
  const auto& layers = model.weights().layers;
  return !layers.empty() && layers[0].wq.type.storage == GgmlType::F32 ? KvDtype::F32 : KvDtype::F16;
}

void EngineFlags::add_to(CLI::App& app) {
  app.add_option("-t,--threads", threads, "CPU threads; 0 = all cores")
      ->check(CLI::Range(0, max_threads()))
      ->capture_default_str();
  app.add_option("-c,--ctx-size", ctx_size, "Context length in tokens (at most the model's)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30))
      ->capture_default_str();
  app.add_option("--block-size", block_size, "Tokens per KV cache block")->check(CLI::Range(1, 1024))->capture_default_str();
  add_kv_dtype(app, kv_dtype);
  device.add_to(app);
}

void EngineFlags::add_prefill_chunk(CLI::App& app) {
  app.add_option("--prefill-chunk", prefill_chunk,
                 "Prompt tokens per forward pass (chunked prefill; 1 runs the prompt as decode steps)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20))
      ->capture_default_str();
}

EngineConfig EngineFlags::config(const LlamaModel& model) const {
  EngineConfig c;
  c.n_threads = threads;
  c.block_size = block_size;
  c.max_model_len = std::min(ctx_size, model.hparams().n_ctx_train);
  c.max_num_seqs = 1;
  c.max_num_batched_tokens = prefill_chunk;
  c.n_kv_blocks = static_cast<int32_t>((c.max_model_len + block_size - 1) / block_size);
  c.enable_prefix_caching = true;
  c.kv_dtype = resolve_kv_dtype(kv_dtype, model, device.device);
  return c;
}

std::unique_ptr<Engine> make_engine(const LoadedModel& lm, const EngineConfig& config, const DeviceFlags& device) {
  std::unique_ptr<ModelRunner> runner = make_engine_runner(device, *lm.model, config);
  try {
    return std::make_unique<Engine>(*lm.model, lm.tokenizer.get(), config, std::move(runner));
  } catch (const Error& e) {
    // Each flag is in range on its own (CLI11 checked); the engine rejects their combination.
    throw CLI::ValidationError("engine flags", e.what());
  }
}

SingleResult run_single(Engine& engine, Request request, const std::function<void(const RequestOutput&)>& on_output) {
  engine.add_request(std::move(request));
  SingleResult res;
  while (engine.has_unfinished())
    for (RequestOutput& o : engine.step()) {
      if (!o.prompt_logits.empty()) res.prompt_logits = std::move(o.prompt_logits);
      res.output_ids.insert(res.output_ids.end(), o.new_token_ids.begin(), o.new_token_ids.end());
      if (!o.new_token_ids.empty() && on_output) on_output(o);
      if (!o.finished) continue;
      if (o.finish_reason == "error") throw Error(o.error);
      res.finish_reason = o.finish_reason;
      res.metrics = o.metrics;
    }
  return res;
}

void DeviceFlags::add_to(CLI::App& app) {
  app.add_option("--device", device, "Backend: cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}))->capture_default_str();
  app.add_option("--gpu-memory-utilization", gpu_memory_utilization,
                 "CUDA: fraction of the GPU's memory that weights and KV cache may use")
      ->check(CLI::Range(0.05, 1.0))
      ->capture_default_str();
  app.add_flag("--enforce-eager", enforce_eager, "CUDA: launch every step's kernels eagerly (no CUDA graphs)");

  // Kernel choices, for measuring one path against another; the defaults are the fastest measured.
  // The CPU ones are process-wide and take effect as they are parsed.
  const auto on_off = CLI::IsMember({"on", "off"});
  auto toggle = [&](const char* name, bool& field, const std::string& help) {
    app.add_option_function<std::string>(name, [&field](const std::string& v) { field = v == "on"; }, help)
        ->check(on_off)
        ->default_str(field ? "on" : "off")
        ->group("Kernel choices (measurements)");
  };
  app.add_option_function<std::string>(
         "--cpu-isa",
         [](const std::string& v) {
           if (v != "auto") set_simd_level_cap(*parse_simd_level(v));
         },
         "CPU: highest SIMD path the kernels may use (auto = the best the CPU has)")
      ->check(CLI::IsMember({"auto", "avx512", "avx2", "scalar"}))
      ->default_str("auto")
      ->group("Kernel choices (measurements)");
  app.add_flag_callback("--no-amx", [] { cpu::set_amx_enabled(false); },
                        "CPU: keep prompt processing off the AMX tiles (the AVX-512 VNNI kernels instead)")
      ->group("Kernel choices (measurements)");
  CudaTuning& t = cuda;
  toggle("--cuda-stream-gemv", t.stream_gemv, "CUDA: streaming GEMV for one- and two-token projections");
  app.add_option("--cuda-stream-gemv-stages", t.stream_gemv_stages, "CUDA: its pipeline stages; 0 = the kernel's default")
      ->check(CLI::IsMember({0, 3, 4, 6}))
      ->capture_default_str()
      ->group("Kernel choices (measurements)");
  app.add_option("--cuda-stream-gemv-min-mb", t.stream_gemv_min_mb,
                 "CUDA: smallest weight (MiB of bf16) the streaming GEMV takes; smaller ones use the skinny GEMM")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 20))
      ->capture_default_str()
      ->group("Kernel choices (measurements)");
  toggle("--cuda-fused-norm", t.fused_norm, "CUDA: residual add + RMSNorm inside the streaming GEMV");
  toggle("--cuda-fused-rope", t.fused_rope, "CUDA: RoPE and the K/V write inside decode attention");
  app.add_option("--cuda-skinny-max-tokens", t.skinny_max_tokens,
                 "CUDA: token counts up to which small projections use the skinny GEMM; 0 = never")
      ->check(CLI::Range(int64_t{0}, int64_t{16}))
      ->capture_default_str()
      ->group("Kernel choices (measurements)");
  toggle("--cuda-gemm-tune", t.gemm_tune, "CUDA: time cuBLASLt's algorithms for each decode batch size");
  toggle("--cuda-gemm-split-k", t.gemm_split_k, "CUDA: split-K variants among the timed algorithms");
  toggle("--cuda-pdl", t.pdl, "CUDA: programmatic dependent launch between kernels");
  app.add_option("--cuda-attn-decode-stages", t.attn_decode_stages,
                 "CUDA: K/V tile stages of decode attention; 0 = chosen by batch size")
      ->check(CLI::IsMember({0, 2, 3}))
      ->capture_default_str()
      ->group("Kernel choices (measurements)");
  app.add_option("--cuda-attn-items-per-block", t.attn_items_per_block,
                 "CUDA: split-KV decode, k in ceil(k x resident blocks / items) splits; 0 = the measured rule")
      ->check(CLI::Range(int64_t{0}, int64_t{64}))
      ->capture_default_str()
      ->group("Kernel choices (measurements)");
  app.add_option("--cuda-attn-min-split-tiles", t.attn_min_split_tiles,
                 "CUDA: split-KV decode, 64-key tiles per split at least; 0 = the measured rule")
      ->check(CLI::Range(int64_t{0}, int64_t{4096}))
      ->capture_default_str()
      ->group("Kernel choices (measurements)");
  app.add_flag("--cuda-profile-ops", t.profile_ops,
               "CUDA: time every op of every pass (eagerly, no graphs), print per-op totals and GEMM tuning picks at exit")
      ->group("Kernel choices (measurements)");
}

void DeviceFlags::apply(RunnerOptions& o) const {
  o.gpu_memory_utilization = gpu_memory_utilization;
  o.enforce_eager = enforce_eager;
  o.cuda = cuda;
}

std::unique_ptr<ModelRunner> make_runner(const std::string& device, const LlamaModel& model,
                                         const RunnerOptions& options) {
  if (device == "cpu") return make_cpu_model_runner(model, options);
  if (device != "cuda") throw Error("--device must be cpu or cuda, got '" + device + "'");
#if defined(KESTREL_HAS_CUDA)
  // Uploading the weights is most of a GPU start (the goal: 16 GB in under 10 s): say how long.
  const auto t0 = std::chrono::steady_clock::now();
  auto runner = make_cuda_model_runner(model, options);
  std::cerr << "kestrel: " << runner->description() << " ready in "
            << std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() << " s\n";
  return runner;
#else
  throw Error("--device cuda: this kestrel was built without CUDA (configure with the CUDA toolkit installed)");
#endif
}

std::unique_ptr<ModelRunner> make_engine_runner(const DeviceFlags& device, const LlamaModel& model,
                                                const EngineConfig& config) {
  if (device.device == "cpu") return nullptr;
  RunnerOptions o;
  o.block_size = config.block_size;
  o.n_kv_blocks = config.n_kv_blocks;
  o.kv_dtype = config.kv_dtype;
  o.n_threads = config.n_threads;
  device.apply(o);
  return make_runner(device.device, model, o);
}

void EngineServingFlags::add_to(CLI::App& app) {
  EngineConfig& c = engine;
  app.add_option("--max-num-seqs", c.max_num_seqs, "Running sequences per step at most")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  app.add_option("--max-num-batched-tokens", c.max_num_batched_tokens,
                 "Tokens (decode + prefill chunks) per step at most")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30))
      ->capture_default_str();
  app.add_option("--block-size", c.block_size, "Tokens per KV block")->check(CLI::Range(1, 1024))->capture_default_str();
  app.add_option("--num-kv-blocks", c.n_kv_blocks, "KV blocks in the pool; 0 = sized from max-model-len and max-num-seqs")
      ->check(CLI::Range(0, 1 << 30))
      ->capture_default_str();
  app.add_flag("--no-prefix-cache", no_prefix_cache, "Do not reuse the KV of identical prompt prefixes");
  device.add_to(app);
  add_kv_dtype(app, kv_dtype);
  app.add_option("-t,--threads", c.n_threads, "CPU threads; 0 = all cores")
      ->check(CLI::Range(0, max_threads()))
      ->capture_default_str();
  app.add_option("--max-model-len", c.max_model_len,
                 "Prompt + output tokens per request at most; 0 = the model's context (at most 8192)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 30))
      ->capture_default_str();
}

std::unique_ptr<Engine> EngineServingFlags::make_engine(const LoadedModel& lm) const {
  EngineConfig config = engine;
  config.enable_prefix_caching = !no_prefix_cache;
  config.kv_dtype = resolve_kv_dtype(kv_dtype, *lm.model, device.device);
  return cli::make_engine(lm, config, device);
}

std::vector<int32_t> stop_ids(const Tokenizer& tok) {
  std::vector<int32_t> ids;
  for (int32_t id = 0; id < tok.n_vocab(); ++id)
    if (tok.is_eog(id)) ids.push_back(id);
  return ids;
}

}  // namespace kestrel::cli
