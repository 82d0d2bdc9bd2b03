#include "model/moe_router.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"

namespace kestrel {

void moe_select(const float* logits, const MoeRouting& r, int32_t* ids, float* weights) {
  const int32_t n = r.n_expert, k = r.n_expert_used;
  KESTREL_ASSERT(n > 0 && k > 0 && k <= n, "moe_select: 0 < k <= n_expert");
  double mx = logits[0];
  for (int32_t e = 1; e < n; ++e) mx = std::max(mx, static_cast<double>(logits[e]));
  std::vector<double> p(static_cast<size_t>(n));
  double sum = 0;
  for (int32_t e = 0; e < n; ++e) sum += p[static_cast<size_t>(e)] = std::exp(logits[e] - mx);
  for (double& v : p) v /= sum;

  std::vector<bool> eligible(static_cast<size_t>(n), true);
  if (r.select == MoeRouting::Select::GroupLimited) {
    KESTREL_ASSERT(r.n_group > 0 && n % r.n_group == 0 && r.topk_group > 0 && r.topk_group <= r.n_group,
                   "moe_select: n_group divides n_expert, 0 < topk_group <= n_group");
    const int32_t per = n / r.n_group;
    std::vector<int32_t> groups(static_cast<size_t>(r.n_group));
    std::vector<double> score(static_cast<size_t>(r.n_group), -1.0);
    for (int32_t g = 0; g < r.n_group; ++g) {
      groups[static_cast<size_t>(g)] = g;
      for (int32_t e = g * per; e < (g + 1) * per; ++e)
        score[static_cast<size_t>(g)] = std::max(score[static_cast<size_t>(g)], p[static_cast<size_t>(e)]);
    }
    std::stable_sort(groups.begin(), groups.end(), [&](int32_t a, int32_t b) {
      return score[static_cast<size_t>(a)] > score[static_cast<size_t>(b)];
    });
    std::fill(eligible.begin(), eligible.end(), false);
    for (int32_t i = 0; i < r.topk_group; ++i) {
      const int32_t g = groups[static_cast<size_t>(i)];
      for (int32_t e = g * per; e < (g + 1) * per; ++e) eligible[static_cast<size_t>(e)] = true;
    }
  }
  std::vector<int32_t> order;
  for (int32_t e = 0; e < n; ++e)
    if (eligible[static_cast<size_t>(e)]) order.push_back(e);
  KESTREL_ASSERT(static_cast<int32_t>(order.size()) >= k, "moe_select: fewer eligible experts than k");
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return p[static_cast<size_t>(a)] > p[static_cast<size_t>(b)]; });
  double chosen = 0;
  for (int32_t i = 0; i < k; ++i) chosen += p[static_cast<size_t>(order[static_cast<size_t>(i)])];
  for (int32_t i = 0; i < k; ++i) {
    const int32_t e = order[static_cast<size_t>(i)];
    double w = p[static_cast<size_t>(e)];
    if (r.norm_topk) w /= chosen;
    ids[i] = e;
    weights[i] = static_cast<float>(w * r.routed_scale);
  }
}

}  // namespace kestrel
