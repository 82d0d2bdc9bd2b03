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
//                         --bpe ../shared/data/llama3-bpe-vocab [--walks 4]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

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

void bench_vocab(const std::string& label, const Tokenizer& tok, const std::vector<std::filesystem::path>& schemas, int walks) {
  auto t0 = Clock::now();
  auto vocab = grammar::TokenVocab::from_tokenizer(tok);
  const double vocab_ms = us_since(t0) / 1000.0;
  std::vector<double> compile_us, cold, warm, accept;
  for (const auto& path : schemas) {
    std::ifstream in(path);
    std::stringstream ss;
    ss << in.rdbuf();
    const auto schema = nlohmann::ordered_json::parse(ss.str());
    // Compile (schema -> GBNF -> grammar, bound to the vocabulary): the median of 9 runs.
    std::vector<double> c;
    std::shared_ptr<grammar::CompiledGrammar> cg;
    for (int i = 0; i < 9; ++i) {
      auto t = Clock::now();
      cg = std::make_shared<grammar::CompiledGrammar>(grammar::Grammar::parse_gbnf(grammar::json_schema_to_gbnf(schema)), vocab);
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

}  // namespace

int main(int argc, char** argv) {
  std::string schema_dir = "bench/data/schemas", gguf, bpe;
  int walks = 4;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    if (k == "--schemas") schema_dir = v;
    else if (k == "--gguf") gguf = v;
    else if (k == "--bpe") bpe = v;
    else if (k == "--walks") walks = std::max(1, std::stoi(v));
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
