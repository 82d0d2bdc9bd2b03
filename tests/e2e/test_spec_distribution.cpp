// Speculative decoding keeps the target's distribution (Leviathan et al. 2023, Theorem 3.5; Chen
// et al. 2023, Theorem 1): on stories260K (vocabulary 512), the tokens at the first three sampled
// positions, drawn through the real verifier (verify_drafts) with three drafters, are distributed
// as plain sampling draws them, by a two-sample chi-square test at p > 0.01 over 20,000 samples
// each (fixed seeds). The drafters: a deliberately bad random one with a non-one-hot q, a perfect
// one (q = p, drafts drawn from p) and the n-gram drafter (one-hot q). The target rows are the real
// model's logits for each context, computed once per distinct context by the engine
// (prompt_logits) and shared by the runs with and without drafts. A control run that accepts
// every random draft unverified must fail the same test, so the test can fail.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <map>
#include <random>

#include "engine/engine.h"
#include "io/gguf.h"
#include "sampling/sampler.h"
#include "spec/draft_model_drafter.h"
#include "spec/ngram_drafter.h"
#include "spec/verifier.h"
#include "test_util.h"

using namespace kestrel;

namespace {

constexpr int kSamples = 20000;
constexpr int kPositions = 3;
using Context = std::vector<int32_t>;

// The model's raw logits after each context, [n_vocab], computed in batches by an engine.
class Oracle {
 public:
  explicit Oracle(const LlamaModel& m) : n_vocab_(static_cast<size_t>(m.hparams().n_vocab)) {
    EngineConfig c;
    c.max_num_seqs = 256;
    c.max_num_batched_tokens = 4096;
    c.max_model_len = 64;
    engine_ = std::make_unique<Engine>(m, nullptr, c);
  }
  void fill(const std::vector<Context>& contexts) {
    std::map<RequestId, const Context*> pending;
    std::map<Context, bool> queued;
    for (const Context& ctx : contexts) {
      if (rows_.count(ctx) || queued[ctx]) continue;
      queued[ctx] = true;
      Request r;
      r.prompt = ctx;
      r.max_tokens = 1;
      r.sampling.temperature = 0;
      r.prompt_logits = true;
      pending[engine_->add_request(r)] = &ctx;
    }
    while (engine_->has_unfinished())
      for (const RequestOutput& o : engine_->step())
        if (!o.prompt_logits.empty())
          rows_[*pending.at(o.id)].assign(o.prompt_logits.end() - static_cast<ptrdiff_t>(n_vocab_), o.prompt_logits.end());
  }
  std::span<const float> row(const Context& ctx) const { return rows_.at(ctx); }
  size_t n_vocab() const { return n_vocab_; }

 private:
  size_t n_vocab_;
  std::unique_ptr<Engine> engine_;
  std::map<Context, std::vector<float>> rows_;
};

enum class DrafterKind { Random, Perfect, Ngram, AcceptAllUnverified };

struct Sample {
  Context ctx;  // prompt + emitted
  std::unique_ptr<Sampler> sampler;
  std::vector<int32_t> drafts;
  std::vector<float> q;  // [drafts.size(), n_vocab] or empty (one-hot)
};

// counts[position][token] over kSamples samples.
using Counts = std::vector<std::vector<int64_t>>;

struct DraftTally {
  int64_t drafted = 0, accepted = 0;
};

Counts draw(Oracle& oracle, const Context& prompt, const SamplingParams& base, uint64_t seed_base, DrafterKind kind,
            bool speculate, DraftTally* tally = nullptr) {
  const size_t nv = oracle.n_vocab();
  std::vector<Sample> samples(kSamples);
  for (int s = 0; s < kSamples; ++s) {
    SamplingParams p = base;
    p.seed = seed_base + static_cast<uint64_t>(s);
    samples[s].ctx = prompt;
    samples[s].sampler = std::make_unique<Sampler>(p, static_cast<int32_t>(nv));
  }
  std::mt19937_64 drafter_rng(seed_base ^ 0x5eed);
  std::uniform_real_distribution<double> unif(0.0, 1.0);
  Sampler target_p(base, static_cast<int32_t>(nv));  // distribution() only: no draws
  const NgramDrafter ngram(1, 3);
  oracle.fill({prompt});
  // The bad drafter's support: the 64 tokens most likely after the prompt, with random weights.
  std::vector<int32_t> support(nv);
  {
    const auto r0 = oracle.row(prompt);
    std::iota(support.begin(), support.end(), 0);
    std::partial_sort(support.begin(), support.begin() + 64, support.end(),
                      [&](int32_t a, int32_t b) { return r0[a] > r0[b]; });
    support.resize(64);
  }
  const auto emitted = [&](const Sample& s) { return static_cast<int>(s.ctx.size() - prompt.size()); };
  for (;;) {
    std::vector<Sample*> active;
    for (Sample& s : samples)
      if (emitted(s) < kPositions) active.push_back(&s);
    if (active.empty()) break;
    // Drafts: enough for the positions still wanted (the token after them is the last one).
    for (Sample* s : active) {
      s->drafts.clear();
      s->q.clear();
    }
    for (int level = 0; speculate && level < kPositions - 1; ++level) {
      std::vector<Context> need;
      std::vector<Sample*> drafting;
      for (Sample* s : active)
        if (static_cast<int>(s->drafts.size()) == level && emitted(*s) + level < kPositions - 1) drafting.push_back(s);
      if (kind == DrafterKind::Perfect) {
        for (Sample* s : drafting) {
          Context c = s->ctx;
          c.insert(c.end(), s->drafts.begin(), s->drafts.end());
          need.push_back(c);
        }
        oracle.fill(need);
      }
      for (size_t i = 0; i < drafting.size(); ++i) {
        Sample& s = *drafting[i];
        std::vector<float> q(nv, 0.0f);
        if (kind == DrafterKind::Ngram) {
          if (level == 0) s.drafts = ngram.lookup(s.ctx, kPositions - 1 - emitted(s));
          continue;
        }
        if (kind == DrafterKind::Perfect) {
          for (const TokenCandidate& c : target_p.distribution(oracle.row(need[i]), need[i], prompt.size()))
            q[static_cast<size_t>(c.id)] = c.prob;
        } else {
          double total = 0.0;
          for (int32_t id : support) total += q[static_cast<size_t>(id)] = static_cast<float>(std::pow(unif(drafter_rng), 3.0));
          for (float& x : q) x = static_cast<float>(x / total);
        }
        // x ~ q by the drafter's own draws.
        double u = unif(drafter_rng), cum = 0.0;
        int32_t x = support[0];
        for (size_t v = 0; v < nv; ++v) {
          cum += q[v];
          if (q[v] > 0.0f) x = static_cast<int32_t>(v);
          if (u < cum) break;
        }
        s.drafts.push_back(x);
        s.q.insert(s.q.end(), q.begin(), q.end());
      }
    }
    // The target rows of every drafted position, then verification.
    std::vector<Context> need;
    for (Sample* s : active) {
      Context c = s->ctx;
      need.push_back(c);
      for (int32_t d : s->drafts) {
        c.push_back(d);
        need.push_back(c);
      }
    }
    oracle.fill(need);
    for (Sample* s : active) {
      const size_t k = s->drafts.size();
      if (kind == DrafterKind::AcceptAllUnverified && k > 0) {
        s->ctx.insert(s->ctx.end(), s->drafts.begin(), s->drafts.end());
        continue;
      }
      Context seq = s->ctx;
      std::vector<float> rows;
      for (size_t i = 0; i <= k; ++i) {
        const auto r = oracle.row(seq);
        rows.insert(rows.end(), r.begin(), r.end());
        if (i < k) seq.push_back(s->drafts[i]);
      }
      const Verification v = verify_drafts(*s->sampler, rows, seq, static_cast<int64_t>(k), prompt.size(), s->q, -1);
      EXPECT_LE(v.n_accepted, static_cast<int64_t>(k));
      EXPECT_EQ(v.tokens.size(), static_cast<size_t>(v.n_accepted) + 1);
      if (tally != nullptr) {
        tally->drafted += static_cast<int64_t>(k);
        tally->accepted += v.n_accepted;
      }
      s->ctx.insert(s->ctx.end(), v.tokens.begin(), v.tokens.end());
    }
  }
  Counts counts(kPositions, std::vector<int64_t>(nv, 0));
  for (const Sample& s : samples)
    for (int p = 0; p < kPositions; ++p) ++counts[p][static_cast<size_t>(s.ctx[prompt.size() + p])];
  return counts;
}

// The p-value of a two-sample chi-square test of equal sample sizes: sum over tokens of
// (a - b)^2 / (a + b), tokens with a + b < 10 pooled into one bin, df = bins - 1, the tail by the
// Wilson-Hilferty cube-root normal approximation (Wilson and Hilferty 1931).
double chi_square_p(const std::vector<int64_t>& a, const std::vector<int64_t>& b, int* df_out) {
  double stat = 0.0, pa = 0.0, pb = 0.0;
  int bins = 0;
  for (size_t v = 0; v < a.size(); ++v) {
    const double n = static_cast<double>(a[v] + b[v]);
    if (n == 0) continue;
    if (n < 10) {
      pa += static_cast<double>(a[v]);
      pb += static_cast<double>(b[v]);
      continue;
    }
    stat += std::pow(static_cast<double>(a[v] - b[v]), 2) / n;
    ++bins;
  }
  if (pa + pb > 0) {
    stat += (pa - pb) * (pa - pb) / (pa + pb);
    ++bins;
  }
  const int df = std::max(1, bins - 1);
  *df_out = df;
  const double h = 2.0 / (9.0 * df);
  const double z = (std::cbrt(stat / df) - (1.0 - h)) / std::sqrt(h);
  return 0.5 * std::erfc(z / std::sqrt(2.0));
}

struct Chain {
  const char* name;
  SamplingParams params;
};

std::vector<Chain> chains() {
  SamplingParams t1;
  t1.temperature = 1.0f;
  SamplingParams tp;
  tp.temperature = 0.7f;
  tp.top_p = 0.9f;
  SamplingParams tk;
  tk.temperature = 1.0f;
  tk.top_k = 20;
  return {{"temperature 1", t1}, {"temperature 0.7, top_p 0.9", tp}, {"top_k 20", tk}};
}

}  // namespace

TEST(SpecDistribution, VerifiedDraftsKeepTheTargetDistributionAtTheFirstThreePositions) {
  const std::string path = test::data_dir() + "/stories260K/stories260K.gguf";
  KESTREL_REQUIRE_FILE(path);
  const auto model = LlamaModel::load_gguf(path);
  const auto tok = Tokenizer::from_gguf(model->file());
  // A prompt that repeats itself, so the n-gram drafter finds matches.
  const Context prompt = tok->encode("The cat sat. The dog sat. The", true, false);
  Oracle oracle(*model);
  for (const Chain& chain : chains()) {
    const Counts off = draw(oracle, prompt, chain.params, 1, DrafterKind::Random, /*speculate=*/false);
    const std::pair<DrafterKind, const char*> kinds[] = {
        {DrafterKind::Random, "random"}, {DrafterKind::Perfect, "perfect"}, {DrafterKind::Ngram, "ngram"}};
    for (const auto& [kind, name] : kinds) {
      DraftTally tally;
      const Counts on = draw(oracle, prompt, chain.params, 1000003, kind, /*speculate=*/true, &tally);
      const double rate = static_cast<double>(tally.accepted) / static_cast<double>(std::max<int64_t>(1, tally.drafted));
      for (int p = 0; p < kPositions; ++p) {
        int df = 0;
        const double pv = chi_square_p(off[p], on[p], &df);
        EXPECT_GT(pv, 0.01) << chain.name << ", drafter " << name << ", position " << p << " (df " << df << ")";
        std::printf("%s, %s drafter: position %d: chi-square p %.3f (df %d); %lld draft tokens, %.1f%% accepted\n",
                    chain.name, name, p, pv, df, static_cast<long long>(tally.drafted), 100.0 * rate);
      }
      // The drafters do what they are meant to: the perfect one is always accepted (q = p), the
      // others are verified often enough for the test to mean something.
      EXPECT_GT(tally.drafted, kSamples / 2) << chain.name << ", " << name;
      if (kind == DrafterKind::Perfect) EXPECT_EQ(tally.accepted, tally.drafted) << chain.name;
      else EXPECT_GT(tally.accepted, 100) << chain.name << ", " << name;
      EXPECT_LT(tally.accepted, tally.drafted + (kind == DrafterKind::Perfect ? 1 : 0)) << chain.name << ", " << name;
    }
    // The control: unverified drafts change the distribution, and the test sees it.
    const Counts bad = draw(oracle, prompt, chain.params, 1000003, DrafterKind::AcceptAllUnverified, true);
    int df = 0;
    EXPECT_LT(chi_square_p(off[0], bad[0], &df), 1e-6) << chain.name;
  }
}

// Through the engine with a draft model: stories260K as the target and a copy with 10%
// multiplicative noise on its block matrices as the draft, whose sampled drafts come with full q rows. The first three tokens of many seeded
// requests of one prompt are distributed as without speculation (chi-square p > 0.01). The
// control: the draft model's own samples are told apart from the target's by the same test, so
// drafts that leaked through unverified would be seen.
TEST(SpecDistribution, DraftModelInTheEngineKeepsTheTargetDistribution) {
  const std::string path = test::data_dir() + "/stories260K/stories260K.gguf";
  KESTREL_REQUIRE_FILE(path);
  constexpr int kRequests = 6000;
  const auto model = LlamaModel::load_gguf(path);
  const std::string perturbed = test::write_perturbed_gguf(path, 0.1, 1);
  const auto noisy = LlamaModel::load_gguf(perturbed);
  const auto tok = Tokenizer::from_gguf(model->file());
  const Context prompt = tok->encode("The cat sat. The dog sat. The", true, false);
  const size_t nv = static_cast<size_t>(model->hparams().n_vocab);
  SamplingParams params;
  params.temperature = 1.0f;
  const auto sample = [&](const LlamaModel& target, bool speculate, uint64_t seed_base, EngineStats* st) {
    EngineConfig c;
    c.max_num_seqs = 256;
    c.max_num_batched_tokens = 2048;
    c.max_model_len = 64;
    DraftModel draft;
    if (speculate) {
      c.speculative.method = SpecMethod::DraftModel;
      c.speculative.model = path;
      c.speculative.num_speculative_tokens = 2;
      draft.model = LlamaModel::load_gguf(perturbed);
    }
    Engine e(target, nullptr, c, nullptr, std::move(draft));
    std::map<RequestId, std::vector<int32_t>> out;
    for (int i = 0; i < kRequests; ++i) {
      Request r;
      r.prompt = prompt;
      r.max_tokens = kPositions + 1;  // drafts at positions 1 and 2 (position 0 is the prompt's sample)
      r.sampling = params;
      r.sampling.seed = seed_base + static_cast<uint64_t>(i);
      out[e.add_request(r)];
    }
    while (e.has_unfinished())
      for (const RequestOutput& o : e.step()) out[o.id].insert(out[o.id].end(), o.new_token_ids.begin(), o.new_token_ids.end());
    if (st != nullptr) *st = e.stats();
    Counts counts(kPositions, std::vector<int64_t>(nv, 0));
    for (const auto& [id, ids] : out) {
      EXPECT_EQ(ids.size(), static_cast<size_t>(kPositions + 1));
      for (size_t p = 0; p < ids.size() && p < static_cast<size_t>(kPositions); ++p) ++counts[p][static_cast<size_t>(ids[p])];
    }
    return counts;
  };
  EngineStats st;
  const Counts off = sample(*model, false, 1, nullptr);
  const Counts on = sample(*model, true, 1000003, &st);
  std::printf("draft model: %lld draft tokens, %.1f%% accepted\n", static_cast<long long>(st.spec_num_draft_tokens),
              100.0 * st.spec_acceptance_rate());
  EXPECT_GT(st.spec_num_draft_tokens, kRequests * 3 / 2);
  EXPECT_GT(st.spec_acceptance_rate(), 0.2);
  EXPECT_LT(st.spec_acceptance_rate(), 0.99);
  for (int p = 0; p < kPositions; ++p) {
    int df = 0;
    const double pv = chi_square_p(off[p], on[p], &df);
    std::printf("draft model: position %d: chi-square p %.3f (df %d)\n", p, pv, df);
    EXPECT_GT(pv, 0.01) << "position " << p << " (df " << df << ")";
  }
  const Counts draft_own = sample(*noisy, false, 1000003, nullptr);
  double worst = 1.0;
  for (int p = 0; p < kPositions; ++p) {
    int df = 0;
    worst = std::min(worst, chi_square_p(off[p], draft_own[p], &df));
  }
  EXPECT_LT(worst, 1e-4) << "the draft's own distribution should be told apart from the target's";
}
