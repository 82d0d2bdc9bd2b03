// Token masks of the engine's sampling rows (structured output, min_tokens) and the grammar
// matchers' side of a step: masks filled, and device-sampled tokens accepted, in parallel.
#include <algorithm>
#include <atomic>
#include <functional>

#include "engine/engine.h"
#include "engine/engine_impl.h"
#include "sampling/grammar/matcher.h"

namespace kestrel {

using engine_detail::RequestState;

void Engine::Impl::fill_token_mask(RequestState& r, std::span<uint32_t> mask) const {
  if (r.matcher) r.matcher->fill_next_token_bitmask(mask);
  else std::fill(mask.begin(), mask.end(), ~0u);
  if (!r.bans_stop_ids()) return;
  for (const int32_t id : r.req.stop_ids)
    mask[static_cast<size_t>(id) / 32] &= ~(1u << (static_cast<uint32_t>(id) % 32));
  const auto n_vocab = static_cast<size_t>(model.hparams().n_vocab);
  for (size_t w = 0; w < mask.size(); ++w) {
    const size_t bits = std::min<size_t>(32, n_vocab - w * 32);
    const uint32_t valid = bits == 32 ? ~0u : (1u << bits) - 1;
    if ((mask[w] & valid) != 0) return;
  }
  // A row with no token left could not be sampled at all: min_tokens then yields (a grammar that
  // can only end here ends it; stop ids that cover the vocabulary stop at once). Rare: refill.
  if (r.matcher) r.matcher->fill_next_token_bitmask(mask);
  else std::fill(mask.begin(), mask.end(), ~0u);
}

void Engine::Impl::for_each_grammar_row(size_t n, const std::function<void(size_t)>& fn) {
  if (n < 2) {
    for (size_t i = 0; i < n; ++i) fn(i);
    return;
  }
  if (!mask_pool) mask_pool = std::make_unique<ThreadPool>(config.n_threads);
  std::atomic<size_t> next{0};
  mask_pool->run([&](int, int) {
    for (size_t i = next.fetch_add(1, std::memory_order_relaxed); i < n; i = next.fetch_add(1, std::memory_order_relaxed))
      fn(i);
  });
}

void Engine::Impl::fill_token_masks(const Pass& p, std::span<uint32_t> masks) {
  const size_t words = grammar::bitmask_words(static_cast<int32_t>(model.hparams().n_vocab));
  grammar_rows.clear();
  for (const SampleRow& sr : p.sampling)
    if (sr.r->masks_row()) grammar_rows.push_back(&sr);
  for_each_grammar_row(grammar_rows.size(), [&](size_t i) {
    const SampleRow& sr = *grammar_rows[i];
    fill_token_mask(*sr.r, masks.subspan(static_cast<size_t>(sr.row) * words, words));
  });
}

void Engine::Impl::accept_device_tokens(const Pass& p, std::span<const int32_t> device_tokens,
                                        const std::vector<bool>& skip) {
  grammar_accepted.assign(p.sampling.size(), -1);
  grammar_row_index.clear();
  for (size_t i = 0; i < p.sampling.size(); ++i)
    if (!skip[i] && p.sampling[i].r->matcher && p.sampling[i].n_draft == 0) grammar_row_index.push_back(i);
  for_each_grammar_row(grammar_row_index.size(), [&](size_t k) {
    const size_t i = grammar_row_index[k];
    RequestState& r = *p.sampling[i].r;
    const int32_t token = device_tokens[static_cast<size_t>(p.sampling[i].row)];
    bool ok = false;
    if (token >= 0) {  // a non-finite row (-1) ends its request in finish_pass
      try {
        ok = r.matcher->accept_token(token);
      } catch (const Error&) {
        ok = false;
      }
    }
    if (ok) r.grammar_ended = r.matcher->is_terminated();
    grammar_accepted[i] = ok ? 1 : 0;
  });
}

}  // namespace kestrel
