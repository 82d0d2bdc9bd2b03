#include "spec/ngram_drafter.h"

#include <algorithm>
#include <string>

#include "core/error.h"

namespace kestrel {

NgramDrafter::NgramDrafter(int32_t min_n, int32_t max_n) : min_n_(min_n), max_n_(max_n) {
  if (min_n < 1 || max_n < min_n)
    throw Error("ngram drafter: prompt_lookup_min " + std::to_string(min_n) + " and prompt_lookup_max " +
                std::to_string(max_n) + " must satisfy 1 <= min <= max");
}

std::vector<int32_t> NgramDrafter::lookup(std::span<const int32_t> tokens, int32_t max_drafts) const {
  std::vector<int32_t> out;
  const int64_t len = static_cast<int64_t>(tokens.size());
  if (max_drafts <= 0) return out;
  for (int64_t n = std::min<int64_t>(max_n_, len - 1); n >= min_n_; --n) {
    const auto suffix = tokens.subspan(static_cast<size_t>(len - n));
    // Candidate starts from the most recent (len - n - 1) back to 0; a match must end before the
    // suffix's own last position, so it has at least one token after it.
    for (int64_t start = len - n - 1; start >= 0; --start) {
      if (!std::equal(suffix.begin(), suffix.end(), tokens.begin() + start)) continue;
      // Copy what followed; past the end of `tokens`, continue from the proposal itself.
      const int64_t from = start + n;
      for (int64_t i = 0; i < max_drafts; ++i) {
        const int64_t src = from + i;
        out.push_back(src < len ? tokens[static_cast<size_t>(src)] : out[static_cast<size_t>(src - len)]);
      }
      return out;
    }
  }
  return out;
}

void NgramDrafter::propose(std::span<const DraftRequest> requests, std::vector<Draft>& out) {
  out.resize(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    out[i].ids = lookup(requests[i].tokens, requests[i].max_drafts);
    out[i].q.clear();
  }
}

}  // namespace kestrel
