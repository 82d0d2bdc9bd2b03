#include "engine/beam_search.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/error.h"

namespace kestrel {

EarlyStopping parse_early_stopping(const std::string& s) {
  if (s == "false") return EarlyStopping::Heuristic;
  if (s == "true") return EarlyStopping::Done;
  if (s == "never") return EarlyStopping::Never;
  throw Error("early_stopping must be true, false or \"never\", got " + s);
}

const char* to_string(EarlyStopping e) {
  switch (e) {
    case EarlyStopping::Heuristic: return "false";
    case EarlyStopping::Done: return "true";
    case EarlyStopping::Never: return "never";
  }
  return "?";
}

void BeamSearchParams::validate() const {
  if (beam_width < 1 || beam_width > kMaxBeamWidth)
    throw Error("beam width must be in [1, " + std::to_string(kMaxBeamWidth) + "], got " + std::to_string(beam_width));
  if (n_best < 1 || n_best > beam_width)
    throw Error("beams returned (n) must be in [1, beam width " + std::to_string(beam_width) + "], got " +
                std::to_string(n_best));
  if (!std::isfinite(length_penalty)) throw Error("length_penalty must be finite");
}

BeamSearch::BeamSearch(const BeamSearchParams& params, std::vector<int32_t> stop_ids, int64_t max_new_tokens)
    : params_(params), stop_ids_(std::move(stop_ids)), max_new_tokens_(max_new_tokens) {
  params_.validate();
  KESTREL_ASSERT(max_new_tokens >= 1, "BeamSearch: max_new_tokens must be >= 1");
  live_.resize(1);  // the prompt: every first candidate continues it
}

bool BeamSearch::is_stop(int32_t token) const {
  return std::find(stop_ids_.begin(), stop_ids_.end(), token) != stop_ids_.end();
}

// Keeps the best beam_width hypotheses, best first; one added ranks after kept ones of equal score
// (transformers merges the kept slots before the step's candidates, and takes the first of a tie).
void BeamSearch::add_finished(BeamHypothesis h) {
  const auto at = std::upper_bound(finished_.begin(), finished_.end(), h.score,
                                   [](double s, const BeamHypothesis& x) { return s > x.score; });
  if (finished_.size() >= static_cast<size_t>(params_.beam_width) && at == finished_.end()) return;
  finished_.insert(at, std::move(h));
  if (finished_.size() > static_cast<size_t>(params_.beam_width)) finished_.pop_back();
}

// transformers' _check_early_stop_heuristic: can the best live beam still beat the worst kept
// hypothesis? Always while fewer than beam_width hypotheses are kept.
bool BeamSearch::can_improve(double best_live_sum, int64_t n_generated) const {
  if (finished_.size() < static_cast<size_t>(params_.beam_width)) return true;
  const double lp = params_.length_penalty;
  const int64_t len =
      params_.early_stopping == EarlyStopping::Never && lp > 0.0 ? max_new_tokens_ : n_generated;
  return best_live_sum / std::pow(static_cast<double>(len), lp) > finished_.back().score;
}

size_t BeamSearch::candidates_per_beam() const {
  return std::max<size_t>(2, 1 + stop_ids_.size()) * static_cast<size_t>(params_.beam_width);
}

std::vector<BeamSearch::Next> BeamSearch::step(std::span<const BeamRow> rows) {
  KESTREL_ASSERT(!done_, "BeamSearch: step after the search ended");
  KESTREL_ASSERT(rows.size() == live_.size(), "BeamSearch: one row per live beam");
  const size_t width = static_cast<size_t>(params_.beam_width);
  const size_t k = candidates_per_beam();
  struct Candidate {
    double sum;
    int32_t beam, token;
  };
  auto better = [](const Candidate& a, const Candidate& b) {
    if (a.sum != b.sum) return a.sum > b.sum;
    if (a.beam != b.beam) return a.beam < b.beam;
    return a.token < b.token;
  };
  // The best k over all beams are among each beam's best k.
  std::vector<Candidate> all;
  for (size_t b = 0; b < rows.size(); ++b) {
    KESTREL_ASSERT(rows[b].tokens.size() == rows[b].logprobs.size(), "BeamSearch: a row's ids and logprobs differ in size");
    for (size_t i = 0; i < rows[b].tokens.size(); ++i)
      all.push_back({live_[b].sum_logprobs + rows[b].logprobs[i], static_cast<int32_t>(b), rows[b].tokens[i]});
  }
  std::sort(all.begin(), all.end(), better);
  if (all.size() > k) all.resize(k);

  const int64_t n_generated = static_cast<int64_t>(live_.front().tokens.size()) + 1;
  const bool at_limit = n_generated >= max_new_tokens_;
  const double norm = std::pow(static_cast<double>(n_generated), params_.length_penalty);
  // Hypotheses: candidates among the best B that stop (a stop id, or the length limit), unless B
  // are kept already and early_stopping is true.
  const bool full = finished_.size() >= width;
  std::vector<BeamHypothesis> ended;
  for (size_t i = 0; i < std::min(width, all.size()); ++i) {
    const Candidate& c = all[i];
    if (!std::isfinite(c.sum) || !(at_limit || is_stop(c.token))) continue;
    if (full && params_.early_stopping == EarlyStopping::Done) continue;
    BeamHypothesis h;
    h.tokens = live_[static_cast<size_t>(c.beam)].tokens;
    h.tokens.push_back(c.token);
    h.sum_logprobs = c.sum;
    h.score = c.sum / norm;
    h.stopped = is_stop(c.token);
    ended.push_back(std::move(h));
  }
  for (BeamHypothesis& h : ended) add_finished(std::move(h));

  // The next live beams: the best B candidates that do not stop.
  std::vector<Next> next;
  std::vector<Live> live;
  if (!at_limit) {
    for (const Candidate& c : all) {
      if (next.size() == width) break;
      if (is_stop(c.token) || !std::isfinite(c.sum)) continue;  // a token of probability 0 continues nothing
      next.push_back({c.beam, c.token});
      Live l;
      l.tokens = live_[static_cast<size_t>(c.beam)].tokens;
      l.tokens.push_back(c.token);
      l.sum_logprobs = c.sum;
      live.push_back(std::move(l));
    }
  }
  live_ = std::move(live);
  const bool all_kept = finished_.size() >= width;
  done_ = at_limit || live_.empty() || (all_kept && params_.early_stopping == EarlyStopping::Done) ||
          !can_improve(live_.front().sum_logprobs, n_generated);
  if (done_) {
    live_.clear();
    next.clear();
  }
  return next;
}

std::vector<BeamHypothesis> BeamSearch::results() const {
  std::vector<BeamHypothesis> out(finished_.begin(),
                                  finished_.begin() + std::min<ptrdiff_t>(static_cast<ptrdiff_t>(finished_.size()),
                                                                          params_.n_best));
  return out;
}

bool top_logprobs(std::span<const float> logits, size_t k, BeamRow& out) {
  float mx = -std::numeric_limits<float>::infinity();
  for (const float x : logits) {
    if (std::isnan(x) || x == std::numeric_limits<float>::infinity()) return false;
    mx = std::max(mx, x);
  }
  if (!std::isfinite(mx)) return false;
  double sum = 0;
  for (const float x : logits) sum += static_cast<double>(std::exp(x - mx));
  const double lse = static_cast<double>(mx) + std::log(sum);
  // A bounded heap of (logit, id), the worst kept on top.
  using Item = std::pair<float, int32_t>;
  auto better = [](const Item& a, const Item& b) { return a.first != b.first ? a.first > b.first : a.second < b.second; };
  std::vector<Item> heap;
  heap.reserve(k + 1);
  for (size_t v = 0; v < logits.size(); ++v) {
    const Item it{logits[v], static_cast<int32_t>(v)};
    if (heap.size() < k) {
      heap.push_back(it);
      std::push_heap(heap.begin(), heap.end(), better);
    } else if (better(it, heap.front())) {
      std::pop_heap(heap.begin(), heap.end(), better);
      heap.back() = it;
      std::push_heap(heap.begin(), heap.end(), better);
    }
  }
  std::sort(heap.begin(), heap.end(), better);
  out.tokens.clear();
  out.logprobs.clear();
  for (const Item& it : heap) {
    out.tokens.push_back(it.second);
    out.logprobs.push_back(static_cast<double>(it.first) - lse);
  }
  return true;
}

}  // namespace kestrel
