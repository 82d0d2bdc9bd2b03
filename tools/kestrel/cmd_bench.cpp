// kestrel bench: prefill and decode speed at batch 1, in the manner of llama-bench's pp/tg tests
// (pp: a prompt of P tokens in one forward pass; tg: N tokens decoded one at a time after it).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cmath>
#include <numeric>

#include "common.h"
#include "core/cpu_features.h"
#include "core/error.h"

namespace kestrel::cli {

namespace {
struct BenchArgs {
  std::string model;
  int64_t n_prompt = 128;
  int64_t n_gen = 128;
  int reps = 3;
  EngineFlags engine;
};

void run_bench(BenchArgs a) {
  if (a.n_prompt <= 0 || a.n_gen < 0 || a.reps <= 0)
    throw Error("bench: -p must be > 0, -n >= 0 and --reps > 0");
  LoadedModel lm = load_model(a.model);
  SessionOptions so = a.engine.session_options();
  so.prefill_chunk = a.n_prompt;  // one forward pass for the whole prompt, as llama-bench does
  so.n_ctx = a.n_prompt + a.n_gen + 1;  // what the test needs, whatever -c says
  if (so.n_ctx > lm.model->hparams().n_ctx_train)
    throw Error("bench: -p + -n = " + std::to_string(so.n_ctx - 1) + " tokens exceeds the model's context of " +
                std::to_string(lm.model->hparams().n_ctx_train));
  Session session(*lm.model, so);
  // A fixed pseudo-random prompt (the ids do not change the cost of a forward pass).
  std::vector<int32_t> prompt(static_cast<size_t>(a.n_prompt));
  uint64_t x = 0x9e3779b97f4a7c15ull;
  for (auto& id : prompt) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    id = static_cast<int32_t>(x % static_cast<uint64_t>(lm.model->hparams().n_vocab));
  }
  GenerateOptions go;
  go.sampling.temperature = 0;
  go.max_tokens = a.n_gen + 1;  // the first token comes from the prefill logits
  std::vector<double> pp, tg;
  // One warm-up run (page in the weights, grow buffers), then the timed repetitions.
  for (int r = 0; r <= a.reps; ++r) {
    session.reset();
    const GenerateStats st = session.generate(prompt, go, [](int32_t) { return true; });
    if (r == 0) continue;
    pp.push_back(st.prefill_tok_per_s());
    tg.push_back(st.decode_tok_per_s());
  }
  auto mean = [](const std::vector<double>& v) { return std::accumulate(v.begin(), v.end(), 0.0) / v.size(); };
  auto sd = [&](const std::vector<double>& v) {
    const double m = mean(v);
    double s = 0;
    for (double e : v) s += (e - m) * (e - m);
    return v.size() > 1 ? std::sqrt(s / (v.size() - 1)) : 0.0;
  };
  std::printf("| model | threads | simd | test | tok/s |\n|---|---|---|---|---|\n");
  const auto& hp = lm.model->hparams();
  const std::string name = hp.name.empty() ? hp.arch : hp.name;
  std::printf("| %s | %d | %s | pp%lld | %.1f ± %.1f |\n", name.c_str(), session.pool().size(),
              simd_level_name(simd_level()), static_cast<long long>(a.n_prompt), mean(pp), sd(pp));
  if (a.n_gen > 0)
    std::printf("| %s | %d | %s | tg%lld | %.1f ± %.1f |\n", name.c_str(), session.pool().size(),
                simd_level_name(simd_level()), static_cast<long long>(a.n_gen), mean(tg), sd(tg));
}
}  // namespace

void register_bench(CLI::App& app) {
  auto a = std::make_shared<BenchArgs>();
  CLI::App* sub = app.add_subcommand("bench", "Measure prefill and decode speed (batch 1)");
  sub->add_option("-m,--model", a->model, "GGUF model file (default: the SmolLM2 model from setup)");
  sub->add_option("-p,--n-prompt", a->n_prompt, "Prompt tokens (pp test)")->capture_default_str();
  sub->add_option("-n,--n-gen", a->n_gen, "Generated tokens (tg test)")->capture_default_str();
  sub->add_option("-r,--reps", a->reps, "Timed repetitions")->capture_default_str();
  a->engine.add_to(*sub);
  sub->callback([a] { run_bench(*a); });
}

}  // namespace kestrel::cli
