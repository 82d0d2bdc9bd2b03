#include "engine_config.h"

#include <algorithm>
#include <thread>

#include "backend/cpu/matmul.h"
#include "core/cpu_features.h"
#include "core/error.h"
#include "model/pipeline_parallel.h"
#include "model/tensor_parallel.h"
#if defined(KESTREL_HAS_CUDA)
#include "backend/cuda/cuda_runner.h"
#endif

namespace kestrel::cli {

namespace {
// More threads than cores only makes the spinning fork-join pool slower; allow some headroom.
int max_threads() { return 4 * static_cast<int>(std::max(1u, std::thread::hardware_concurrency())); }

const char* const kKvDtypeFlag = "--kv-cache-dtype";

// Kernel choices, for measuring one path against another; the defaults are the fastest measured.
void add_kernel_choice_flags(CLI::App& app, CudaTuning& t) {
  const char* const group = "Kernel choices (measurements)";
  const auto on_off = CLI::IsMember({"on", "off"});
  auto toggle = [&](const char* name, bool& field, const std::string& help) {
    app.add_option_function<std::string>(name, [&field](const std::string& v) { field = v == "on"; }, help)
        ->check(on_off)
        ->default_str(field ? "on" : "off")
        ->group(group);
  };
  app.add_option_function<std::string>(
         "--cpu-isa",
         [](const std::string& v) {
           if (v != "auto") set_simd_level_cap(*parse_simd_level(v));
         },
         "CPU: highest SIMD path the kernels may use (auto = the best the CPU has)")
      ->check(CLI::IsMember({"auto", "avx512", "avx2", "scalar"}))
      ->default_str("auto")
      ->group(group);
  app.add_flag_callback("--no-amx", [] { cpu::set_amx_enabled(false); },
                        "CPU: keep prompt processing off the AMX tiles (the AVX-512 VNNI kernels instead)")
      ->group(group);
  toggle("--cuda-stream-gemv", t.stream_gemv, "CUDA: streaming GEMV for one- and two-token projections");
  toggle("--cuda-stream-gemv-fp8", t.stream_gemv_fp8,
         "CUDA: FP8 weights at one and two tokens on the W8A8 streaming GEMV (activations as E4M3 codes, as in "
         "prefill; off: the W8A16 FP8 skinny GEMM)");
  app.add_option("--cuda-stream-gemv-stages", t.stream_gemv_stages, "CUDA: its pipeline stages; 0 = the kernel's default")
      ->check(CLI::IsMember({0, 3, 4, 6}))
      ->capture_default_str()
      ->group(group);
  app.add_option("--cuda-stream-gemv-min-mb", t.stream_gemv_min_mb,
                 "CUDA: smallest weight (MiB of bf16) the streaming GEMV takes; smaller ones use the skinny GEMM")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 20))
      ->capture_default_str()
      ->group(group);
  app.add_option("--cuda-stream-prefetch-kb", t.stream_prefetch_kb,
                 "CUDA: KiB of the next projection's weights each SM of an FP8 or INT4 streaming GEMV prefetches "
                 "into L2 at its end; 0 = none")
      ->check(CLI::Range(int64_t{0}, int64_t{1024}))
      ->capture_default_str()
      ->group(group);
  toggle("--cuda-fused-norm", t.fused_norm, "CUDA: residual add + RMSNorm inside the streaming GEMV");
  toggle("--cuda-fused-rope", t.fused_rope, "CUDA: RoPE and the K/V write inside decode attention");
  app.add_flag("--enable-dbo", t.dbo,
               "CUDA: dual-batch overlap: large decode steps as two micro-batches on two streams, one half's "
               "attention beside the other's projections")
      ->group(group);
  app.add_option("--dbo-decode-token-threshold", t.dbo_decode_token_threshold,
                 "CUDA: decode steps of at least this many tokens are split under --enable-dbo")
      ->check(CLI::Range(int64_t{2}, int64_t{1} << 20))
      ->capture_default_str()
      ->group(group);
  toggle("--cuda-verify-decode-rows", t.verify_decode_rows,
         "CUDA: speculative verify steps' attention on the decode kernel, each token as a one-token step "
         "(its bits; off: the prefill kernel)");
  app.add_option("--cuda-skinny-max-tokens", t.skinny_max_tokens,
                 "CUDA: token counts up to which small projections use the skinny GEMM; 0 = never")
      ->check(CLI::Range(int64_t{0}, int64_t{16}))
      ->capture_default_str()
      ->group(group);
  toggle("--cuda-gemm-tune", t.gemm_tune, "CUDA: time cuBLASLt's algorithms for each decode batch size");
  toggle("--cuda-gemm-split-k", t.gemm_split_k, "CUDA: split-K variants among the timed algorithms");
  toggle("--cuda-pdl", t.pdl, "CUDA: programmatic dependent launch between kernels");
  app.add_option("--cuda-attn-decode-stages", t.attn_decode_stages,
                 "CUDA: K/V tile stages of decode attention; 0 = chosen by batch size")
      ->check(CLI::IsMember({0, 2, 3}))
      ->capture_default_str()
      ->group(group);
  app.add_option("--cuda-attn-fp8-decode-key-tile", t.attn_fp8_decode_key_tile,
                 "CUDA: keys a K/V stage of decode attention on an FP8 cache (head dims 64, 128); 0 = by stage count")
      ->check(CLI::IsMember({0, 64, 128}))
      ->capture_default_str()
      ->group(group);
  app.add_option("--cuda-attn-items-per-block", t.attn_items_per_block,
                 "CUDA: split-KV decode, k in ceil(k x resident blocks / items) splits; 0 = the measured rule")
      ->check(CLI::Range(int64_t{0}, int64_t{64}))
      ->capture_default_str()
      ->group(group);
  app.add_option("--cuda-attn-min-split-tiles", t.attn_min_split_tiles,
                 "CUDA: split-KV decode, 64-key tiles per split at least; 0 = the measured rule")
      ->check(CLI::Range(int64_t{0}, int64_t{4096}))
      ->capture_default_str()
      ->group(group);
  app.add_option_function<std::string>(
         "--cuda-gguf-weights", [&t](const std::string& v) { t.gguf_in_place = v == "in-place"; },
         "CUDA: GGUF quantized weights (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K) as bf16 (dequantized at upload) "
         "or in-place (their blocks on the device, dequantized in the kernels: less memory)")
      ->check(CLI::IsMember({"bf16", "in-place"}))
      ->default_str(t.gguf_in_place ? "in-place" : "bf16")
      ->group(group);
  app.add_flag("--cuda-profile-ops", t.profile_ops,
               "CUDA: time every op of every pass (eagerly, no graphs), print per-op totals and GEMM tuning picks at exit")
      ->group(group);
}

// The context the engine will use: Serving's 0 = the model's context up to kDefaultMaxModelLen;
// Single's -c capped at the model's context.
int64_t resolved_max_model_len(const KestrelConfig& c, const ModelHparams& hp) {
  if (c.mode == EngineMode::Single) return std::min(c.model.max_model_len, hp.n_ctx_train);
  return c.model.max_model_len == 0 ? std::min(hp.n_ctx_train, kDefaultMaxModelLen) : c.model.max_model_len;
}
}  // namespace

KvDtype resolve_kv_dtype(const std::string& flag, const LlamaModel& model, const std::string& device) {
  if (flag != "auto") {
    try {
      return parse_kv_dtype(flag, kKvDtypeFlag);
    } catch (const Error& e) {
      throw CLI::ValidationError(kKvDtypeFlag, e.what());
    }
  }
  if (device == "cuda") return KvDtype::BF16;
  const LayerTensor* q = model.weights().find({0, WeightRole::Q});
  return q != nullptr && q->matrix.type.storage == GgmlType::F32 ? KvDtype::F32 : KvDtype::F16;
}

void KestrelConfig::add_flags(CLI::App& app, EngineMode m) {
  mode = m;
  if (mode == EngineMode::Single) {
    model.max_model_len = 4096;
    scheduler.max_num_seqs = 1;
    scheduler.max_num_batched_tokens = 256;
    app.add_option("-c,--ctx-size", model.max_model_len, "Context length in tokens (at most the model's)")
        ->check(CLI::Range(int64_t{1}, int64_t{1} << 30))
        ->capture_default_str();
  } else {
    app.add_option("--max-num-seqs", scheduler.max_num_seqs, "Running sequences per step at most")
        ->check(CLI::Range(1, 1 << 20))
        ->capture_default_str();
    app.add_option("--max-num-batched-tokens", scheduler.max_num_batched_tokens,
                   "Tokens (decode + prefill chunks) per step at most")
        ->check(CLI::Range(int64_t{1}, int64_t{1} << 30))
        ->capture_default_str();
    app.add_option("--num-kv-blocks", cache.num_kv_blocks,
                   "KV blocks in the pool; 0 = sized from max-model-len and max-num-seqs (CUDA: from free memory)")
        ->check(CLI::Range(0, 1 << 30))
        ->capture_default_str();
    app.add_flag_callback("--no-prefix-cache", [this] { cache.enable_prefix_caching = false; },
                          "Do not reuse the KV of identical prompt prefixes");
    app.add_option("--swap-space", cache.swap_space_gib,
                   "GiB of host memory (CUDA: pinned) for the KV blocks of sequences preempted by swap; 0 = none, "
                   "every preemption recomputes")
        ->check(CLI::Range(0.0, 1048576.0))
        ->capture_default_str();
    app.add_option("--cpu-offload-kv-gb", cache.cpu_offload_kv_gib,
                   "GiB of host memory (CUDA: pinned) for prefix-cache KV blocks evicted from the device pool, copied "
                   "back on a prefix hit instead of recomputed; 0 = none")
        ->check(CLI::Range(0.0, 1048576.0))
        ->capture_default_str();
    app.add_option("--preemption-mode", scheduler.preemption_mode,
                   "How a preempted sequence's KV is kept: recompute (freed, prefilled again), swap (copied to "
                   "--swap-space and back), auto (swap when cheaper by the measured prefill time and the host "
                   "link's bandwidth; recompute when the swap space is full)")
        ->check(CLI::IsMember({"auto", "recompute", "swap"}))
        ->capture_default_str();
    app.add_option("--max-model-len", model.max_model_len,
                   "Prompt + output tokens per request at most; 0 = the model's context (at most 8192)")
        ->check(CLI::Range(int64_t{0}, int64_t{1} << 30))
        ->capture_default_str();
  }
  app.add_option("--load-format", model.load_format,
                 "Where the weights come from: auto (the model's files) or dummy (random weights in the shapes "
                 "of the model folder's config.json, made in memory: bf16, or GPTQ 4-bit codes when its "
                 "quantization_config says so; for speed measurements)")
      ->check(CLI::IsMember({"auto", "dummy"}))
      ->capture_default_str();
  app.add_option("--quantization,-q", model.quantization,
                 "Weight quantization: auto (a Hugging Face checkpoint's config.json quantization_config, a GGUF "
                 "file's block types), none, fp8 (compressed-tensors or block fp8 checkpoints; float or GGUF weights "
                 "quantized at load to E4M3 per output row), awq (AutoAWQ GEMM), gptq (v1 layout, 4 or 8 bits) or "
                 "rtn (GGUF: round-to-nearest INT4 at load, groups of 128, zero points); awq and gptq must agree "
                 "with the checkpoint")
      ->check(CLI::IsMember({"auto", "none", "fp8", "compressed-tensors", "awq", "gptq", "rtn"}))
      ->capture_default_str();
  app.add_option("--block-size", cache.block_size, "Tokens per KV cache block")->check(CLI::Range(1, 1024))->capture_default_str();
  app.add_option("--kv-cache-dtype,--kv-dtype", cache.kv_cache_dtype,
                 "KV cache element type: auto (f32 for f32 weights on the CPU, else f16; bf16 on the GPU), "
                 "f16, f32 or int8 (CPU; int8 codes with an f32 scale per cached row), bf16 or fp8 (CUDA; fp8: "
                 "E4M3 codes with one f32 scale per token and KV head)")
      ->check(CLI::IsMember({"auto", "f16", "fp16", "float16", "f32", "fp32", "float32", "bf16", "int8", "fp8"},
                            CLI::ignore_case))
      ->capture_default_str();
  app.add_option("-t,--threads", device.threads, "CPU threads; 0 = all cores")
      ->check(CLI::Range(0, max_threads()))
      ->capture_default_str();
  app.add_option("--device", device.device, "Backend: cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}))->capture_default_str();
  app.add_option("--gpu-memory-utilization", cache.gpu_memory_utilization,
                 "CUDA: fraction of the GPU's memory that weights and KV cache may use")
      ->check(CLI::Range(0.05, 1.0))
      ->capture_default_str();
  app.add_flag("--enforce-eager", device.enforce_eager, "CUDA: launch every step's kernels eagerly (no CUDA graphs)");
  app.add_option("--tensor-parallel-size", parallel.tensor_parallel_size, "Ranks a model's layers are split across (Megatron-style tensor parallelism; CPU: one thread per rank, "
                 "--threads shared among them; CUDA: rank r on GPU r, NCCL between them)")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  app.add_option("--pipeline-parallel-size", parallel.pipeline_parallel_size,
                 "Stages a model's layers are split across, up to one pass of different sequences per stage in flight "
                 "(CPU: one thread per stage, --threads shared among them; CUDA: stage s on GPU s)")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  app.add_option("--speculative-config", speculative.config,
                 "Speculative decoding, vLLM's JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": K (1-16), "
                 "\"prompt_lookup_min\": N (default 2), \"prompt_lookup_max\": M (default 5), "
                 "\"disable_by_batch_size\": B (off when more than B sequences run; 0 = never), "
                 "\"draft_length\": \"adaptive\" (default) | \"fixed\"}; "
                 "the output distribution is the model's own");
  app.add_option("--speculative-verify", speculative.verify,
                 "Where drafts are verified on a backend that samples on the device (CUDA): device (each of the "
                 "1 + k rows sampled there, only token ids copied back; requests with logprobs, penalties, bias "
                 "or a draft model's sampled q stay on the host) or host (the logits copied back)")
      ->check(CLI::IsMember({"device", "host"}))
      ->capture_default_str();
  add_kernel_choice_flags(app, device.cuda);
}

void KestrelConfig::add_prefill_chunk_flag(CLI::App& app) {
  app.add_option("--prefill-chunk", scheduler.max_num_batched_tokens,
                 "Prompt tokens per forward pass (chunked prefill; 1 runs the prompt as decode steps)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20))
      ->capture_default_str();
}

void KestrelConfig::validate(const LlamaModel& m) const {
  const ModelHparams& hp = m.hparams();
  if (mode == EngineMode::Serving && model.max_model_len > hp.n_ctx_train)
    throw CLI::ValidationError("--max-model-len", std::to_string(model.max_model_len) +
                                                      " exceeds the model's context of " + std::to_string(hp.n_ctx_train));
  const int64_t max_model_len = resolved_max_model_len(*this, hp);
  const int64_t blocks_per_seq =
      kv_blocks_per_sequence(hp, max_model_len, cache.block_size, scheduler.max_num_batched_tokens);
  if (cache.num_kv_blocks > 0 && cache.num_kv_blocks < blocks_per_seq && hp.kv_lookback() > 0)
    throw CLI::ValidationError(
        "--num-kv-blocks", "a KV pool of " + std::to_string(cache.num_kv_blocks) + " blocks of " +
                               std::to_string(cache.block_size) + " tokens cannot hold one sequence's sliding window of " +
                               std::to_string(hp.kv_lookback()) + " tokens plus a step of " +
                               std::to_string(scheduler.max_num_batched_tokens) +
                               " (--max-num-batched-tokens; needs " + std::to_string(blocks_per_seq) +
                               " blocks): raise --num-kv-blocks or lower --max-num-batched-tokens");
  if (cache.num_kv_blocks > 0 && cache.num_kv_blocks < blocks_per_seq)
    throw CLI::ValidationError(
        "--num-kv-blocks", "a KV pool of " + std::to_string(cache.num_kv_blocks) + " blocks of " +
                               std::to_string(cache.block_size) + " tokens cannot hold one sequence of " +
                               std::to_string(max_model_len) + " tokens (--max-model-len; needs " +
                               std::to_string(blocks_per_seq) + " blocks): raise --num-kv-blocks or lower --max-model-len");
  if (scheduler.preemption_mode == "swap" && cache.swap_space_gib <= 0)
    throw CLI::ValidationError("--preemption-mode", "swap needs --swap-space > 0 (GiB of host memory for the swapped "
                                                    "KV blocks)");
  if (cache.cpu_offload_kv_gib > 0 && !cache.enable_prefix_caching)
    throw CLI::ValidationError("--cpu-offload-kv-gb", "the host tier holds prefix-cache blocks: it needs the prefix "
                                                      "cache (drop --no-prefix-cache)");
  if (cache.cpu_offload_kv_gib > 0 && hp.kv_lookback() > 0)
    throw CLI::ValidationError("--cpu-offload-kv-gb", "does not apply to a model whose every layer has a sliding "
                                                      "window (" + std::to_string(hp.kv_lookback()) + " tokens)");
  const KvDtype kv = resolve_kv_dtype(cache.kv_cache_dtype, m, device.device);
  if (device.device == "cuda" && kv != KvDtype::BF16 && kv != KvDtype::FP8)
    throw CLI::ValidationError(kKvDtypeFlag, std::string(kv_dtype_name(kv)) +
                                                 ": the CUDA backend's KV cache stores bf16 or fp8 (or auto)");
  if (device.device == "cuda" && kv == KvDtype::FP8 && hp.mla.enabled())
    throw CLI::ValidationError(kKvDtypeFlag, "fp8: the CUDA backend keeps an MLA model's latent cache in bf16 (use "
                                             "bf16 or auto)");
  if (device.device != "cuda" && kv != KvDtype::F16 && kv != KvDtype::F32 && kv != KvDtype::INT8)
    throw CLI::ValidationError(kKvDtypeFlag, std::string(kv_dtype_name(kv)) +
                                                 ": the CPU backend's KV cache stores f16, f32 or int8 (or auto)");
  // --device cuda places part n of a split on GPU n: n parts need n visible GPUs.
  auto need_gpus = [&](const char* flag, int32_t n, const char* placement) {
    if (n == 1 || device.device != "cuda") return;
#if defined(KESTREL_HAS_CUDA)
    const int visible = cuda_device_count();
#else
    const int visible = 0;
#endif
    if (visible < n)
      throw CLI::ValidationError(flag, std::to_string(n) + ": needs " + std::to_string(n) + " GPUs (" + placement +
                                           "); " + std::to_string(visible) + " visible");
  };
  need_gpus("--tensor-parallel-size", parallel.tensor_parallel_size, "rank r on GPU r");
  try {
    validate_tensor_parallel(hp, parallel.tensor_parallel_size);
  } catch (const Error& e) {
    throw CLI::ValidationError("--tensor-parallel-size", e.what());
  }
  const int32_t pp = parallel.pipeline_parallel_size;
  need_gpus("--pipeline-parallel-size", pp, "stage s on GPU s");
  try {
    validate_pipeline_parallel(hp, pp);
  } catch (const Error& e) {
    throw CLI::ValidationError("--pipeline-parallel-size", e.what());
  }
  if (pp != 1 && parallel.tensor_parallel_size != 1)
    throw CLI::ValidationError("--pipeline-parallel-size",
                               std::to_string(pp) + " with --tensor-parallel-size " +
                                   std::to_string(parallel.tensor_parallel_size) +
                                   ": a model is split one way at a time (tensor or pipeline parallelism)");
  resolve_speculative_config(speculative.config);
}

SpeculativeConfig resolve_speculative_config(const std::string& json) {
  if (json.empty()) return {};
  SpeculativeConfig c;
  try {
    c = parse_speculative_config(json);
  } catch (const Error& e) {
    throw CLI::ValidationError("--speculative-config", e.what());
  }
  return c;
}

EngineConfig KestrelConfig::engine_config(const LlamaModel& m) const {
  validate(m);
  EngineConfig c;
  c.block_size = cache.block_size;
  c.max_model_len = resolved_max_model_len(*this, m.hparams());
  c.max_num_seqs = scheduler.max_num_seqs;
  c.max_num_batched_tokens = scheduler.max_num_batched_tokens;
  c.n_kv_blocks = cache.num_kv_blocks;
  // One request at a time: a pool of exactly max_num_seqs sequences of the context (of the window
  // and a step when every layer is windowed), whatever the device.
  if (mode == EngineMode::Single && c.n_kv_blocks == 0)
    c.n_kv_blocks = static_cast<int32_t>(
        scheduler.max_num_seqs *
        kv_blocks_per_sequence(m.hparams(), c.max_model_len, c.block_size, c.max_num_batched_tokens));
  c.enable_prefix_caching = cache.enable_prefix_caching;
  c.kv_dtype = resolve_kv_dtype(cache.kv_cache_dtype, m, device.device);
  c.n_threads = device.threads;
  c.populate_kv = cache.populate_kv;
  c.swap_space_bytes = static_cast<int64_t>(cache.swap_space_gib * static_cast<double>(int64_t{1} << 30));
  c.cpu_offload_kv_bytes = static_cast<int64_t>(cache.cpu_offload_kv_gib * static_cast<double>(int64_t{1} << 30));
  c.preemption_mode = parse_preemption_mode(scheduler.preemption_mode);
  c.tensor_parallel_size = parallel.tensor_parallel_size;
  c.pipeline_parallel_size = parallel.pipeline_parallel_size;
  c.speculative = resolve_speculative_config(speculative.config);
  c.speculative_verify_on_device = speculative.verify == "device";
  return c;
}

RunnerOptions KestrelConfig::runner_options(const EngineConfig& engine) const {
  RunnerOptions o;
  o.block_size = engine.block_size;
  o.n_kv_blocks = engine.n_kv_blocks;
  o.kv_dtype = engine.kv_dtype;
  o.n_threads = engine.n_threads;
  o.populate_kv = engine.populate_kv;
  o.tensor_parallel_size = engine.tensor_parallel_size;
  o.pipeline_parallel_size = engine.pipeline_parallel_size;
  o.gpu_memory_utilization = cache.gpu_memory_utilization;
  o.enforce_eager = device.enforce_eager;
  o.cuda = device.cuda;
  return o;
}

}  // namespace kestrel::cli
