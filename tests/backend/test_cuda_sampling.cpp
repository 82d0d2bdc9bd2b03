// CUDA token sampling (sample_tokens) against a re-implementation of the CPU Sampler's arithmetic
// (sampling_reference.h; tests/unit/test_sampling.cpp checks it against kestrel::Sampler). The
// op's contract allows a different token only where float rounding decides, so each row's data and
// uniform are drawn again until the reference says no decision came within 2e-6 of its boundary
// (the draw's target and a CDF step, a top_p prefix mass and top_p, a logit and the min_p
// threshold); then every token must be equal. The emulation runs the full parameter grid on small
// vocabularies and a few rows of the large ones; the GPU runs the grid on 128256 (Llama 3) too.
#include <algorithm>
#include <cstring>
#include <cstdio>
#include <limits>
#include <numeric>

#include "cuda_test_util.h"
#include "sampling_reference.h"

namespace kestrel::test {
namespace {

using cuda::SampleParams;

#if defined(KESTREL_CUDA_EMULATE)
constexpr bool kEmulated = true;
#else
constexpr bool kEmulated = false;
#endif

constexpr double kBoundary = 2e-6;

enum class Kind {
  kPeaked,  // N(0, 3): a few likely tokens, a long tail
  kTies,    // N(0, 1.5) rounded to halves: many exact ties, also at the cuts
  kNegInf,  // N(0, 3) with 30% of the tokens at -inf (banned ids)
  kFlat,    // U(-1, 1): top_p keeps most of the vocabulary (window too small: radix select)
  kOctave,  // U(1, 2): one sign and exponent, so the radix select needs its second digit
  kEqual,   // all 0.25: every cut falls inside one tie, resolved by the id digits
};

std::vector<float> make_logits(Kind kind, int64_t n, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, kind == Kind::kTies ? 1.5f : 3.0f);
  std::uniform_real_distribution<float> flat(-1.0f, 1.0f), octave(1.0f, 2.0f);
  std::bernoulli_distribution ban(0.3);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) {
    switch (kind) {
      case Kind::kPeaked: x = normal(rng); break;
      case Kind::kTies: x = std::round(normal(rng) * 2.0f) / 2.0f; break;
      case Kind::kNegInf: x = ban(rng) ? -INFINITY : normal(rng); break;
      case Kind::kFlat: x = flat(rng); break;
      case Kind::kOctave: x = octave(rng); break;
      case Kind::kEqual: x = 0.25f; break;
    }
  }
  if (kind == Kind::kNegInf) v[rng() % v.size()] = normal(rng);  // at least one finite logit
  return v;
}

SampleParams to_device(const ReferenceParams& p, double u) { return SampleParams{p.temperature, p.top_k, p.top_p, p.min_p, u}; }

// masks: empty, or [params.size(), (n_vocab + 31) / 32] words read for the rows with masked set.
std::vector<int32_t> sample_on_device(const std::vector<float>& logits, const std::vector<SampleParams>& params,
                                      int64_t n_vocab, const std::vector<uint32_t>& masks = {}) {
  const auto n_rows = static_cast<int64_t>(params.size());
  DeviceBuffer<float> d_logits(logits);
  DeviceBuffer<SampleParams> d_params(params);
  DeviceBuffer<uint32_t> d_masks(masks);
  DeviceBuffer<int32_t> d_tokens(params.size());
  DeviceBuffer<unsigned char> workspace(cuda::sampling_workspace_bytes(n_rows, n_vocab));
  d_tokens.poison();
  cuda::sample_tokens(d_logits.get(), d_params.get(), n_rows, n_vocab, d_tokens.get(), workspace.get(), nullptr,
                      masks.empty() ? nullptr : d_masks.get());
  const std::vector<float> after = d_logits.download();
  EXPECT_TRUE(std::equal(after.begin(), after.end(), logits.begin(), [](float a, float b) {
    return std::memcmp(&a, &b, sizeof a) == 0;
  })) << "the sampler wrote to the logits";
  return d_tokens.download();
}

struct Row {
  Kind kind;
  ReferenceParams params;
};

// Samples every row on the device and with the reference (fresh logits and uniform per row, away
// from every boundary), runs the device twice (the result must not change), and compares.
void expect_reference_tokens(int64_t n_vocab, const std::vector<Row>& rows, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  std::vector<float> logits;
  std::vector<SampleParams> params;
  std::vector<ReferenceDraw> expected;
  int redrawn = 0;
  std::vector<Row> kept;  // rows for which data away from every boundary was found
  for (const Row& row : rows) {
    for (int attempt = 0;; ++attempt) {
      // On a 128k vocabulary a flat row's CDF steps are ~1e-5 apart, so a row whose uniform
      // falls that deep into a flat tail may never clear the margin: such a row is skipped
      // (counted below), not failed.
      if (attempt == 100) break;
      const std::vector<float> l = make_logits(row.kind, n_vocab, rng);
      const double u = uniform(rng);
      const ReferenceDraw ref = reference_sample(l.data(), n_vocab, row.params, u);
      if (ref.margin < kBoundary) {
        ++redrawn;
        continue;
      }
      logits.insert(logits.end(), l.begin(), l.end());
      params.push_back(to_device(row.params, u));
      expected.push_back(ref);
      kept.push_back(row);
      break;
    }
  }
  const std::vector<int32_t> tokens = sample_on_device(logits, params, n_vocab);
  EXPECT_EQ(sample_on_device(logits, params, n_vocab), tokens) << "not deterministic";
  const size_t skipped = rows.size() - kept.size();
  EXPECT_LE(skipped * 10, rows.size()) << skipped << " of " << rows.size() << " rows had no data away from the boundaries";
  for (size_t r = 0; r < kept.size(); ++r) {
    const ReferenceParams& p = kept[r].params;
    EXPECT_EQ(tokens[r], expected[r].token)
        << "n_vocab " << n_vocab << " row " << r << " kind " << static_cast<int>(kept[r].kind) << " temperature "
        << p.temperature << " top_k " << p.top_k << " top_p " << p.top_p << " min_p " << p.min_p << " uniform "
        << params[r].uniform << " margin " << expected[r].margin;
  }
  std::printf("n_vocab %lld: %zu rows (%d drawn again, within %.0e of a boundary; %zu skipped)\n",
              static_cast<long long>(n_vocab), rows.size(), redrawn, kBoundary, skipped);
}

// temperature {0, 0.5, 1, 2} x top_k {0, 1, 5, 50} x top_p {1, 0.9, 0.5} x min_p {0, 0.05}.
std::vector<Row> parameter_grid(const std::vector<Kind>& kinds) {
  std::vector<Row> rows;
  for (Kind kind : kinds)
    for (float t : {0.0f, 0.5f, 1.0f, 2.0f})
      for (int32_t k : {0, 1, 5, 50})
        for (float p : {1.0f, 0.9f, 0.5f})
          for (float m : {0.0f, 0.05f}) rows.push_back(Row{kind, ReferenceParams{t, k, p, m}});
  return rows;
}

TEST(CudaSampling, MatchesTheCpuSamplerOnSmallVocabularies) {
  KESTREL_REQUIRE_CUDA();
  expect_reference_tokens(1, parameter_grid({Kind::kPeaked}), 1);  // one token: 0 whatever the chain
  const auto rows = parameter_grid({Kind::kPeaked, Kind::kTies, Kind::kNegInf});
  for (const int64_t n_vocab : {7, 1000}) {
    SCOPED_TRACE("n_vocab " + std::to_string(n_vocab));
    expect_reference_tokens(n_vocab, rows, static_cast<uint32_t>(n_vocab));
  }
}

// Wider than the shared-memory window (8192): flat rows whose top_p keeps most of the vocabulary
// and a top_k of 9000 go through the radix select (octave rows to its second digit, equal rows to
// its id digits), rows with only temperature (or a min_p that keeps too many) through the slices,
// peaked rows through the window.
TEST(CudaSampling, MatchesTheCpuSamplerPastTheWindow) {
  KESTREL_REQUIRE_CUDA();
  const std::vector<Row> rows = {
      {Kind::kFlat, {1.0f, 0, 0.9f, 0.0f}},       {Kind::kFlat, {0.7f, 9000, 1.0f, 0.0f}},
      {Kind::kFlat, {0.7f, 9000, 0.5f, 0.0f}},    {Kind::kFlat, {2.0f, 0, 0.95f, 0.05f}},
      {Kind::kTies, {1.0f, 0, 0.99f, 0.0f}},      {Kind::kTies, {0.5f, 9000, 1.0f, 0.0f}},
      {Kind::kNegInf, {1.0f, 0, 0.99f, 0.0f}},    {Kind::kFlat, {0.5f, 0, 1.0f, 0.0f}},
      {Kind::kFlat, {1.0f, 0, 1.0f, 0.05f}},      {Kind::kNegInf, {1.5f, 0, 1.0f, 0.0f}},
      {Kind::kPeaked, {0.8f, 40, 0.95f, 0.05f}},  {Kind::kPeaked, {1.0f, 0, 0.9f, 0.0f}},
      {Kind::kOctave, {1.0f, 0, 0.9f, 0.0f}},     {Kind::kOctave, {0.7f, 9000, 0.8f, 0.0f}},
      {Kind::kEqual, {1.0f, 0, 0.90333f, 0.0f}},  {Kind::kEqual, {1.3f, 9000, 1.0f, 0.0f}},
  };
  expect_reference_tokens(20000, rows, 11);
}

TEST(CudaSampling, MatchesTheCpuSamplerOnALlama3Vocabulary) {
  KESTREL_REQUIRE_CUDA();
  if (kEmulated) {  // the emulation is slow: one row through the window, one through the slices
    expect_reference_tokens(128256, {{Kind::kPeaked, {0.7f, 50, 0.9f, 0.0f}}, {Kind::kPeaked, {0.8f, 0, 1.0f, 0.0f}}},
                            5);
  } else {
    expect_reference_tokens(128256, parameter_grid({Kind::kPeaked, Kind::kTies, Kind::kNegInf, Kind::kFlat}), 5);
  }
}

TEST(CudaSampling, NanAndInfiniteRows) {
  KESTREL_REQUIRE_CUDA();
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = INFINITY;
  const std::vector<std::vector<float>> rows = {
      {0.5f, nan, 1.0f, 0.0f, 2.0f},   // NaN: -1, greedy or not
      {0.5f, inf, 1.0f, inf, 2.0f},    // +inf: -1, greedy or not (the CPU sampler's error too)
      {-inf, -inf, -inf, -inf, -inf},  // all banned: no distribution, -1 greedy or not
      {-inf, 3.0f, -inf, 3.0f, -inf},  // -inf tokens never drawn; ties
  };
  std::vector<float> logits;
  std::vector<SampleParams> params;
  for (const auto& r : rows) {
    for (const SampleParams p : {SampleParams{0.0f, 0, 1.0f, 0.0f, 0.5}, SampleParams{1.0f, 0, 1.0f, 0.0f, 0.999},
                                 SampleParams{0.7f, 2, 0.9f, 0.05f, 0.3}}) {
      logits.insert(logits.end(), r.begin(), r.end());
      params.push_back(p);
    }
  }
  const std::vector<int32_t> tokens = sample_on_device(logits, params, 5);
  const std::vector<int32_t> expected = {-1, -1, -1, -1, -1, -1, -1, -1, -1, 1, 3, 1};
  EXPECT_EQ(tokens, expected);
}

// Draws with uniforms on a grid, (j + 0.5) / n_draws, are the inverse CDF sampled evenly: each
// token's share of them is its probability within 1 / n_draws. Probabilities from an independent
// f64 filter + softmax (rank order for top_k / top_p, id order otherwise).
TEST(CudaSampling, GridOfUniformsReproducesTheFilteredSoftmax) {
  KESTREL_REQUIRE_CUDA();
  const int64_t n_vocab = 64;
  const int n_draws = kEmulated ? 256 : 4096;
  std::mt19937 rng(21);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<float> l(static_cast<size_t>(n_vocab));
  for (float& x : l) x = normal(rng);
  for (const ReferenceParams p : {ReferenceParams{0.8f, 20, 0.9f, 0.02f}, ReferenceParams{1.3f, 0, 1.0f, 0.05f},
                                  ReferenceParams{0.5f, 0, 0.95f, 0.0f}}) {
    SCOPED_TRACE("temperature " + std::to_string(p.temperature) + " top_k " + std::to_string(p.top_k));
    // The kept set in f64: rank order, top_k, top_p over the raw softmax, min_p.
    std::vector<int32_t> order(static_cast<size_t>(n_vocab));
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return l[a] > l[b] || (l[a] == l[b] && a < b); });
    const double top = l[static_cast<size_t>(order[0])];
    size_t keep = p.top_k > 0 ? std::min<size_t>(static_cast<size_t>(p.top_k), order.size()) : order.size();
    if (p.top_p < 1.0f) {
      double z = 0.0, cum = 0.0;
      for (size_t i = 0; i < keep; ++i) z += std::exp(l[static_cast<size_t>(order[i])] - top);
      for (size_t i = 0; i < keep; ++i) {
        cum += std::exp(l[static_cast<size_t>(order[i])] - top) / z;
        ASSERT_GT(std::fabs(cum - p.top_p), 1e-3) << "pick data with a clear top_p cut";
        if (cum >= p.top_p) {
          keep = i + 1;
          break;
        }
      }
    }
    std::vector<double> prob(static_cast<size_t>(n_vocab), 0.0);
    double z = 0.0;
    for (size_t i = 0; i < keep; ++i) {
      const int32_t id = order[i];
      if (p.min_p > 0.0f && l[static_cast<size_t>(id)] < top + std::log(p.min_p)) continue;
      prob[static_cast<size_t>(id)] = std::exp((l[static_cast<size_t>(id)] - top) / p.temperature);
      z += prob[static_cast<size_t>(id)];
    }
    for (double& q : prob) q /= z;

    std::vector<float> logits;
    std::vector<SampleParams> params;
    for (int j = 0; j < n_draws; ++j) {
      logits.insert(logits.end(), l.begin(), l.end());
      params.push_back(to_device(p, (j + 0.5) / n_draws));
    }
    const std::vector<int32_t> tokens = sample_on_device(logits, params, n_vocab);
    std::vector<int> count(static_cast<size_t>(n_vocab), 0);
    for (int32_t t : tokens) {
      ASSERT_GE(t, 0);
      ASSERT_LT(t, n_vocab);
      ++count[static_cast<size_t>(t)];
    }
    for (int64_t i = 0; i < n_vocab; ++i) {
      const double f = static_cast<double>(count[static_cast<size_t>(i)]) / n_draws;
      if (prob[static_cast<size_t>(i)] == 0.0) {
        EXPECT_EQ(count[static_cast<size_t>(i)], 0) << "token " << i << " is filtered out";
      } else {
        EXPECT_LE(std::fabs(f - prob[static_cast<size_t>(i)]), 1.0 / n_draws + 1e-6) << "token " << i;
      }
    }
  }
}

// Token masks (structured output): the kernel must give the reference's token for the logits with
// every disallowed token at -inf (grammar::apply_token_bitmask on the host), mask rows mixed with
// unmasked ones in one call. Masks: a random half of the vocabulary; one allowed token; only tokens
// ranked below the unmasked row's top 50 (so top_k must count allowed tokens, as on the host);
// and the window, radix and slice paths on a 20000-token vocabulary. A NaN at a disallowed id is
// masked away, as on the host.
struct MaskedRow {
  Kind kind;
  ReferenceParams params;
  enum class Mask { kNone, kHalf, kOne, kBelowTopK, kMostBanned } mask;
};

void expect_masked_reference_tokens(int64_t n_vocab, const std::vector<MaskedRow>& rows, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  const size_t words = (static_cast<size_t>(n_vocab) + 31) / 32;
  std::vector<float> logits;
  std::vector<SampleParams> params;
  std::vector<uint32_t> masks;
  std::vector<int32_t> expected;
  std::vector<size_t> index;  // rows kept (data away from every boundary)
  for (size_t i = 0; i < rows.size(); ++i) {
    const MaskedRow& row = rows[i];
    for (int attempt = 0; attempt < 100; ++attempt) {
      std::vector<float> l = make_logits(row.kind, n_vocab, rng);
      std::vector<uint32_t> m(words, 0u);
      auto allow = [&](int64_t id) { m[static_cast<size_t>(id) / 32] |= 1u << (id % 32); };
      switch (row.mask) {
        case MaskedRow::Mask::kNone: std::fill(m.begin(), m.end(), ~0u); break;
        case MaskedRow::Mask::kHalf:
          for (int64_t id = 0; id < n_vocab; ++id)
            if (rng() % 2 == 0) allow(id);
          break;
        case MaskedRow::Mask::kOne: allow(static_cast<int64_t>(rng() % static_cast<uint32_t>(n_vocab))); break;
        case MaskedRow::Mask::kBelowTopK: {
          std::vector<int32_t> order(static_cast<size_t>(n_vocab));
          std::iota(order.begin(), order.end(), 0);
          std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return l[a] > l[b] || (l[a] == l[b] && a < b); });
          for (size_t r = 50; r < order.size(); r += 3) allow(order[r]);
          break;
        }
        case MaskedRow::Mask::kMostBanned:
          for (int64_t id = 0; id < n_vocab; ++id)
            if (rng() % 64 == 0) allow(id);
          break;
      }
      if (std::all_of(m.begin(), m.end(), [](uint32_t w) { return w == 0; })) allow(0);
      std::vector<float> masked = l;
      for (int64_t id = 0; id < n_vocab; ++id)
        if (((m[static_cast<size_t>(id) / 32] >> (id % 32)) & 1u) == 0) masked[static_cast<size_t>(id)] = -INFINITY;
      if (row.mask != MaskedRow::Mask::kNone) {  // a NaN where the mask bans: the row stays valid
        for (int64_t id = 0; id < n_vocab; ++id)
          if (masked[static_cast<size_t>(id)] == -INFINITY && row.kind != Kind::kNegInf) {
            l[static_cast<size_t>(id)] = std::numeric_limits<float>::quiet_NaN();
            break;
          }
      }
      const double u = uniform(rng);
      const ReferenceDraw ref = reference_sample(masked.data(), n_vocab, row.params, u);
      if (ref.margin < kBoundary) continue;
      logits.insert(logits.end(), l.begin(), l.end());
      masks.insert(masks.end(), m.begin(), m.end());
      SampleParams p = to_device(row.params, u);
      p.masked = row.mask != MaskedRow::Mask::kNone;
      params.push_back(p);
      expected.push_back(ref.token);
      index.push_back(i);
      break;
    }
  }
  EXPECT_LE((rows.size() - index.size()) * 10, rows.size()) << "too many rows without data away from the boundaries";
  const std::vector<int32_t> tokens = sample_on_device(logits, params, n_vocab, masks);
  for (size_t r = 0; r < index.size(); ++r) {
    const MaskedRow& row = rows[index[r]];
    EXPECT_GE(expected[r], 0);
    EXPECT_EQ(tokens[r], expected[r]) << "n_vocab " << n_vocab << " row " << index[r] << " mask "
                                      << static_cast<int>(row.mask) << " temperature " << row.params.temperature
                                      << " top_k " << row.params.top_k << " top_p " << row.params.top_p << " min_p "
                                      << row.params.min_p;
    if (row.mask != MaskedRow::Mask::kNone && tokens[r] >= 0)
      EXPECT_TRUE((masks[r * words + static_cast<size_t>(tokens[r]) / 32] >> (tokens[r] % 32)) & 1u)
          << "row " << index[r] << " drew a disallowed token";
  }
}

std::vector<MaskedRow> masked_grid(const std::vector<Kind>& kinds) {
  std::vector<MaskedRow> rows;
  using M = MaskedRow::Mask;
  for (Kind kind : kinds)
    for (M mask : {M::kNone, M::kHalf, M::kOne, M::kBelowTopK, M::kMostBanned})
      for (float t : {0.0f, 0.7f, 1.0f})
        for (int32_t k : {0, 5, 50})
          for (float p : {1.0f, 0.9f})
            for (float mp : {0.0f, 0.05f}) rows.push_back(MaskedRow{kind, ReferenceParams{t, k, p, mp}, mask});
  return rows;
}

TEST(CudaSampling, TokenMasksGiveTheHostSamplersTokensOnTheMaskedLogits) {
  KESTREL_REQUIRE_CUDA();
  // 1001: rows that are no multiple of 4 (scalar loads) and a mask word cut by the row's end.
  for (const int64_t n_vocab : {1000, 1001}) {
    SCOPED_TRACE("n_vocab " + std::to_string(n_vocab));
    expect_masked_reference_tokens(n_vocab, masked_grid({Kind::kPeaked, Kind::kTies}), static_cast<uint32_t>(n_vocab));
  }
  // Past the shared-memory window: flat rows under a half mask keep ~10000 tokens (radix select and
  // slices); peaked ones stay in the window.
  using M = MaskedRow::Mask;
  const std::vector<MaskedRow> wide = {
      {Kind::kFlat, {1.0f, 0, 0.9f, 0.0f}, M::kHalf},       {Kind::kFlat, {0.7f, 9000, 1.0f, 0.0f}, M::kHalf},
      {Kind::kFlat, {0.5f, 0, 1.0f, 0.0f}, M::kHalf},       {Kind::kFlat, {1.0f, 0, 1.0f, 0.05f}, M::kHalf},
      {Kind::kPeaked, {0.8f, 40, 0.95f, 0.05f}, M::kBelowTopK}, {Kind::kPeaked, {1.0f, 0, 1.0f, 0.0f}, M::kOne},
      {Kind::kPeaked, {0.0f, 0, 1.0f, 0.0f}, M::kMostBanned},   {Kind::kOctave, {1.0f, 0, 0.9f, 0.0f}, M::kHalf},
  };
  expect_masked_reference_tokens(20000, wide, 23);
}

TEST(CudaSampling, RejectsBadShapes) {
  KESTREL_REQUIRE_CUDA();
  EXPECT_THROW(cuda::sample_tokens(nullptr, nullptr, 1, 0, nullptr, nullptr, nullptr), Error);
  EXPECT_THROW(cuda::sample_tokens(nullptr, nullptr, -1, 10, nullptr, nullptr, nullptr), Error);
  EXPECT_THROW(cuda::sample_tokens(nullptr, nullptr, 1, int64_t{1} << 31, nullptr, nullptr, nullptr), Error);
  cuda::sample_tokens(nullptr, nullptr, 0, 10, nullptr, nullptr, nullptr);  // no rows: nothing to do
}

}  // namespace
}  // namespace kestrel::test
