// kestrel bench: prefill and decode speed at batch 1, in the manner of llama-bench's pp/tg tests
// (pp: a prompt of P tokens in one forward pass; tg: N tokens decoded one at a time; with -d D both
// run after a D-token context that is computed before the timing starts, as llama-bench's -d),
// and with --parallel, aggregate speed of many concurrent sequences through the serving engine,
// in the manner of llama-batched-bench (S_TG: all sequences' decode tokens over the decode time).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cmath>
#include <fstream>
#include <numeric>
#include <thread>
#include <unordered_set>

#include "chat_prompt.h"
#include "common.h"
#include "engine/engine.h"
#include "core/cpu_features.h"
#include "core/error.h"

namespace kestrel::cli {

namespace {
struct BenchArgs {
  std::string model;
  std::vector<int64_t> n_prompts = {128};  // -p: one pp test each
  std::vector<int64_t> n_gens = {128};     // -n: one tg test each (0: none)
  std::vector<int64_t> depths = {0};       // -d: context tokens before each test
  int64_t n_prompt = 128;                  // the first -p (the --parallel, --shared-prefix and --prompts modes)
  int64_t n_gen = 128;                     // the first -n (likewise)
  bool json = false;
  int reps = 3;
  std::vector<int> parallel;  // concurrent sequences per run (engine mode)
  int64_t max_batched_tokens = 2048;
  int64_t shared_prefix = 0;  // prefix-cache test: tokens shared by consecutive requests
  std::string prompts_file;   // real prompts (JSON lines): batch-1 decode with and without speculation
  std::string output_ids_file;  // --prompts: where the speculation-off run's prompt and output ids go
  KestrelConfig config;
};

// Threads the CPU backend runs with (0 on the command line = every hardware thread).
int bench_threads(const BenchArgs& a) {
  return a.config.device.threads > 0 ? a.config.device.threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

std::vector<int32_t> random_prompt(int64_t n, int64_t n_vocab, uint64_t seed) {
  std::vector<int32_t> prompt(static_cast<size_t>(n));
  uint64_t x = 0x9e3779b97f4a7c15ull ^ (seed * 0xbf58476d1ce4e5b9ull);
  for (auto& id : prompt) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    id = static_cast<int32_t>(x % static_cast<uint64_t>(n_vocab));
  }
  return prompt;
}

// N sequences submitted at once (distinct prompts, no prefix-cache hits, EOS ignored), run to the
// end. pp: prompt tokens over the time until every sequence has its first token; tg: the tokens
// generated after that moment over the time after it, when every running sequence is decoding.
// Time to first token of a request whose first `shared_prefix` tokens an earlier request already
// computed, with the prefix cache on (those blocks are reused) and off (everything recomputed).
void run_shared_prefix(const BenchArgs& a, const LoadedModel& lm) {
  const auto& hp = lm.model->hparams();
  const int64_t n_suffix = a.n_prompt;
  // With a host tier (--cpu-offload-kv-gb), the prefix is also measured evicted from the device
  // pool: recomputed without the tier, copied back from host memory with it.
  const bool tiers = a.config.cache.cpu_offload_kv_gib > 0;
  std::printf("| threads | shared prefix | new tokens | prefix cache | TTFT ms | prefill tokens run | hit tokens | "
              "host tier blocks in | H2D GB/s |\n"
              "|---|---|---|---|---|---|---|---|---|\n");
  const std::vector<int32_t> prefix = random_prompt(a.shared_prefix, hp.n_vocab, 7);
  struct Mode {
    const char* name;
    bool caching, evict, offload;
  };
  const std::vector<Mode> modes =
      tiers ? std::vector<Mode>{{"on, on the device", true, false, false},
                                {"on, evicted: recomputed", true, true, false},
                                {"on, evicted: host tier", true, true, true}}
            : std::vector<Mode>{{"off", false, false, false}, {"on", true, false, false}};
  for (const Mode& mode : modes) {
    KestrelConfig c = a.config;
    c.scheduler.max_num_seqs = 2;  // a pool of two sequences: the cached request's blocks beside the running one's
    c.scheduler.max_num_batched_tokens = std::max<int64_t>(a.max_batched_tokens, a.shared_prefix + n_suffix);
    c.model.max_model_len = std::min<int64_t>(hp.n_ctx_train, a.shared_prefix + n_suffix + 2);
    c.cache.enable_prefix_caching = mode.caching;
    if (!mode.offload) c.cache.cpu_offload_kv_gib = 0;
    const std::unique_ptr<Engine> engine = make_engine(lm, c);
    Engine& e = *engine;
    auto run = [&](std::vector<int32_t> prompt) {
      Request req;
      req.prompt = std::move(prompt);
      req.max_tokens = 1;
      req.sampling.temperature = 0;
      e.add_request(std::move(req));
      RequestMetrics m;
      while (e.has_unfinished())
        for (const RequestOutput& o : e.step())
          if (o.finished) m = o.metrics;
      return m;
    };
    std::vector<double> ttft;
    int64_t run_tokens = 0, hits = 0, blocks_in = 0, h2d_bytes = 0;
    double h2d_s = 0;
    for (int r = 0; r <= a.reps + 1; ++r) {  // r == 0 fills the cache, r == 1 warms up
      // Three requests as long as the measured one, of other tokens, evict the prefix from a pool
      // of two such sequences (least recently released first).
      if (mode.evict && r > 0)
        for (uint64_t k = 0; k < 3; ++k)
          run(random_prompt(a.shared_prefix + n_suffix, hp.n_vocab, 1000 + 10 * static_cast<uint64_t>(r) + k));
      std::vector<int32_t> prompt = prefix;
      const auto suffix = random_prompt(n_suffix, hp.n_vocab, static_cast<uint64_t>(100 + r));
      prompt.insert(prompt.end(), suffix.begin(), suffix.end());
      const EngineStats before = e.stats();
      const RequestMetrics m = run(std::move(prompt));
      if (r < 2) continue;
      const EngineStats& after = e.stats();
      ttft.push_back(1e3 * m.ttft_s);
      run_tokens = after.n_prompt_tokens_computed - before.n_prompt_tokens_computed;
      hits = m.n_cached_prompt_tokens;
      blocks_in = after.n_offload_hit_blocks - before.n_offload_hit_blocks;
      h2d_bytes += after.host_to_device_bytes - before.host_to_device_bytes;
      h2d_s += after.host_to_device_seconds - before.host_to_device_seconds;
    }
    const int threads = bench_threads(a);
    std::sort(ttft.begin(), ttft.end());
    char rate[32] = "-";
    if (h2d_s > 0) std::snprintf(rate, sizeof rate, "%.1f", static_cast<double>(h2d_bytes) / h2d_s / 1e9);
    std::printf("| %d | %lld | %lld | %s | %.1f (median of %zu) | %lld | %lld | %lld | %s |\n", threads,
                static_cast<long long>(a.shared_prefix), static_cast<long long>(n_suffix), mode.name,
                ttft[ttft.size() / 2], ttft.size(), static_cast<long long>(run_tokens), static_cast<long long>(hits),
                static_cast<long long>(blocks_in), rate);
    std::fflush(stdout);
  }
}

void run_parallel(const BenchArgs& a, const LoadedModel& lm) {
  const auto& hp = lm.model->hparams();
  std::printf("| threads | seqs | pp tok/s | tg tok/s (aggregate) | TTFT ms | TPOT ms | steps |\n"
              "|---|---|---|---|---|---|---|\n");
  int threads = 0;
  for (int n : a.parallel) {
    if (n <= 0) throw Error("bench: --parallel values must be positive, got " + std::to_string(n));
    KestrelConfig c = a.config;  // a pool of n sequences of -p + -n tokens
    c.scheduler.max_num_seqs = n;
    c.scheduler.max_num_batched_tokens = std::max<int64_t>(a.max_batched_tokens, n);
    c.model.max_model_len = std::min<int64_t>(hp.n_ctx_train, a.n_prompt + a.n_gen + 1);
    c.cache.enable_prefix_caching = false;
    const std::unique_ptr<Engine> engine = make_engine(lm, c);
    Engine& e = *engine;
    std::vector<double> pp, tg, ttft, tpot;
    int64_t steps = 0;
    for (int r = 0; r <= a.reps; ++r) {  // r == 0 warms up
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < n; ++i) {
        Request req;
        req.prompt = random_prompt(a.n_prompt, hp.n_vocab, static_cast<uint64_t>(r * 1000 + i + 1));
        req.max_tokens = a.n_gen;
        req.sampling.temperature = 0;
        e.add_request(std::move(req));
      }
      const int64_t steps0 = e.stats().n_steps, gen0 = e.stats().n_generated_tokens;
      std::unordered_set<RequestId> started;
      int64_t gen_at_start = 0;
      std::chrono::steady_clock::time_point t_all_started = t0;
      double sum_ttft = 0, sum_tpot = 0;
      while (e.has_unfinished()) {
        for (const RequestOutput& o : e.step()) {
          if (!o.new_token_ids.empty()) started.insert(o.id);
          if (o.finished) {
            sum_ttft += o.metrics.ttft_s;
            sum_tpot += o.metrics.tpot_s;
          }
        }
        if (gen_at_start == 0 && static_cast<int>(started.size()) == n) {
          t_all_started = std::chrono::steady_clock::now();
          gen_at_start = e.stats().n_generated_tokens - gen0;
        }
      }
      const auto t_end = std::chrono::steady_clock::now();
      if (r == 0) continue;
      const double t_pp = std::chrono::duration<double>(t_all_started - t0).count();
      const double t_tg = std::chrono::duration<double>(t_end - t_all_started).count();
      const int64_t n_gen_total = e.stats().n_generated_tokens - gen0;
      pp.push_back(static_cast<double>(n * a.n_prompt) / t_pp);
      tg.push_back(t_tg > 0 ? static_cast<double>(n_gen_total - gen_at_start) / t_tg : 0.0);
      ttft.push_back(1e3 * sum_ttft / n);
      tpot.push_back(1e3 * sum_tpot / n);
      steps = e.stats().n_steps - steps0;
    }
    threads = bench_threads(a);
    auto mean = [](const std::vector<double>& v) { return std::accumulate(v.begin(), v.end(), 0.0) / v.size(); };
    std::printf("| %d | %d | %.1f | %.1f | %.1f | %.2f | %lld |\n", threads, n, mean(pp), mean(tg), mean(ttft),
                mean(tpot), static_cast<long long>(steps));
    std::fflush(stdout);
  }
}

// The prompts of a JSON-lines file, as token ids: {"messages": [...]} rendered with the model's
// chat template, or {"prompt": "text"} as is.
std::vector<std::vector<int32_t>> read_prompts(const std::string& path, const LoadedModel& lm) {
  const Tokenizer& tok = require_tokenizer(lm, "bench --prompts");
  const PromptFormat format = PromptFormat::for_model(*lm.model, tok);
  std::ifstream in(path);
  if (!in) throw Error("bench: cannot read --prompts file " + path);
  std::vector<std::vector<int32_t>> out;
  std::string line;
  for (int64_t n = 1; std::getline(in, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    Json j;
    try {
      j = Json::parse(line);
    } catch (const Json::parse_error& e) {
      throw Error("bench: " + path + " line " + std::to_string(n) + " is not JSON: " + e.what());
    }
    std::string text;
    if (j.is_object() && j.contains("messages")) text = render_chat(format, j["messages"], /*add_generation_prompt=*/true);
    else if (j.is_object() && j.contains("prompt") && j["prompt"].is_string()) text = j["prompt"].get<std::string>();
    else throw Error("bench: " + path + " line " + std::to_string(n) + " has neither \"messages\" nor \"prompt\"");
    out.push_back(tok.encode(text, /*add_special=*/!format.starts_with_bos(text), /*parse_special=*/true));
  }
  if (out.empty()) throw Error("bench: --prompts file " + path + " holds no prompt");
  return out;
}

// One JSON line per prompt, {"prompt_ids": [...], "output_ids": [...]}: the greedy outputs, for
// replaying draft policies offline (bench/spec_replay.py). Errors: kestrel::Error when the file
// cannot be written.
void write_output_ids(const std::string& path, const std::vector<std::vector<int32_t>>& prompts,
                      const std::vector<std::vector<int32_t>>& outputs) {
  std::ofstream out(path);
  if (!out) throw Error("bench: cannot write --output-ids file " + path);
  for (size_t i = 0; i < prompts.size() && i < outputs.size(); ++i) {
    Json line;
    line["prompt_ids"] = prompts[i];
    line["output_ids"] = outputs[i];
    out << line.dump() << '\n';
  }
  if (!out) throw Error("bench: cannot write --output-ids file " + path);
}

// Batch-1 greedy decode of real prompts (up to -n tokens each, to EOS), speculation off and then
// as --speculative-config asks, in one run: decode tokens over decode time (from each request's
// first token to its last), the speed-up, the drafts' acceptance, and whether the outputs match.
void run_prompts(const BenchArgs& a, const LoadedModel& lm) {
  const auto prompts = read_prompts(a.prompts_file, lm);
  const Tokenizer& tok = *lm.tokenizer;
  int64_t longest = 0;
  for (const auto& p : prompts) longest = std::max<int64_t>(longest, static_cast<int64_t>(p.size()));
  std::vector<std::string> specs = {""};
  if (!a.config.speculative.config.empty()) specs.push_back(a.config.speculative.config);
  std::printf("| threads | speculative config | prompts | output tokens | decode tok/s | speed-up | acceptance | "
              "mean accepted length | acceptance by position | steps | host ms a step | outputs as off |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  std::vector<std::vector<int32_t>> reference;
  double base_tok_s = 0;
  for (const std::string& spec : specs) {
    KestrelConfig c = a.config;
    c.speculative.config = spec;
    c.model.max_model_len = std::min<int64_t>(lm.model->hparams().n_ctx_train, longest + a.n_gen + 1);
    c.scheduler.max_num_batched_tokens = std::max<int64_t>(a.max_batched_tokens, longest);
    c.cache.enable_prefix_caching = false;
    const std::unique_ptr<Engine> engine = make_engine(lm, c);
    const auto request = [&](const std::vector<int32_t>& p) {
      Request r;
      r.prompt = p;
      r.max_tokens = a.n_gen;
      r.sampling.temperature = 0;
      r.stop_ids = stop_ids(tok);
      return r;
    };
    // Warm-up: every prompt once, untimed. A GPU step replays the CUDA graph of its shape (tokens a
    // sequence, block-table width), captured the first time that shape comes up; with drafts of
    // varying length a cold run meets a dozen or more such captures, which a running server has
    // behind it and which would otherwise be timed.
    for (const auto& p : prompts) run_single(*engine, request(p), nullptr);
    const EngineStats s0 = engine->stats();
    double decode_s = 0;
    int64_t decode_tokens = 0, output_tokens = 0;
    std::vector<std::vector<int32_t>> outputs;
    for (int r = 0; r < a.reps; ++r)
      for (const auto& p : prompts) {
        const SingleResult res = run_single(*engine, request(p), nullptr);
        decode_s += res.metrics.e2e_s - res.metrics.ttft_s;
        decode_tokens += std::max<int64_t>(0, res.metrics.n_output_tokens - 1);
        output_tokens += res.metrics.n_output_tokens;
        if (r == 0) outputs.push_back(res.output_ids);
      }
    const EngineStats& s1 = engine->stats();
    const double tok_s = decode_s > 0 ? static_cast<double>(decode_tokens) / decode_s : 0.0;
    if (spec.empty()) {
      base_tok_s = tok_s;
      reference = outputs;
      if (!a.output_ids_file.empty()) write_output_ids(a.output_ids_file, prompts, outputs);
    }
    const int64_t drafts = s1.spec_num_drafts - s0.spec_num_drafts;
    const int64_t draft_tokens = s1.spec_num_draft_tokens - s0.spec_num_draft_tokens;
    const int64_t accepted = s1.spec_num_accepted_tokens - s0.spec_num_accepted_tokens;
    std::string by_pos = "-";
    if (drafts > 0) {
      by_pos.clear();
      for (size_t i = 0; i < s1.spec_accepted_per_pos.size(); ++i) {
        char b[16];
        std::snprintf(b, sizeof b, "%s%.2f", i ? " " : "",
                      static_cast<double>(s1.spec_accepted_per_pos[i] - s0.spec_accepted_per_pos[i]) / static_cast<double>(drafts));
        by_pos += b;
      }
    }
    // The host's share of a step: from one pass's results to the next launch (EngineStats::host_seconds).
    const int64_t gaps = s1.n_host_gaps - s0.n_host_gaps;
    const double host_ms = gaps > 0 ? 1e3 * (s1.host_seconds - s0.host_seconds) / static_cast<double>(gaps) : 0.0;
    std::printf("| %d | %s | %zu x %d | %lld | %.1f | %.2fx | %.1f%% | %.2f | %s | %lld | %.3f | %s |\n", bench_threads(a),
                spec.empty() ? "off" : spec.c_str(), prompts.size(), a.reps, static_cast<long long>(output_tokens), tok_s,
                base_tok_s > 0 ? tok_s / base_tok_s : 0.0,
                draft_tokens > 0 ? 100.0 * static_cast<double>(accepted) / static_cast<double>(draft_tokens) : 0.0,
                drafts > 0 ? 1.0 + static_cast<double>(accepted) / static_cast<double>(drafts) : 0.0, by_pos.c_str(),
                static_cast<long long>(s1.n_steps - s0.n_steps), host_ms, outputs == reference ? "identical" : "DIFFERENT");
    std::fflush(stdout);
  }
}

// One pp or tg test's figures (tokens per second of each timed repetition).
struct DepthResult {
  std::string test;  // llama-bench's name: pp512, tg128, pp512 @ d2048
  int64_t n_prompt = 0, n_gen = 0, n_depth = 0;
  std::vector<double> samples;
};

// pp and tg tests at each depth, one request at a time through the engine: a pp test's P tokens
// in one forward pass, a tg test's N tokens one decode step each, EOS ignored. At depth D > 0 the
// D context tokens are computed once and reused through the prefix cache (their whole blocks; a
// partial last block is recomputed and counted), so a test times only its own tokens, with the
// prompt after the context drawn anew for every repetition (nothing else is reused).
std::vector<DepthResult> run_depths(const BenchArgs& a, const LoadedModel& lm, std::string& kv) {
  const auto& hp = lm.model->hparams();
  const int64_t p_max = *std::max_element(a.n_prompts.begin(), a.n_prompts.end());
  const int64_t n_max = *std::max_element(a.n_gens.begin(), a.n_gens.end());
  std::vector<DepthResult> out;
  for (const int64_t d : a.depths) {
    KestrelConfig c = a.config;
    const int64_t n_ctx = d + std::max(p_max, n_max + 1) + 1;  // what the tests need, whatever -c says
    if (n_ctx > hp.n_ctx_train)
      throw Error("bench: -d " + std::to_string(d) + " with -p " + std::to_string(p_max) + " / -n " +
                  std::to_string(n_max) + " needs " + std::to_string(n_ctx) + " tokens of context, beyond the model's " +
                  std::to_string(hp.n_ctx_train));
    const int64_t bs = c.cache.block_size;
    c.model.max_model_len = n_ctx;
    // A test's tokens plus the context's partial last block run in one pass (the untimed context
    // itself in passes of up to 2048).
    c.scheduler.max_num_batched_tokens = d > 0 ? std::max<int64_t>(p_max + bs, 2048) : std::max<int64_t>(p_max, 1);
    c.cache.enable_prefix_caching = d > 0;
    // Room for the cached context beside a whole request, so the context is never evicted.
    if (d > 0 && c.cache.num_kv_blocks == 0)
      c.cache.num_kv_blocks = static_cast<int32_t>(2 * ((n_ctx + bs - 1) / bs) + 2);
    std::unique_ptr<Engine> engine = make_engine(lm, c);
    kv = kv_dtype_name(engine->runner().kv_dtype());
    const std::vector<int32_t> context = random_prompt(d, hp.n_vocab, 0x5eed);
    // Context tokens the prefix cache gives back: its whole blocks, less the block of a prompt's
    // last token (always computed, for its logits).
    const auto reused = [&](int64_t n_prompt) { return std::min(d, n_prompt - 1) / bs * bs; };
    const auto run = [&](const std::vector<int32_t>& prompt, int64_t max_tokens, bool timed) {
      Request req;
      req.prompt = prompt;
      req.sampling.temperature = 0;
      req.max_tokens = max_tokens;
      const SingleResult res = run_single(*engine, req, nullptr);
      if (timed && d > 0 && res.metrics.n_cached_prompt_tokens < reused(static_cast<int64_t>(prompt.size())))
        throw Error("bench: only " + std::to_string(res.metrics.n_cached_prompt_tokens) + " of the " +
                    std::to_string(d) + " context tokens came from the prefix cache");
      return res;
    };
    if (d > 0) {  // computes the context once (and warms up); one token more, so its last block is full and cached
      std::vector<int32_t> warm = context;
      warm.push_back(0);
      run(warm, 1, false);
    }
    const std::string at = d > 0 ? " @ d" + std::to_string(d) : "";
    uint64_t seed = 1;
    for (const int64_t p : a.n_prompts) {
      if (p == 0) continue;
      DepthResult r{"pp" + std::to_string(p) + at, p, 0, d, {}};
      for (int rep = 0; rep <= a.reps; ++rep) {  // rep 0 warms up (pages in the weights, grows buffers)
        std::vector<int32_t> prompt = context;
        const std::vector<int32_t> own = random_prompt(p, hp.n_vocab, seed++);
        prompt.insert(prompt.end(), own.begin(), own.end());
        const SingleResult res = run(prompt, 1, true);
        if (rep > 0) r.samples.push_back(res.prefill_tok_per_s());
      }
      out.push_back(std::move(r));
    }
    for (const int64_t n : a.n_gens) {
      if (n == 0) continue;
      DepthResult r{"tg" + std::to_string(n) + at, 0, n, d, {}};
      // The first token comes from the prompt's logits; the N decode steps after it are timed.
      // At depth 0 the prompt is one token (llama-bench decodes from an empty context).
      const std::vector<int32_t> prompt = d > 0 ? context : random_prompt(1, hp.n_vocab, seed++);
      for (int rep = 0; rep <= a.reps; ++rep) {
        const SingleResult res = run(prompt, n + 1, true);
        if (rep > 0) r.samples.push_back(res.decode_tok_per_s());
      }
      out.push_back(std::move(r));
    }
  }
  return out;
}

void run_bench(BenchArgs a) {
  const auto positive = [](const std::vector<int64_t>& v, int64_t min) {
    return !v.empty() && std::all_of(v.begin(), v.end(), [&](int64_t x) { return x >= min; });
  };
  if (!positive(a.n_prompts, 0) || !positive(a.n_gens, 0) || !positive(a.depths, 0) || a.reps <= 0)
    throw Error("bench: -p, -n and -d values must be >= 0 and --reps > 0");
  a.n_prompt = a.n_prompts.front();
  a.n_gen = a.n_gens.front();
  const bool one_shape = a.n_prompts.size() == 1 && a.n_gens.size() == 1 && a.depths.size() == 1 && a.depths[0] == 0;
  if ((!one_shape || a.n_prompt == 0) && (!a.prompts_file.empty() || a.shared_prefix > 0 || !a.parallel.empty()))
    throw Error("bench: --prompts, --shared-prefix and --parallel take one -p value > 0, one -n value and no -d");
  if (!a.output_ids_file.empty() && a.prompts_file.empty()) throw Error("bench: --output-ids needs --prompts");
  const auto all_zero = [](const std::vector<int64_t>& v) {
    return std::all_of(v.begin(), v.end(), [](int64_t x) { return x == 0; });
  };
  if (a.prompts_file.empty() && all_zero(a.n_prompts) && all_zero(a.n_gens))
    throw Error("bench: nothing to measure: every -p and -n value is 0");
  LoadedModel lm = load_model(a.model, a.config);
  if (!a.prompts_file.empty()) {
    run_prompts(a, lm);
    return;
  }
  if (a.shared_prefix > 0) {
    run_shared_prefix(a, lm);
    return;
  }
  if (!a.parallel.empty()) {
    run_parallel(a, lm);
    return;
  }
  std::string kv;
  const std::vector<DepthResult> results = run_depths(a, lm, kv);
  auto mean = [](const std::vector<double>& v) { return std::accumulate(v.begin(), v.end(), 0.0) / v.size(); };
  auto sd = [&](const std::vector<double>& v) {
    const double m = mean(v);
    double s = 0;
    for (double e : v) s += (e - m) * (e - m);
    return v.size() > 1 ? std::sqrt(s / (v.size() - 1)) : 0.0;
  };
  const auto& hp = lm.model->hparams();
  const std::string name = hp.name.empty() ? hp.arch : hp.name;
  if (a.json) {  // llama-bench's -o json field names where they exist
    Json arr = Json::array();
    for (const DepthResult& r : results)
      arr.push_back({{"model", name}, {"n_threads", bench_threads(a)}, {"simd", simd_level_name(simd_level())},
                     {"kv_type", kv}, {"test", r.test}, {"n_prompt", r.n_prompt}, {"n_gen", r.n_gen},
                     {"n_depth", r.n_depth}, {"avg_ts", mean(r.samples)}, {"stddev_ts", sd(r.samples)},
                     {"samples_ts", r.samples}});
    std::printf("%s\n", arr.dump(2).c_str());
    return;
  }
  // The KV cache's element type is a column: at long contexts decode reads mostly KV.
  std::printf("| model | threads | simd | kv | test | tok/s |\n|---|---|---|---|---|---|\n");
  for (const DepthResult& r : results)
    std::printf("| %s | %d | %s | %s | %s | %.1f ± %.1f |\n", name.c_str(), bench_threads(a),
                simd_level_name(simd_level()), kv.c_str(), r.test.c_str(), mean(r.samples), sd(r.samples));
}
}  // namespace

void register_bench(CLI::App& app) {
  auto a = std::make_shared<BenchArgs>();
  CLI::App* sub = app.add_subcommand("bench", "Measure prefill and decode speed (batch 1)");
  sub->add_option("-m,--model", a->model, kModelHelp);
  sub->add_option("-p,--n-prompt", a->n_prompts, "Prompt tokens, one pp test per value (e.g. 128,2048; 0: none)")
      ->delimiter(',')
      ->capture_default_str();
  sub->add_option("-n,--n-gen", a->n_gens, "Generated tokens, one tg test per value (0: none)")
      ->delimiter(',')
      ->capture_default_str();
  sub->add_option("-d,--n-depth", a->depths,
                  "Context tokens computed before each pp and tg test, untimed (llama-bench's -d), e.g. 0,512,2048")
      ->delimiter(',')
      ->capture_default_str();
  sub->add_flag("--json", a->json, "Print the pp/tg results as a JSON array (with n_depth) instead of a table");
  sub->add_option("-r,--reps", a->reps, "Timed repetitions")->capture_default_str();
  sub->add_option("--parallel", a->parallel,
                  "Concurrent sequences, e.g. 1,4,16,64: aggregate speed through the serving engine")
      ->delimiter(',');
  sub->add_option("--shared-prefix", a->shared_prefix,
                  "Prefix-cache test: TTFT of a request sharing this many tokens with an earlier one "
                  "(cache on and off); -p is then the request's own new tokens");
  sub->add_option("--cpu-offload-kv-gb", a->config.cache.cpu_offload_kv_gib,
                  "With --shared-prefix: GiB of host memory for the prefix cache's host tier; the prefix is then "
                  "also measured evicted from the device, recomputed and copied back from the host tier (with "
                  "the copies' host -> device GB/s)")
      ->check(CLI::Range(0.0, 1048576.0));
  sub->add_option("--prompts", a->prompts_file,
                  "Real prompts, JSON lines of {\"messages\": [...]} or {\"prompt\": \"...\"}: batch-1 greedy decode of "
                  "each (-n tokens at most), speculation off and then as --speculative-config says, with the "
                  "speed-up, acceptance and whether the outputs match");
  sub->add_option("--output-ids", a->output_ids_file,
                  "With --prompts: write each prompt's token ids and its greedy output ids (speculation off) to "
                  "this file, JSON lines, for bench/spec_replay.py");
  sub->add_option("--max-num-batched-tokens", a->max_batched_tokens,
                  "Tokens per engine step (with --parallel)")->capture_default_str();
  a->config.add_flags(*sub, EngineMode::Single);
  sub->callback([a] { run_bench(*a); });
}

}  // namespace kestrel::cli
