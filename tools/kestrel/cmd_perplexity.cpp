// kestrel perplexity: perplexity of a text, and the KL divergence of the next-token distributions
// from a base run (llama.cpp's llama-perplexity flags: -f, -c, --chunks, --kl-divergence-base,
// --kl-divergence). The measurements are engine/perplexity.h's; each chunk is one request whose
// prompt logits the engine returns (Request::prompt_logits).
#include <nlohmann/json.hpp>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>

#include "common.h"
#include "core/error.h"
#include "engine/perplexity.h"

namespace kestrel::cli {

namespace {
struct PerplexityArgs {
  std::string model;
  std::string text_file;
  int64_t chunks = 0;
  std::string kld_base;
  bool kld = false;
  bool json = false;
  KestrelConfig config;
};

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw CLI::ValidationError("-f,--file", path + ": cannot open the text file");
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

void run_perplexity(PerplexityArgs a) {
  const int64_t n_ctx = a.config.model.max_model_len;
  if (a.kld && a.kld_base.empty())
    throw CLI::ValidationError("--kl-divergence", "needs --kl-divergence-base FILE (the base run's file to compare with)");
  if (!a.kld && a.text_file.empty()) throw CLI::ValidationError("-f,--file", "a text file is required (-f FILE)");
  LoadedModel lm = load_model(a.model, a.config, a.json);
  const Tokenizer& tok = require_tokenizer(lm, "perplexity");
  const int64_t n_vocab = lm.model->hparams().n_vocab;
  if (n_ctx >= lm.model->hparams().n_ctx_train)
    throw CLI::ValidationError("-c,--ctx-size", std::to_string(n_ctx) + " tokens: the chunk and one sampled token must "
                                                "fit the model's context of " +
                                                    std::to_string(lm.model->hparams().n_ctx_train));

  std::vector<int32_t> chunks;
  if (!a.text_file.empty()) {
    const std::vector<int32_t> ids = tok.encode(read_text(a.text_file), /*add_special=*/false, /*parse_special=*/false);
    chunks = perplexity_chunks(ids, n_ctx, tok.add_bos() ? tok.bos_id() : -1, a.chunks);
  }
  std::unique_ptr<KldBaseReader> base;
  std::unique_ptr<KldBaseWriter> save;
  if (a.kld) {
    base = std::make_unique<KldBaseReader>(a.kld_base);
    const int64_t n = check_kld_base(*base, n_vocab, n_ctx, chunks, a.chunks);
    chunks.assign(base->tokens().begin(), base->tokens().begin() + n * n_ctx);
  } else if (!a.kld_base.empty()) {
    const KldBaseHeader h{n_vocab, n_ctx, kld_first_scored(n_ctx), static_cast<int64_t>(chunks.size()) / n_ctx};
    save = std::make_unique<KldBaseWriter>(a.kld_base, h, chunks);
  }

  // One chunk at a time: a pool of one sequence of the chunk plus the token sampled beside the logits.
  KestrelConfig cfg = a.config;
  cfg.model.max_model_len = n_ctx + 1;
  std::unique_ptr<Engine> engine = make_engine(lm, cfg);
  const int64_t n_chunks = static_cast<int64_t>(chunks.size()) / n_ctx;
  if (!a.json)
    std::fprintf(stderr, "kestrel: perplexity over %lld chunks of %lld tokens, positions %lld..%lld of each scored\n",
                 static_cast<long long>(n_chunks), static_cast<long long>(n_ctx),
                 static_cast<long long>(kld_first_scored(n_ctx) + 1), static_cast<long long>(n_ctx - 1));
  const auto logits_of = [&](std::span<const int32_t> chunk) {
    Request req;
    req.prompt.assign(chunk.begin(), chunk.end());
    req.max_tokens = 1;
    req.sampling.temperature = 0;
    req.prompt_logits = true;
    return run_single(*engine, std::move(req), nullptr).prompt_logits;
  };
  const PerplexityResult r = evaluate_perplexity(chunks, n_ctx, n_vocab, logits_of, save.get(), base.get(), [&](int64_t c) {
    if (!a.json) std::fprintf(stderr, "kestrel: chunk %lld/%lld\n", static_cast<long long>(c), static_cast<long long>(n_chunks));
  });
  if (save != nullptr) save->finish();

  if (a.json) {
    nlohmann::json j;
    j["n_ctx"] = r.n_ctx;
    j["first_scored"] = r.first;
    j["n_chunks"] = r.n_chunks;
    j["n_scored"] = r.n_scored;
    j["ppl"] = r.ppl;
    j["ppl_unc"] = r.ppl_unc;
    if (r.has_kl) {
      j["base_ppl"] = r.base_ppl;
      j["base_ppl_unc"] = r.base_ppl_unc;
      j["kl_mean"] = r.kl_mean;
      j["kl_mean_unc"] = r.kl_mean_unc;
      j["kl_median"] = r.kl_median;
      j["kl_p99"] = r.kl_p99;
      j["kl_max"] = r.kl_max;
      j["top1"] = r.top1;
      j["top1_unc"] = r.top1_unc;
    }
    std::cout << j.dump() << "\n";
    return;
  }
  std::printf("scored positions: %lld (%lld chunks of %lld tokens, positions %lld..%lld)\n",
              static_cast<long long>(r.n_scored), static_cast<long long>(r.n_chunks), static_cast<long long>(r.n_ctx),
              static_cast<long long>(r.first + 1), static_cast<long long>(r.n_ctx - 1));
  std::printf("PPL:        %.4f +/- %.4f\n", r.ppl, r.ppl_unc);
  if (!r.has_kl) return;
  std::printf("base PPL:   %.4f +/- %.4f\n", r.base_ppl, r.base_ppl_unc);
  std::printf("mean KL:    %.6f +/- %.6f\n", r.kl_mean, r.kl_mean_unc);
  std::printf("median KL:  %.6f\n", r.kl_median);
  std::printf("99%% KL:     %.6f\n", r.kl_p99);
  std::printf("max KL:     %.6f\n", r.kl_max);
  std::printf("same top:   %.3f +/- %.3f %%\n", 100 * r.top1, 100 * r.top1_unc);
}
}  // namespace

void register_perplexity(CLI::App& app) {
  auto a = std::make_shared<PerplexityArgs>();
  CLI::App* sub = app.add_subcommand(
      "perplexity", "Perplexity of a text; KL divergence of the next-token distributions from a base run's");
  sub->add_option("-m,--model", a->model, kModelHelp);
  sub->add_option("-f,--file", a->text_file, "Text file to score (optional with --kl-divergence: the base's tokens)");
  sub->add_option("--chunks", a->chunks, "Chunks to score at most; 0 = every whole chunk of the text")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 30))
      ->capture_default_str();
  sub->add_option("--kl-divergence-base", a->kld_base,
                  "Base file of log-probabilities: written by a run without --kl-divergence, read with it");
  sub->add_flag("--kl-divergence", a->kld, "Compare with --kl-divergence-base: mean/median/99%/max KL, same top token");
  sub->add_flag("--json", a->json, "Print one JSON object of the results (no progress on stderr)");
  a->config.add_flags(*sub, EngineMode::Single);
  a->config.add_prefill_chunk_flag(*sub);
  // -c is the chunk length here (llama-perplexity's default 512), not a generation's context.
  a->config.model.max_model_len = 512;
  sub->get_option("-c")->default_str("512")->description("Tokens per chunk, BOS included (at least 4)");
  sub->callback([a] { run_perplexity(*a); });
}

}  // namespace kestrel::cli
