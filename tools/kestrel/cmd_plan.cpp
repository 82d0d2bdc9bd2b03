// kestrel plan: KV cache bytes per token and per sequence, how many tokens and sequences fit
// beside the weights, and the bandwidth ceiling of batch-1 decode. Reads only a GGUF header or a
// config.json (--config, or -m with a model folder); no weight is loaded.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <filesystem>
#include <iostream>
#include <optional>
#include <vector>

#include "common.h"
#include "core/error.h"
#include "core/units.h"
#include "io/gguf.h"
#include "memory/kv_planner.h"
#include "model/model_footprint.h"

namespace kestrel::cli {
namespace {

struct PlanArgs {
  std::string model;
  std::string config;
  std::string memory = "80GB";
  bool memory_given = false;
  std::optional<int64_t> context;
  std::string kv_dtype = "f16";
  std::string bandwidth = "4.8TB/s";
  bool json = false;
};

std::string bytes_cell(int64_t b) {
  return format_thousands(b) + " B (" + format_bytes_binary(static_cast<double>(b)) + ")";
}

// 16823.19 -> "16,823.2 tok/s".
std::string rate_cell(double tok_per_s) {
  const double tenths = std::round(tok_per_s * 10);
  const auto whole = static_cast<int64_t>(tenths / 10);
  return format_thousands(whole) + "." + std::to_string(static_cast<int64_t>(tenths) % 10) + " tok/s";
}

std::string weight_note(const ModelFootprint& fp) {
  switch (fp.weight_source) {
    case WeightSource::GgufTensors:
      return "sum of the " + std::to_string(fp.n_weight_items) + " tensor sizes in the GGUF";
    case WeightSource::SafetensorsFiles:
      return "sum of the sizes of the " + std::to_string(fp.n_weight_items) + " *.safetensors file(s)";
    case WeightSource::ConfigEstimate:
      if (fp.weight_dtype.find(' ') != std::string::npos)  // a quantized checkpoint's mix
        return "estimate: " + format_thousands(fp.n_params) + " parameters (from config.json), " + fp.weight_dtype;
      return "estimate: " + format_thousands(fp.n_params) + " parameters (from config.json) x " +
             std::to_string(fp.weight_bytes / fp.n_params) + " B (" + fp.weight_dtype + ")";
  }
  return "";
}

std::string_view weight_source_name(WeightSource s) {
  switch (s) {
    case WeightSource::GgufTensors: return "gguf_tensors";
    case WeightSource::SafetensorsFiles: return "safetensors_files";
    case WeightSource::ConfigEstimate: return "config_estimate";
  }
  return "";
}

nlohmann::ordered_json to_json(const ModelFootprint& fp, const KvPlanRequest& r, const KvPlan& p) {
  const KvGeometry& g = r.geometry;
  nlohmann::ordered_json j;
  j["model"] = fp.path;
  j["format"] = fp.format;
  j["arch"] = fp.arch;
  j["attention"] = g.is_mla() ? "mla" : "standard";
  j["n_layer"] = g.n_layer;
  // MLA caches one latent per layer, not per-head K and V: heads and head_dim do not apply.
  j["n_head_kv"] = g.is_mla() ? nlohmann::ordered_json() : nlohmann::ordered_json(g.n_head_kv);
  j["head_dim"] = g.is_mla() ? nlohmann::ordered_json() : nlohmann::ordered_json(g.head_dim);
  if (g.is_mla()) {
    j["kv_lora_rank"] = g.kv_lora_rank;
    j["rope_dim"] = g.rope_dim;
  }
  j["kv_dtype"] = kv_dtype_name(r.kv_dtype);
  j["kv_dtype_bytes"] = kv_dtype_bytes(r.kv_dtype);
  j["kv_scale_bytes"] = kv_scale_bytes(r.kv_dtype);
  j["kv_bytes_per_token"] = p.kv_bytes_per_token;
  j["context"] = r.context;
  j["kv_bytes_per_seq"] = p.kv_bytes_per_seq;
  j["weight_bytes"] = r.weight_bytes;
  j["weight_source"] = weight_source_name(fp.weight_source);
  if (fp.weight_source == WeightSource::ConfigEstimate) {
    j["n_params"] = fp.n_params;
    j["weight_dtype"] = fp.weight_dtype;
  }
  j["memory_bytes"] = r.memory_bytes;
  j["weights_fit"] = p.weights_fit;
  j["weight_shortfall_bytes"] = p.weight_shortfall_bytes;
  j["kv_budget_bytes"] = p.kv_budget_bytes;
  j["max_tokens"] = p.max_tokens;
  j["max_seqs"] = p.max_seqs;
  j["bandwidth_bytes_per_s"] = r.bandwidth_bytes_per_s;
  j["decode_tok_per_s_ceiling"] = p.decode_tok_per_s_ceiling;
  return j;
}

void print_table(const ModelFootprint& fp, const KvPlanRequest& r, const KvPlan& p, const PlanArgs& a) {
  const KvGeometry& g = r.geometry;
  const std::string elem =
      std::to_string(kv_dtype_bytes(r.kv_dtype)) + " B (" + std::string(kv_dtype_name(r.kv_dtype)) + ")";
  const int64_t scale = kv_scale_bytes(r.kv_dtype);
  const std::string per_token_formula =
      g.is_mla()
          ? "= " + std::to_string(g.n_layer) + " layers x (kv_lora_rank " + std::to_string(g.kv_lora_rank) +
                " + rope_dim " + std::to_string(g.rope_dim) + ") x " + elem +
                (scale > 0 ? " + 2 x " + std::to_string(scale) + " B row scales" : "") + ", MLA latent"
          : "= 2 (K,V) x " + std::to_string(g.n_layer) + " layers x " + std::to_string(g.n_head_kv) +
                " KV heads x " + (scale > 0 ? "(" : "") + "head_dim " + std::to_string(g.head_dim) + " x " + elem +
                (scale > 0 ? " + " + std::to_string(scale) + " B row scale)" : "");
  std::vector<std::array<std::string, 3>> rows = {
      {"KV per token", bytes_cell(p.kv_bytes_per_token), per_token_formula},
      {"context", format_thousands(r.context) + " tokens",
       a.context ? "--context" : "the model's training context"},
      {"KV per sequence", bytes_cell(p.kv_bytes_per_seq),
       "= " + format_thousands(r.context) + " tokens x " + format_thousands(p.kv_bytes_per_token) + " B"},
      {"weights", bytes_cell(r.weight_bytes), weight_note(fp)},
      {"memory", bytes_cell(r.memory_bytes), "--memory " + a.memory + (a.memory_given ? "" : " (default)")},
  };
  if (p.weights_fit) {
    rows.push_back({"KV budget", bytes_cell(p.kv_budget_bytes), "= memory - weights"});
    rows.push_back({"fits", format_thousands(p.max_tokens) + " tokens", "= KV budget / KV per token"});
    rows.push_back({"", format_thousands(p.max_seqs) + " sequences", "= KV budget / KV per sequence"});
  } else {
    rows.push_back({"KV budget", "none",
                    "the weights do not fit in memory: " +
                        format_bytes_binary(static_cast<double>(p.weight_shortfall_bytes)) + " short"});
  }
  rows.push_back({"decode ceiling", rate_cell(p.decode_tok_per_s_ceiling),
                  "= " + format_bandwidth(r.bandwidth_bytes_per_s) +
                      " / (weights + KV per sequence), batch 1, every byte read once per token"});

  std::cout << "kestrel plan: " << fp.path << " (" << (fp.format == "gguf" ? "GGUF" : "HF config")
            << (fp.arch.empty() ? "" : ", " + fp.arch) << ")\n";
  size_t w0 = 0, w1 = 0;
  for (const auto& row : rows) {
    w0 = std::max(w0, row[0].size());
    w1 = std::max(w1, row[1].size());
  }
  for (const auto& row : rows) {
    std::string line = "  " + row[0] + std::string(w0 - row[0].size() + 2, ' ') +
                       std::string(w1 - row[1].size(), ' ') + row[1] + "  " + row[2];
    std::cout << line << "\n";
  }
  if (!p.weights_fit)
    std::cout << "The weights (" << format_bytes_binary(static_cast<double>(r.weight_bytes))
              << ") do not fit in --memory " << a.memory << " ("
              << format_bytes_binary(static_cast<double>(r.memory_bytes)) << "): no room for any KV cache.\n";
}

void run_plan(const PlanArgs& a) {
  if (!a.model.empty() && !a.config.empty())
    throw Error("give either -m (a GGUF file or a model folder) or --config (a Hugging Face config.json), not both");
  // Parse the flags before opening anything, so a typo fails fast.
  KvPlanRequest r;
  r.memory_bytes = parse_byte_size(a.memory, "--memory");
  r.bandwidth_bytes_per_s = parse_bandwidth(a.bandwidth, "--bandwidth");
  r.kv_dtype = parse_kv_dtype(a.kv_dtype, "--kv-dtype");
  if (a.context && *a.context <= 0)
    throw Error("--context must be positive, got " + std::to_string(*a.context));

  ModelFootprint fp;
  if (!a.config.empty()) {
    fp = ModelFootprint::from_hf_config(a.config);
  } else {
    const std::string path = resolve_model_path(a.model);
    std::error_code ec;
    fp = std::filesystem::is_directory(path, ec) ? ModelFootprint::from_hf_config(path)
                                                 : ModelFootprint::from_gguf(GgufFile::open(path));
  }
  r.geometry = {fp.n_layer, fp.n_head_kv, fp.head_dim, fp.kv_lora_rank, fp.rope_dim};
  r.weight_bytes = fp.weight_bytes;
  r.context = a.context.value_or(fp.n_ctx_train);
  if (r.context <= 0)
    throw Error(fp.path + ": the model does not state its training context (" +
                (fp.format == "gguf" ? fp.arch + ".context_length" : std::string("max_position_embeddings")) +
                "); give --context N");
  const KvPlan p = plan_kv(r);
  if (a.json)
    std::cout << to_json(fp, r, p).dump(2) << "\n";
  else
    print_table(fp, r, p, a);
}

}  // namespace

void register_plan(CLI::App& app) {
  auto a = std::make_shared<PlanArgs>();
  CLI::App* sub = app.add_subcommand(
      "plan", "KV cache per token and per sequence, what fits beside the weights, batch-1 decode ceiling");
  sub->add_option("-m,--model", a->model,
                  "GGUF model file (only its header is read) or Hugging Face model folder (its "
                  "config.json; as --config); default: the SmolLM2 model from setup");
  sub->add_option("--config", a->config,
                  "Hugging Face config.json (or its folder) instead of a GGUF; weights: the "
                  "*.safetensors beside it, else estimated");
  sub->add_option(
         "--memory", a->memory,
         "Device memory for weights + KV: bytes, or KB/MB/GB/TB (1e3..) or KiB/MiB/GiB/TiB (1024..). "
         "Default 80GB = 80e9 bytes; an \"80 GB\" H100 has 80GiB")
      ->capture_default_str();
  sub->add_option("--context", a->context, "Tokens per sequence (default: the model's training context)");
  sub->add_option("--kv-dtype", a->kv_dtype, "KV cache element type: f16, bf16, fp8, int8, f32")
      ->capture_default_str();
  sub->add_option("--bandwidth", a->bandwidth,
                  "Memory bandwidth, e.g. 4.8TB/s (H200), 3.35TB/s (H100 SXM), 3.35e12")
      ->capture_default_str();
  sub->add_flag("--json", a->json, "Print one JSON object instead of the table");
  sub->callback([a, sub] {
    a->memory_given = sub->count("--memory") > 0;
    run_plan(*a);
  });
}

}  // namespace kestrel::cli
