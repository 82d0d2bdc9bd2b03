// engine/perplexity.h on stories260K (CPU engine): perplexity and KL divergence against float64
// computations from the logits in the test, a run against its own base file, and the errors of
// bad or mismatched base files; and `kestrel perplexity` end to end.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>

#include "core/error.h"
#include "engine/engine.h"
#include "engine/perplexity.h"
#include "test_util.h"

namespace kestrel {
namespace {

using test::stories_path;

const char* kText =
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her "
    "friends. One day, she saw a big red ball under a tree. She ran to the ball and picked it up. It was very "
    "shiny and new. Lily wanted to share the ball with her friend Tom. Tom was sad because he lost his toy car. "
    "Lily gave him the ball and said, \"We can play together!\" Tom smiled and they played all day. When the sun "
    "went down, they went home happy. The next morning, Lily and Tom met again at the park.";

constexpr int64_t kCtx = 48;  // kld_first_scored: 24, so rows 24..46 of each chunk are scored

struct Stories {
  std::unique_ptr<LlamaModel> model;
  std::unique_ptr<Tokenizer> tok;
  std::vector<int32_t> chunks;
  int64_t n_vocab = 0;
};
Stories load_stories() {
  Stories s;
  s.model = LlamaModel::load_gguf(stories_path());
  s.tok = Tokenizer::from_gguf(s.model->file());
  s.n_vocab = s.model->hparams().n_vocab;
  const std::vector<int32_t> ids = s.tok->encode(kText, false, false);
  s.chunks = perplexity_chunks(ids, kCtx, s.tok->bos_id(), 0);
  return s;
}

EngineConfig engine_config(KvDtype kv) {
  EngineConfig c;
  c.kv_dtype = kv;
  c.max_model_len = kCtx + 1;
  c.max_num_seqs = 1;
  return c;
}

// float64 log-softmax of a logits row.
std::vector<double> log_softmax64(const float* x, int64_t n) {
  double mx = -INFINITY;
  for (int64_t v = 0; v < n; ++v) mx = std::max(mx, static_cast<double>(x[v]));
  double s = 0;
  for (int64_t v = 0; v < n; ++v) s += std::exp(static_cast<double>(x[v]) - mx);
  std::vector<double> out(static_cast<size_t>(n));
  for (int64_t v = 0; v < n; ++v) out[static_cast<size_t>(v)] = static_cast<double>(x[v]) - mx - std::log(s);
  return out;
}

// Every chunk's logits from an engine with this KV dtype, kept for the references.
struct LoggedRun {
  std::vector<std::vector<float>> logits;
  ChunkLogits fn(const LlamaModel& m, KvDtype kv) {
    auto engine = std::make_shared<Engine>(m, nullptr, engine_config(kv));
    return [this, engine](std::span<const int32_t> chunk) {
      logits.push_back(test::prompt_logits(*engine, std::vector<int32_t>(chunk.begin(), chunk.end())));
      return logits.back();
    };
  }
};

TEST(Perplexity, ChunksPutBosFirstAndRejectShortText) {
  const std::vector<int32_t> ids = {5, 6, 7, 8, 9, 10, 11};
  EXPECT_EQ(perplexity_chunks(ids, 4, 1, 0), (std::vector<int32_t>{1, 5, 6, 7, 1, 8, 9, 10}));
  EXPECT_EQ(perplexity_chunks(ids, 4, -1, 0), (std::vector<int32_t>{5, 6, 7, 8}));
  EXPECT_EQ(perplexity_chunks(ids, 4, 1, 1), (std::vector<int32_t>{1, 5, 6, 7}));
  EXPECT_NE(test::error_of([&] { perplexity_chunks(ids, 16, 1, 0); }).find("the text has 7 tokens"), std::string::npos);
  EXPECT_NE(test::error_of([&] { perplexity_chunks(ids, 3, 1, 0); }).find("too short"), std::string::npos);
}

// PPL = exp(mean over scored rows of -log softmax(x)[next token]), recomputed in float64. The
// engine's value rounds each log-probability to f32 (relative 2^-24 of |log p| <= 2^-24 x 20 per
// row here), so it agrees to a relative 1e-6.
TEST(Perplexity, EqualsFloat64FromTheLogits) {
  KESTREL_REQUIRE_FILE(stories_path());
  Stories s = load_stories();
  ASSERT_GE(s.chunks.size(), static_cast<size_t>(3 * kCtx));
  LoggedRun run;
  const PerplexityResult r = evaluate_perplexity(s.chunks, kCtx, s.n_vocab, run.fn(*s.model, KvDtype::F32), nullptr, nullptr);
  const int64_t first = kld_first_scored(kCtx);
  double nll = 0;
  int64_t n = 0;
  for (size_t c = 0; c < run.logits.size(); ++c)
    for (int64_t p = first; p < kCtx - 1; ++p) {
      const std::vector<double> lp = log_softmax64(run.logits[c].data() + p * s.n_vocab, s.n_vocab);
      nll -= lp[static_cast<size_t>(s.chunks[c * kCtx + static_cast<size_t>(p) + 1])];
      ++n;
    }
  EXPECT_EQ(r.n_scored, n);
  EXPECT_EQ(r.n_chunks, static_cast<int64_t>(run.logits.size()));
  const double ref = std::exp(nll / static_cast<double>(n));
  EXPECT_NEAR(r.ppl, ref, 1e-6 * ref);
  EXPECT_GT(r.ppl, 1.0);
  EXPECT_GT(r.ppl_unc, 0.0);
  EXPECT_FALSE(r.has_kl);
}

// A run against the base file of the same run: every row's KL is exactly 0, the top token always agrees.
TEST(Perplexity, KlOfARunAgainstItsOwnBaseIsZero) {
  KESTREL_REQUIRE_FILE(stories_path());
  Stories s = load_stories();
  const std::string path = test::temp_path("kld_self", ".bin");
  const int64_t n_chunks = static_cast<int64_t>(s.chunks.size()) / kCtx;
  LoggedRun a, b;
  {
    KldBaseWriter w(path, {s.n_vocab, kCtx, kld_first_scored(kCtx), n_chunks}, s.chunks);
    evaluate_perplexity(s.chunks, kCtx, s.n_vocab, a.fn(*s.model, KvDtype::F16), &w, nullptr);
    w.finish();
  }
  KldBaseReader base(path);
  EXPECT_EQ(check_kld_base(base, s.n_vocab, kCtx, s.chunks, 0), n_chunks);
  const PerplexityResult r = evaluate_perplexity(s.chunks, kCtx, s.n_vocab, b.fn(*s.model, KvDtype::F16), nullptr, &base);
  ASSERT_TRUE(r.has_kl);
  EXPECT_EQ(r.kl_mean, 0.0);
  EXPECT_EQ(r.kl_max, 0.0);
  EXPECT_EQ(r.top1, 1.0);
  EXPECT_EQ(r.ppl, r.base_ppl);
  std::remove(path.c_str());
}

// f32 KV as the base, int8 KV compared: mean / median / max KL, top-1 agreement and both
// perplexities against float64 computations from both runs' logits. The engine's KL uses f32
// log-probabilities: each term's error is at most 2^-24 x |log p| (<= 20 here) times p, so a
// row's KL is off by at most ~2e-6; held to 3e-6.
TEST(Perplexity, KlBetweenTwoConfigsEqualsFloat64FromTheLogits) {
  KESTREL_REQUIRE_FILE(stories_path());
  Stories s = load_stories();
  const std::string path = test::temp_path("kld_int8", ".bin");
  const int64_t n_chunks = static_cast<int64_t>(s.chunks.size()) / kCtx;
  LoggedRun a, b;
  PerplexityResult ra;
  {
    KldBaseWriter w(path, {s.n_vocab, kCtx, kld_first_scored(kCtx), n_chunks}, s.chunks);
    ra = evaluate_perplexity(s.chunks, kCtx, s.n_vocab, a.fn(*s.model, KvDtype::F32), &w, nullptr);
    w.finish();
  }
  KldBaseReader base(path);
  const PerplexityResult r = evaluate_perplexity(s.chunks, kCtx, s.n_vocab, b.fn(*s.model, KvDtype::INT8), nullptr, &base);
  std::vector<double> kls;
  int64_t same = 0;
  double nll_a = 0, nll_b = 0;
  for (size_t c = 0; c < a.logits.size(); ++c)
    for (int64_t p = kld_first_scored(kCtx); p < kCtx - 1; ++p) {
      const float* xa = a.logits[c].data() + p * s.n_vocab;
      const float* xb = b.logits[c].data() + p * s.n_vocab;
      const std::vector<double> la = log_softmax64(xa, s.n_vocab), lb = log_softmax64(xb, s.n_vocab);
      double kl = 0;
      for (size_t v = 0; v < la.size(); ++v) kl += std::exp(la[v]) * (la[v] - lb[v]);
      kls.push_back(kl);
      same += (std::max_element(xa, xa + s.n_vocab) - xa) == (std::max_element(xb, xb + s.n_vocab) - xb);
      const size_t t = static_cast<size_t>(s.chunks[c * kCtx + static_cast<size_t>(p) + 1]);
      nll_a -= la[t];
      nll_b -= lb[t];
    }
  const double n = static_cast<double>(kls.size());
  double mean = 0;
  for (double k : kls) mean += k / n;
  std::sort(kls.begin(), kls.end());
  ASSERT_TRUE(r.has_kl);
  EXPECT_GT(mean, 1e-5);  // the int8 cache does move the distributions
  EXPECT_NEAR(r.kl_mean, mean, 3e-6);
  EXPECT_NEAR(r.kl_max, kls.back(), 3e-6);
  EXPECT_NEAR(r.kl_median, kls[static_cast<size_t>(std::ceil(0.5 * n)) - 1], 3e-6);
  EXPECT_EQ(r.top1, static_cast<double>(same) / n);
  EXPECT_NEAR(r.ppl, std::exp(nll_b / n), 1e-6 * r.ppl);
  EXPECT_NEAR(r.base_ppl, std::exp(nll_a / n), 1e-6 * r.base_ppl);
  EXPECT_EQ(r.base_ppl, ra.ppl);
  std::remove(path.c_str());
}

// Writes a small valid base file (2 chunks of 8, vocab 5) and returns its bytes.
std::vector<uint8_t> small_base(const std::string& path, std::vector<int32_t> tokens) {
  {
    KldBaseWriter w(path, {5, 8, kld_first_scored(8), 2}, tokens);
    std::vector<float> rows(static_cast<size_t>(kld_scored_per_chunk(8) * 5), -1.6094f);
    w.write_chunk(rows);
    w.write_chunk(rows);
    w.finish();
  }
  const std::string s = test::read_file(path);
  return std::vector<uint8_t>(s.begin(), s.end());
}

TEST(Perplexity, BadOrMismatchedBaseFilesAreClearErrors) {
  const std::string path = test::temp_path("kld_bad", ".bin");
  std::vector<int32_t> tokens = {1, 2, 3, 4, 0, 1, 2, 3, 1, 4, 4, 4, 0, 0, 2, 2};
  const std::vector<uint8_t> good = small_base(path, tokens);
  {
    KldBaseReader r(path);
    EXPECT_EQ(r.header().n_chunks, 2);
    EXPECT_EQ(r.tokens(), tokens);
    EXPECT_NE(test::error_of([&] { check_kld_base(r, 6, 8, {}, 0); }).find("vocabulary has 5 tokens, this model's 6"),
              std::string::npos);
    EXPECT_NE(test::error_of([&] { check_kld_base(r, 5, 16, {}, 0); }).find("made with -c 8"), std::string::npos);
    std::vector<int32_t> other = tokens;
    other[13] = 3;
    EXPECT_NE(test::error_of([&] { check_kld_base(r, 5, 8, other, 0); }).find("at chunk 1, position 5"),
              std::string::npos);
    EXPECT_EQ(check_kld_base(r, 5, 8, tokens, 1), 1);
    EXPECT_NE(test::error_of([&] { check_kld_base(r, 5, 8, std::span(tokens).first(8), 0); }).find("gives 1 chunks"),
              std::string::npos);
  }
  const auto error_for = [&](std::vector<uint8_t> bytes) {
    test::write_file(path, bytes);
    return test::error_of([&] { KldBaseReader r(path); });
  };
  std::vector<uint8_t> b = good;
  b[0] = 'X';
  EXPECT_NE(error_for(b).find("not a kestrel KL divergence base file"), std::string::npos);
  b = good;
  b[8] = 2;
  EXPECT_NE(error_for(b).find("version 2"), std::string::npos);
  b = good;
  b.resize(b.size() - 3);
  EXPECT_NE(error_for(b).find("(truncated)"), std::string::npos);
  b = good;
  b.push_back(0);
  EXPECT_NE(error_for(b).find("(trailing bytes)"), std::string::npos);
  b = good;
  b.resize(20);
  EXPECT_NE(error_for(b).find("truncated in its header"), std::string::npos);
  b = good;
  const int32_t bad = 7;
  std::memcpy(b.data() + 48 + 4 * 3, &bad, 4);
  EXPECT_NE(error_for(b).find("token 3 is 7, outside the vocabulary of 5"), std::string::npos);
  EXPECT_NE(test::error_of([&] { KldBaseReader r(path + ".absent"); }).find("cannot open"), std::string::npos);
  std::remove(path.c_str());
}

// The command: a base file, then a comparison of the same configuration (KL 0, same top 100%), and
// a comparison on another model's vocabulary named as such.
TEST(Perplexity, CommandWritesAndComparesBaseFiles) {
  KESTREL_REQUIRE_FILE(stories_path());
  const std::string text = test::temp_path("kld_text", ".txt"), base = test::temp_path("kld_cli", ".bin");
  {
    std::ofstream(text) << kText;
  }
  const std::string cmd = test::kestrel_binary() + " perplexity -m " + stories_path() + " -f " + text + " -c 48 --json";
  std::string out;
  ASSERT_EQ(test::run_command(cmd + " --kl-divergence-base " + base, &out), 0) << cmd;
  EXPECT_NE(out.find("\"n_scored\":"), std::string::npos) << out;
  ASSERT_EQ(test::run_command(cmd + " --kl-divergence-base " + base + " --kl-divergence", &out), 0);
  EXPECT_NE(out.find("\"kl_mean\":0.0,"), std::string::npos) << out;
  EXPECT_NE(out.find("\"top1\":1.0"), std::string::npos) << out;
  const std::string tiny = test::data_dir() + "/llama-2-tiny-random/llama-2-tiny-random.gguf";
  const std::string other = test::kestrel_binary() + " perplexity -m " + tiny + " -c 48 --kl-divergence-base " + base +
                            " --kl-divergence 2>&1";
  EXPECT_EQ(test::run_command(other, &out), 1) << out;
  EXPECT_NE(out.find("the base file's vocabulary has 512 tokens"), std::string::npos) << out;
  std::remove(text.c_str());
  std::remove(base.c_str());
}

}  // namespace
}  // namespace kestrel
