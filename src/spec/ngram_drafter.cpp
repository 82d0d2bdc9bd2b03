#include "spec/ngram_drafter.h"

#include <algorithm>
#include <string>

#include "core/error.h"

namespace kestrel {

NgramDrafter::NgramDrafter(int32_t min_n, int32_t max_n, int32_t adaptive_k)
    : min_n_(min_n), max_n_(max_n), adaptive_k_(adaptive_k) {
  if (adaptive_k < 0) throw Error("ngram drafter: negative draft limit " + std::to_string(adaptive_k));
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
    const DraftRequest& r = requests[i];
    int32_t n = r.max_drafts;
    SeqState* st = nullptr;
    if (adaptive_k_ > 0) {
      st = &seqs_[r.id];
      if (st->limit == 0) st->limit = adaptive_k_;
      n = std::min(n, st->limit);
    }
    out[i].ids = lookup(r.tokens, n);
    out[i].q.clear();
    if (st != nullptr) st->proposed = static_cast<int32_t>(out[i].ids.size());
  }
}

void NgramDrafter::on_verified(SeqId id, int64_t n_accepted, int64_t /*n_tokens*/) {
  if (adaptive_k_ <= 0) return;
  const auto it = seqs_.find(id);
  if (it == seqs_.end() || it->second.proposed == 0) return;
  SeqState& st = it->second;
  if (n_accepted >= st.proposed)
    st.limit = std::min<int32_t>(2 * st.limit, adaptive_k_);
  else
    st.limit = static_cast<int32_t>(n_accepted) + 1;
  st.proposed = 0;
}

int32_t NgramDrafter::limit(SeqId id) const {
  const auto it = seqs_.find(id);
  return it == seqs_.end() ? 0 : it->second.limit;
}

}  // namespace kestrel
