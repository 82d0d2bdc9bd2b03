#include "spec/verifier.h"

#include <algorithm>
#include <string>

#include "core/error.h"

namespace kestrel {

namespace {

// The first candidate (in the list's order) at which the running total of `mass` passes
// uniform * total: an inverse-CDF draw over a non-negative weight per candidate.
template <typename Mass>
int32_t draw_from(std::span<const TokenCandidate> items, double uniform, Mass mass) {
  double total = 0.0;
  for (const TokenCandidate& c : items) total += mass(c);
  const double target = uniform * total;
  double cumulative = 0.0;
  int32_t last = items.empty() ? 0 : items[0].id;
  for (const TokenCandidate& c : items) {
    const double m = mass(c);
    if (m <= 0.0) continue;
    cumulative += m;
    last = c.id;
    if (target < cumulative) return c.id;
  }
  return last;  // target rounded up to the total: the last token with mass
}

}  // namespace

Verification verify_drafts(Sampler& sampler, std::span<const float> rows, std::span<const int32_t> sequence,
                           int64_t n_draft, size_t n_prompt, std::span<const float> q, int32_t n_logprobs) {
  KESTREL_ASSERT(n_draft >= 0 && static_cast<size_t>(n_draft) < sequence.size(), "verify_drafts: bad n_draft");
  KESTREL_ASSERT(rows.size() % static_cast<size_t>(n_draft + 1) == 0, "verify_drafts: rows not [n_draft + 1, n_vocab]");
  const size_t n_vocab = rows.size() / static_cast<size_t>(n_draft + 1);
  KESTREL_ASSERT(q.empty() || q.size() == static_cast<size_t>(n_draft) * n_vocab, "verify_drafts: q not [n_draft, n_vocab]");
  const size_t n_settled = sequence.size() - static_cast<size_t>(n_draft);
  KESTREL_ASSERT(n_prompt <= n_settled, "verify_drafts: n_prompt covers drafts");
  Verification v;
  for (int64_t i = 0; i <= n_draft; ++i) {
    const auto row = rows.subspan(static_cast<size_t>(i) * n_vocab, n_vocab);
    // Penalties count the tokens before this position: the settled ones and the drafts accepted.
    const auto previous = sequence.first(n_settled + static_cast<size_t>(i));
    int32_t token = 0;
    bool accepted = false;
    if (i == n_draft || q.empty()) {
      // The bonus token, or one-hot q: the sampler's own draw, compared with the draft.
      token = sampler.sample(row, previous, n_prompt);
      accepted = i < n_draft && token == sequence[n_settled + static_cast<size_t>(i)];
    } else {
      const int32_t x = sequence[n_settled + static_cast<size_t>(i)];
      const auto qrow = q.subspan(static_cast<size_t>(i) * n_vocab, n_vocab);
      const auto p = sampler.distribution(row, previous, n_prompt);
      double px = 0.0;
      for (const TokenCandidate& c : p)
        if (c.id == x) px = c.prob;
      const double qx = qrow[static_cast<size_t>(x)];
      // Accept when u < p(x) / q(x), written without the division: then a draft with p(x) = 0 is
      // never accepted, and one with q(x) = 0 (which a drafter should not propose) always is when
      // p(x) > 0.
      const double u = sampler.take_uniform();
      if (u * qx < px) {
        token = x;
        accepted = true;
      } else {
        // norm(max(0, p - q)): p is zero outside its candidates, so so is the residual.
        const auto residual = [&](const TokenCandidate& c) {
          return std::max(0.0, static_cast<double>(c.prob) - static_cast<double>(qrow[static_cast<size_t>(c.id)]));
        };
        double total = 0.0;
        for (const TokenCandidate& c : p) total += residual(c);
        const double u2 = sampler.take_uniform();
        // p == q leaves no residual mass, and then a rejection has probability 0 (p(x) >= q(x) for
        // every x): only rounding lands here, and p itself is the right law.
        token = total > 0.0 ? draw_from(p, u2, residual)
                            : draw_from(p, u2, [](const TokenCandidate& c) { return static_cast<double>(c.prob); });
      }
    }
    v.tokens.push_back(token);
    if (n_logprobs >= 0) v.logprobs.push_back(compute_logprobs(row, token, n_logprobs));
    if (!accepted) break;  // a correction or the bonus token ends the step
    ++v.n_accepted;
  }
  return v;
}

Verification accept_sampled_drafts(Sampler& sampler, std::span<const int32_t> sampled,
                                   std::span<const int32_t> drafts) {
  KESTREL_ASSERT(sampled.size() == drafts.size() + 1, "accept_sampled_drafts: sampled not [n_draft + 1]");
  KESTREL_ASSERT(sampler.device_compatible(), "accept_sampled_drafts: a chain that reads previous tokens");
  Verification v;
  for (size_t i = 0; i < sampled.size(); ++i) {
    if (sampled[i] < 0) throw NonFiniteLogitsError(NonFiniteLogitsError::Source::Model);
    sampler.take_uniform();  // the draw sample() would have made for this row
    v.tokens.push_back(sampled[i]);
    if (i == drafts.size() || sampled[i] != drafts[i]) break;
    ++v.n_accepted;
  }
  return v;
}

}  // namespace kestrel
