#include "common.h"

#if defined(KESTREL_HAS_CUDA)
#include "backend/cuda/cuda_runner.h"
#endif

#include <unistd.h>

#include <charconv>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <random>
#include <sstream>

#include "core/cpu_features.h"
#include "core/env.h"
#include "core/error.h"
#include "spec/draft_model_drafter.h"
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

namespace {
// Whether a folder holds any of the files Tokenizer::from_hf_dir reads.
bool has_tokenizer_files(const std::string& dir) {
  std::error_code ec;
  for (const char* f : {"tokenizer.json", "tokenizer.model", "vocab.json", "encoder.json"})
    if (fs::exists(fs::path(dir) / f, ec)) return true;
  return false;
}
}  // namespace

LoadedModel load_model(const std::string& model_flag, const KestrelConfig& config, bool quiet) {
  const auto t0 = std::chrono::steady_clock::now();
  LoadedModel lm;
  const std::string path = resolve_model_path(model_flag);
  const LoadFormat format = parse_load_format(config.model.load_format);
  lm.model = LlamaModel::load(path, format, parse_quantization(config.model.quantization));
  if (format == LoadFormat::Auto || has_tokenizer_files(path))
    lm.tokenizer = load_tokenizer(path, lm.model->format() == ModelFormat::Gguf ? &lm.model->file() : nullptr);
  if (lm.tokenizer != nullptr && lm.tokenizer->n_vocab() > lm.model->hparams().n_vocab)
    throw Error(path + ": tokenizer has " + std::to_string(lm.tokenizer->n_vocab()) +
                " tokens but the model's output has " + std::to_string(lm.model->hparams().n_vocab));
  lm.load_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!quiet) {
    std::cerr << "kestrel: loaded " << path << " in " << lm.load_seconds << " s ("
              << lm.model->hparams().summary() << "; " << (lm.model->weight_bytes() >> 20)
              << (lm.model->generated_weights() ? " MiB of random weights (--load-format dummy)" : " MiB of weights")
              << (lm.tokenizer == nullptr ? ", no tokenizer" : "") << "; SIMD " << simd_level_name(simd_level())
              << ")\n";
  }
  return lm;
}

const Tokenizer& require_tokenizer(const LoadedModel& lm, const std::string& command) {
  if (lm.tokenizer == nullptr)
    throw Error(lm.model->path() + ": kestrel " + command +
                " reads and writes text and needs a tokenizer, but this --load-format dummy folder has no "
                "tokenizer files (tokenizer.json, tokenizer.model, vocab.json); add the model's tokenizer "
                "files, or measure speed with `kestrel bench`, which runs on token ids");
  return *lm.tokenizer;
}

void SamplingFlags::add_to(CLI::App& app) {
  app.add_option("--temperature,--temp", temperature, "Sampling temperature; 0 = greedy")->capture_default_str();
  app.add_option("--top-k", top_k, "Keep the k most likely tokens; 0 = off")->capture_default_str();
  app.add_option("--top-p", top_p, "Nucleus sampling threshold; 1 = off")->capture_default_str();
  app.add_option("--min-p", min_p, "Drop tokens below min_p x the top probability; 0 = off")->capture_default_str();
  app.add_option("--repeat-penalty", repeat_penalty, "Repetition penalty; 1 = off")->capture_default_str();
  // A check on the text: CLI11's conversion saturates an out-of-range integer at the type's bound.
  app.add_option("--seed", seed, "RNG seed; -1 = random")
      ->capture_default_str()
      ->check([](const std::string& s) {
        int64_t v = 0;
        const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
        if (ec != std::errc() || end != s.data() + s.size() || v < -1)
          return std::string("must be -1 (random) or an integer in [0, 9223372036854775807], got " + s);
        return std::string();
      });
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
  try {
    p.validate();
  } catch (const SamplingParamError& e) {
    // The rule of SamplingParams::validate, under the flag's name, as a usage error (exit status 2).
    const std::pair<const char*, std::pair<const char*, double>> flags[] = {
        {"temperature", {"--temperature", temperature}}, {"top_k", {"--top-k", static_cast<double>(top_k)}},
        {"top_p", {"--top-p", top_p}},                   {"min_p", {"--min-p", min_p}},
        {"repetition_penalty", {"--repeat-penalty", repeat_penalty}}};
    for (const auto& [field, flag] : flags) {
      if (e.field() != field) continue;
      std::ostringstream value;
      value << flag.second;
      throw CLI::ValidationError(flag.first, e.rule() + ", got " + value.str());
    }
    throw;
  }
  return p;
}

namespace {

// The draft model of --speculative-config's draft_model method, loaded as the target is (its
// --load-format; its own "quantization"), with its runner on the target's device. Throws
// CLI::ValidationError naming the flag when it cannot load or cannot draft for the target.
DraftModel load_draft_model(const LoadedModel& lm, const KestrelConfig& config, const EngineConfig& engine) {
  const SpeculativeConfig& sc = engine.speculative;
  DraftModel d;
  try {
    KestrelConfig dc = config;
    dc.model.quantization = sc.quantization;
    LoadedModel draft = load_model(sc.model, dc, /*quiet=*/false);
    check_draft_vocabulary(*lm.model, lm.tokenizer.get(), *draft.model, draft.tokenizer.get());
    if (config.device.device == "cpu" && draft.model->online_fp8())
      throw Error("\"quantization\": \"fp8\" on float weights quantizes them at load on the GPU (--device cuda)");
    d.model = std::move(draft.model);
    d.tokenizer = std::move(draft.tokenizer);
  } catch (const Error& e) {
    throw CLI::ValidationError("--speculative-config", std::string("draft model: ") + e.what());
  }
  if (config.device.device != "cpu") {
    DrafterContext ctx;
    ctx.max_num_seqs = engine.max_num_seqs;
    ctx.max_model_len = engine.max_model_len;
    ctx.block_size = engine.block_size;
    ctx.kv_dtype = engine.kv_dtype;
    RunnerOptions o = config.runner_options(engine);
    o.n_kv_blocks = draft_kv_blocks(d.model->hparams(), ctx);
    o.quantize_fp8 = d.model->fp8_weights();
    d.runner = make_runner(config.device.device, *d.model, o);
  }
  return d;
}

}  // namespace

std::unique_ptr<Engine> make_engine(const LoadedModel& lm, const KestrelConfig& config) {
  const EngineConfig engine_config = config.engine_config(*lm.model);
  std::unique_ptr<ModelRunner> runner;
  if (config.device.device == "cpu" && lm.model->online_fp8())
    throw CLI::ValidationError("--quantization", "fp8 on float weights quantizes them at load on the GPU (--device "
                                                 "cuda); the CPU backend runs FP8 checkpoints dequantized");
  // The draft first: a GPU target sizes its KV pool from the memory the draft leaves.
  DraftModel draft;
  if (engine_config.speculative.enabled() && engine_config.speculative.method == SpecMethod::DraftModel)
    draft = load_draft_model(lm, config, engine_config);
  if (config.device.device != "cpu") {
    RunnerOptions o = config.runner_options(engine_config);
    o.quantize_fp8 = lm.model->fp8_weights();
    runner = make_runner(config.device.device, *lm.model, o);
  }
  try {
    return std::make_unique<Engine>(*lm.model, lm.tokenizer.get(), engine_config, std::move(runner), std::move(draft));
  } catch (const Error& e) {
    // What only the backend knows: a CUDA pool sized from free memory that holds no whole sequence.
    if (config.device.device == "cpu") throw;
    throw CLI::ValidationError("--gpu-memory-utilization", e.what());
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

std::vector<int32_t> stop_ids(const Tokenizer& tok) {
  std::vector<int32_t> ids;
  for (int32_t id = 0; id < tok.n_vocab(); ++id)
    if (tok.is_eog(id)) ids.push_back(id);
  return ids;
}

}  // namespace kestrel::cli
