#include "sampling/logprobs.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/error.h"

namespace kestrel {

LogprobSummary compute_logprobs(std::span<const float> logits, int32_t token, int32_t n_top) {
  KESTREL_ASSERT(token >= 0 && static_cast<size_t>(token) < logits.size(),
                 "logprob token id out of range");
  const double max = *std::max_element(logits.begin(), logits.end());
  KESTREL_ASSERT(std::isfinite(max), "logits have no finite maximum");
  double sum = 0.0;
  const float given = logits[static_cast<size_t>(token)];
  int32_t above = 0;
  for (float l : logits) {
    sum += std::exp(static_cast<double>(l) - max);
    above += l > given;
  }
  const double log_z = max + std::log(sum);
  auto logprob = [&](int32_t id) { return static_cast<float>(logits[id] - log_z); };

  LogprobSummary out;
  out.chosen = TokenLogprob{token, logprob(token)};
  out.chosen_rank = above + 1;
  const size_t n = std::min(static_cast<size_t>(std::max(n_top, 0)), logits.size());
  if (n == 0) return out;
  std::vector<int32_t> ids(logits.size());
  std::iota(ids.begin(), ids.end(), 0);
  std::partial_sort(ids.begin(), ids.begin() + static_cast<ptrdiff_t>(n), ids.end(),
                    [&](int32_t a, int32_t b) {
                      return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
                    });
  out.top.reserve(n);
  for (size_t i = 0; i < n; ++i) out.top.push_back(TokenLogprob{ids[i], logprob(ids[i])});
  return out;
}

}  // namespace kestrel
