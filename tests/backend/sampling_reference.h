// kestrel::Sampler's arithmetic for the chain top_k -> top_p -> min_p -> temperature -> draw
// (src/sampling/logits_processors.cpp, candidate_list.cpp, sampler.cpp), rewritten on plain vectors
// for the CUDA sampling test, which cannot link kestrel_lib. It keeps every rounding step of the CPU
// code (f64 exponentials, f32 probs, f64 running sums, the list order each processor leaves), and
// tests/unit/test_sampling.cpp checks that it picks the real Sampler's token for the same uniform.
// It also reports how close each float decision came to its boundary, so that a test can tell a
// real disagreement from rounding.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace kestrel::test {

struct ReferenceParams {
  float temperature = 1.0f;  // <= 0: greedy
  int32_t top_k = 0;
  float top_p = 1.0f;
  float min_p = 0.0f;
};

struct ReferenceDraw {
  int32_t token = -1;  // -1: a NaN logit, or no distribution (largest logit +inf or -inf)
  // Distance of the closest float decision to its boundary: the draw's target to the chosen
  // token's CDF step (relative to the total), the top_p prefix mass to top_p; 0 when a logit lies
  // within an ulp of the min_p threshold; +inf when nothing depended on rounding.
  double margin = std::numeric_limits<double>::infinity();
};

namespace reference_detail {

struct Item {
  int32_t id;
  float logit;
  float prob;
};

inline bool ranks_before(const Item& a, const Item& b) {
  return a.logit > b.logit || (a.logit == b.logit && a.id < b.id);
}

inline float max_logit(const std::vector<Item>& items) {
  float m = -std::numeric_limits<float>::infinity();
  for (const Item& c : items) m = std::max(m, c.logit);
  return m;
}

// CandidateList::softmax.
inline void softmax(std::vector<Item>& items) {
  const double max = max_logit(items);
  double sum = 0.0;
  for (Item& c : items) {
    const double e = std::exp(static_cast<double>(c.logit) - max);
    c.prob = static_cast<float>(e);
    sum += e;
  }
  const double inv = 1.0 / sum;
  for (Item& c : items) c.prob = static_cast<float>(c.prob * inv);
}

}  // namespace reference_detail

inline ReferenceDraw reference_sample(const float* logits, int64_t n, const ReferenceParams& p, double uniform) {
  using reference_detail::Item;
  ReferenceDraw out;
  for (int64_t i = 0; i < n; ++i)
    if (std::isnan(logits[i])) return out;
  if (!(p.temperature > 0.0f)) {  // argmax, lowest id on ties
    out.token = static_cast<int32_t>(std::max_element(logits, logits + n, [](float a, float b) { return a < b; }) - logits);
    return out;
  }
  std::vector<Item> items(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) items[static_cast<size_t>(i)] = Item{static_cast<int32_t>(i), logits[i], 0.0f};
  const float top = reference_detail::max_logit(items);
  if (!std::isfinite(top)) return out;

  if (p.top_k > 0 && static_cast<size_t>(p.top_k) < items.size()) {  // TopK: the k best, sorted
    std::sort(items.begin(), items.end(), reference_detail::ranks_before);
    items.resize(static_cast<size_t>(p.top_k));
  }
  if (p.top_p < 1.0f && items.size() > 1) {  // TopP: sorts the whole list, cuts the first prefix >= p
    reference_detail::softmax(items);
    std::sort(items.begin(), items.end(), reference_detail::ranks_before);
    double cum = 0.0;
    size_t keep = items.size();
    for (size_t i = 0; i < items.size(); ++i) {
      const double before = cum;
      cum += items[i].prob;
      if (cum >= p.top_p) {
        keep = i + 1;
        out.margin = std::min({out.margin, cum - p.top_p, p.top_p - before});
        break;
      }
    }
    if (keep == items.size()) out.margin = std::min(out.margin, std::fabs(p.top_p - cum));
    items.resize(keep);
  }
  if (p.min_p > 0.0f) {  // MinP: logit >= f32(max + ln(min_p)), order kept
    const float threshold =
        static_cast<float>(static_cast<double>(reference_detail::max_logit(items)) + std::log(double{p.min_p}));
    const float below = std::nextafter(threshold, -INFINITY), above = std::nextafter(threshold, INFINITY);
    for (int64_t i = 0; i < n; ++i)
      if (logits[i] >= below && logits[i] <= above) out.margin = 0.0;
    std::erase_if(items, [&](const Item& c) { return c.logit < threshold; });
  }
  if (p.temperature != 1.0f) {  // Temperature: (logit - max) / t, rounded to f32
    const double max = reference_detail::max_logit(items);
    const double inv_t = 1.0 / p.temperature;
    for (Item& c : items) c.logit = static_cast<float>((c.logit - max) * inv_t);
  }
  reference_detail::softmax(items);  // Sampler::draw
  double total = 0.0;
  for (const Item& c : items) total += c.prob;
  const double target = uniform * total;
  double cum = 0.0;
  for (const Item& c : items) {
    const double before = cum;
    cum += c.prob;
    if (target < cum) {
      out.token = c.id;
      out.margin = std::min({out.margin, (target - before) / total, (cum - target) / total});
      return out;
    }
  }
  for (size_t i = items.size(); i-- > 0;) {
    if (items[i].prob > 0.0f) {
      out.token = items[i].id;
      out.margin = 0.0;
      return out;
    }
  }
  out.token = items[0].id;
  out.margin = 0.0;
  return out;
}

}  // namespace kestrel::test
