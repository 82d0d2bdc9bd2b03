// Token-mask time of the grammar engine (src/sampling/grammar) on JSON schemas: per-token
// fill_next_token_bitmask and accept_token time (p50 / p99 / max; the engine fills the masks while
// the GPU runs a step's layers and accepts the sampled tokens after it) and schema compile time, per
// vocabulary.
//
// Each schema drives random walks: at each step the mask is filled (timed), then a token is drawn
// from it (half the time among all allowed tokens, half among those of at most two bytes, so the
// walk reaches structure as well as string contents), until the grammar can end or 256 tokens.
// The walks on a freshly compiled grammar are "cold" (they include the first-use computation of
// each token split, matcher.h); the same walks again on that grammar are "warm": the steady state
// of a schema the server has seen (GrammarCache) on paths it has taken before.
//
//   kestrel_grammar_bench --schemas bench/data/schemas --gguf models/SmolLM2-135M-Instruct.Q4_1.gguf
//                         --bpe ../shared/data/llama3-bpe-vocab [--walks 4] [--chain-cap 32]
//                         [--precompute STACKS]
//
// --replay FILE (with --gguf): the outputs of a `kestrel batch` run instead of random walks (JSON
// lines with "id" and "output_ids"; request id i used schema i % n_schemas in name order, as
// scripts/device/gpu_grammar.sh writes them): each output's tokens are fed in file order through
// one grammar per schema, compiled once, timing every mask on the way (the first outputs of a
// schema meet its cold splits).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/gguf.h"
#include "sampling/grammar/json_schema.h"
#include "sampling/grammar/matcher.h"
#include "tokenizer/tokenizer.h"

using namespace kestrel;
using Clock = std::chrono::steady_clock;

namespace {

double us_since(Clock::time_point t) { return std::chrono::duration<double, std::micro>(Clock::now() - t).count(); }

double pct(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p / 100.0 * static_cast<double>(v.size())))];
}

// A schema file (keys in the order written, as the server and batch pass a schema on), compiled to
// a grammar bound to the vocabulary: schema -> GBNF -> grammar.
nlohmann::ordered_json read_schema(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return nlohmann::ordered_json::parse(ss.str());
}
// --chain-cap: CompiledGrammar's chain cap (0: every link of a bounded repetition its own split).
uint32_t g_chain_cap = grammar::CompiledGrammar::kChainCap;
// --precompute N: CompiledGrammar::precompute_splits(N) on each grammar after its compile (0: off).
size_t g_precompute = 0;
std::vector<double> g_precompute_ms;

std::shared_ptr<grammar::CompiledGrammar> compile_schema(const nlohmann::ordered_json& schema,
                                                         const std::shared_ptr<const grammar::TokenVocab>& vocab) {
  auto g = std::make_shared<grammar::CompiledGrammar>(grammar::Grammar::parse_gbnf(grammar::json_schema_to_gbnf(schema)),
                                                      vocab, g_chain_cap);
  if (g_precompute > 0) {
    const auto t = Clock::now();
    g->precompute_splits(g_precompute);
    g_precompute_ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t).count());
  }
  return g;
}

void bench_vocab(const std::string& label, const Tokenizer& tok, const std::vector<std::filesystem::path>& schemas, int walks) {
  auto t0 = Clock::now();
  auto vocab = grammar::TokenVocab::from_tokenizer(tok);
  const double vocab_ms = us_since(t0) / 1000.0;
  std::vector<double> compile_us, cold, warm, accept;
  for (const auto& path : schemas) {
    const auto schema = read_schema(path);
    // Compile (schema -> GBNF -> grammar, bound to the vocabulary): the median of 9 runs.
    std::vector<double> c;
    std::shared_ptr<grammar::CompiledGrammar> cg;
    for (int i = 0; i < 9; ++i) {
      auto t = Clock::now();
      cg = compile_schema(schema, vocab);
      c.push_back(us_since(t));
    }
    compile_us.push_back(pct(c, 50));
    std::vector<uint32_t> mask(grammar::bitmask_words(vocab->n_vocab));
    std::vector<int32_t> allowed, short_allowed;
    for (int w = 0; w < 2 * walks; ++w) {
      const bool first_pass = w < walks;
      std::mt19937_64 rng(1234 + static_cast<uint64_t>(w % walks));
      grammar::GrammarMatcher m(cg);
      for (int step = 0; step < 256 && !m.is_terminated(); ++step) {
        auto t = Clock::now();
        m.fill_next_token_bitmask(mask);
        (first_pass ? cold : warm).push_back(us_since(t));
        if (m.can_end()) break;
        allowed.clear();
        short_allowed.clear();
        for (int32_t id = 0; id < vocab->n_vocab; ++id)
          if ((mask[static_cast<size_t>(id) / 32] >> (id % 32)) & 1u) {
            allowed.push_back(id);
            if (vocab->bytes[static_cast<size_t>(id)].size() <= 2) short_allowed.push_back(id);
          }
        if (allowed.empty()) {
          std::fprintf(stderr, "%s: %s: empty mask at step %d\n", label.c_str(), path.filename().c_str(), step);
          break;
        }
        const auto& pool = (rng() % 2 == 0 && !short_allowed.empty()) ? short_allowed : allowed;
        const int32_t id = pool[rng() % pool.size()];
        t = Clock::now();
        const bool ok = m.accept_token(id);
        if (!first_pass) accept.push_back(us_since(t));
        if (!ok) {
          std::fprintf(stderr, "%s: %s: masked token %d not accepted\n", label.c_str(), path.filename().c_str(), id);
          break;
        }
      }
    }
  }
  std::printf("%s (%d tokens; vocabulary index %.1f ms)\n", label.c_str(), vocab->n_vocab, vocab_ms);
  std::printf("  compile per schema: p50 %.0f us, max %.0f us\n", pct(compile_us, 50), pct(compile_us, 100));
  std::printf("  mask, cold grammar: %zu tokens, p50 %.1f us, p99 %.1f us, max %.1f us\n", cold.size(), pct(cold, 50),
              pct(cold, 99), pct(cold, 100));
  std::printf("  mask, warm grammar: %zu tokens, p50 %.1f us, p99 %.1f us, max %.1f us\n", warm.size(), pct(warm, 50),
              pct(warm, 99), pct(warm, 100));
  std::printf("  accept, warm grammar: %zu tokens, p50 %.1f us, p99 %.1f us, max %.1f us\n", accept.size(),
              pct(accept, 50), pct(accept, 99), pct(accept, 100));
}

void replay(const std::string& file, const Tokenizer& tok, const std::vector<std::filesystem::path>& schemas,
            bool verbose) {
  auto vocab = grammar::TokenVocab::from_tokenizer(tok);
  std::vector<std::shared_ptr<grammar::CompiledGrammar>> grammars(schemas.size());
  std::vector<int> uses(schemas.size(), 0);
  std::vector<double> first, later, accept;
  std::vector<uint32_t> mask(grammar::bitmask_words(vocab->n_vocab));
  std::ifstream in(file);
  if (!in) throw Error("cannot read " + file);
  std::string line;
  size_t outputs = 0;
  double worst_output_ms = 0, cold_us = 0;
  size_t cold_splits = 0;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    const auto j = nlohmann::json::parse(line);
    if (!j.contains("output_ids")) continue;
    const size_t k = j.at("id").get<size_t>() % schemas.size();
    if (!grammars[k]) grammars[k] = compile_schema(read_schema(schemas[k]), vocab);
    auto& times = uses[k]++ == 0 ? first : later;
    grammar::GrammarMatcher m(grammars[k]);
    double output_us = 0;
    for (const int32_t id : j.at("output_ids").get<std::vector<int32_t>>()) {
      const size_t splits = grammars[k]->n_splits();
      auto t = Clock::now();
      m.fill_next_token_bitmask(mask);
      const double us = us_since(t);
      times.push_back(us);
      if (grammars[k]->n_splits() > splits) {
        cold_us += us;
        cold_splits += grammars[k]->n_splits() - splits;
      }
      output_us += us;
      if (!((mask[static_cast<size_t>(id) / 32] >> (id % 32)) & 1u)) {
        std::fprintf(stderr, "%s: output %s: token %d outside the mask\n", file.c_str(), j.at("id").dump().c_str(), id);
        break;
      }
      t = Clock::now();
      m.accept_token(id);
      accept.push_back(us_since(t));
    }
    worst_output_ms = std::max(worst_output_ms, output_us / 1000.0);
    if (verbose)
      std::printf("  output %s (%s): %zu tokens, masks %.2f ms\n", j.at("id").dump().c_str(),
                  schemas[k].filename().c_str(), j.at("output_ids").size(), output_us / 1000.0);
    ++outputs;
  }
  double sum = 0;
  for (double v : later) sum += v;
  std::printf("replay of %zu outputs from %s\n", outputs, file.c_str());
  std::printf("  mask, a schema's first output: %zu tokens, p50 %.1f us, p99 %.1f us, max %.1f us\n", first.size(),
              pct(first, 50), pct(first, 99), pct(first, 100));
  std::printf("  mask, later outputs: %zu tokens, p50 %.1f us, p99 %.1f us, max %.1f us, mean %.1f us\n", later.size(),
              pct(later, 50), pct(later, 99), pct(later, 100), later.empty() ? 0.0 : sum / static_cast<double>(later.size()));
  std::printf("  %zu splits computed, in masks that took %.1f ms in all\n", cold_splits, cold_us / 1000.0);
  std::printf("  accept: p50 %.1f us, p99 %.1f us, max %.1f us; slowest output's masks %.1f ms\n", pct(accept, 50),
              pct(accept, 99), pct(accept, 100), worst_output_ms);
}

}  // namespace

int main(int argc, char** argv) {
  std::string schema_dir = "bench/data/schemas", gguf, bpe, replay_file;
  int walks = 4;
  bool verbose = false;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    if (k == "--schemas") schema_dir = v;
    else if (k == "--gguf") gguf = v;
    else if (k == "--bpe") bpe = v;
    else if (k == "--walks") walks = std::max(1, std::stoi(v));
    else if (k == "--replay") replay_file = v;
    else if (k == "--verbose") verbose = v == "1";
    else if (k == "--chain-cap") g_chain_cap = static_cast<uint32_t>(std::stoul(v));
    else if (k == "--precompute") g_precompute = std::stoul(v);
    else {
      std::fprintf(stderr, "unknown option %s\n", k.c_str());
      return 2;
    }
  }
  std::vector<std::filesystem::path> schemas;
  for (const auto& e : std::filesystem::directory_iterator(schema_dir))
    if (e.path().extension() == ".json") schemas.push_back(e.path());
  std::sort(schemas.begin(), schemas.end());
  std::printf("%zu schemas from %s, %d walks each, cold then warm\n", schemas.size(), schema_dir.c_str(), walks);
  try {
    if (!replay_file.empty()) {
      if (gguf.empty()) throw Error("--replay needs --gguf (the model whose tokens the outputs hold)");
      replay(replay_file, *Tokenizer::from_gguf(GgufFile::open(gguf)), schemas, verbose);
      if (!g_precompute_ms.empty())
        std::printf("  precompute_splits(%zu) per grammar: p50 %.1f ms, max %.1f ms (before the replay)\n", g_precompute,
                    pct(g_precompute_ms, 50), pct(g_precompute_ms, 100));
      return 0;
    }
    if (!gguf.empty()) bench_vocab(gguf, *Tokenizer::from_gguf(GgufFile::open(gguf)), schemas, walks);
    if (!bpe.empty()) {
      const std::vector<AddedToken> added = {{"<|begin_of_text|>", 128000, true}, {"<|end_of_text|>", 128001, true}};
      bench_vocab(bpe, *Tokenizer::from_bpe_files(bpe + "/encoder.json", bpe + "/vocab.bpe", "llama-bpe", added), schemas, walks);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
