// Token masks of the engine's sampling rows (structured output, min_tokens, allowed_token_ids,
// bad_words) and the grammar matchers' side of a step: masks filled, and device-sampled tokens
// accepted, in parallel.
#include <algorithm>
#include <atomic>
#include <functional>
#include <span>
#include <thread>
#include <vector>

#include "engine/engine.h"
#include "engine/engine_impl.h"
#include "sampling/grammar/matcher.h"

namespace kestrel {

using engine_detail::RequestState;

namespace {

// Threads of the mask pool (the engine thread included), and of the split prefetcher. A step's
// grammar rows take ~1-6 us each to fill or accept, so four threads finish even hundreds well
// inside a GPU step; more only add wake-ups and spinning workers beside the engine thread. At 64
// JSON-schema rows on an H100 host (16 cores; docs/performance.md) 1, 2 and 4 threads gave the
// same throughput and 16 no better.
constexpr int kMaxMaskThreads = 4;

void clear_bit(std::span<uint32_t> mask, int32_t id) {
  mask[static_cast<size_t>(id) / 32] &= ~(1u << (static_cast<uint32_t>(id) % 32));
}

// True when no id below n_vocab is left in mask (the bits past n_vocab in the last word are not read).
bool no_token_left(std::span<const uint32_t> mask, size_t n_vocab) {
  for (size_t w = 0; w < mask.size(); ++w) {
    const size_t bits = std::min<size_t>(32, n_vocab - w * 32);
    const uint32_t valid = bits == 32 ? ~0u : (1u << bits) - 1;
    if ((mask[w] & valid) != 0) return false;
  }
  return true;
}

// vLLM's bad-words rule (v1/sample/ops/bad_words.py): a word's last id is banned where the
// generated tokens end with the word's other ids (a one-token word: always).
void ban_bad_words(const RequestState& r, std::span<uint32_t> mask) {
  const std::span<const int32_t> tokens(r.seq.tokens);
  const auto generated = tokens.subspan(static_cast<size_t>(r.seq.n_prompt));
  for (const std::vector<int32_t>& word : r.req.bad_words) {
    const size_t n_prefix = word.size() - 1;
    if (n_prefix > generated.size()) continue;
    if (std::equal(word.begin(), word.end() - 1, generated.end() - static_cast<std::ptrdiff_t>(n_prefix)))
      clear_bit(mask, word.back());
  }
}

}  // namespace

void Engine::Impl::fill_token_mask(RequestState& r, std::span<uint32_t> mask) const {
  const auto n_vocab = static_cast<size_t>(model.hparams().n_vocab);
  const auto fill = [&] {
    if (r.matcher) {
      // Runs on the mask threads too: a grammar too ambiguous to match (GrammarError) empties the
      // mask and is kept for finish_pass, which ends the request with it.
      try {
        r.matcher->fill_next_token_bitmask(mask);
      } catch (const Error& e) {
        if (r.grammar_error.empty()) r.grammar_error = e.what();
        std::fill(mask.begin(), mask.end(), 0u);
      }
    } else {
      std::fill(mask.begin(), mask.end(), ~0u);
    }
    if (!r.allowed_mask.empty())
      for (size_t w = 0; w < mask.size(); ++w) mask[w] &= r.allowed_mask[w];
    if (!r.req.bad_words.empty()) ban_bad_words(r, mask);
  };
  fill();
  if (r.bans_stop_ids()) {
    for (const int32_t id : r.req.stop_ids) clear_bit(mask, id);
    // A row with no token left could not be sampled at all: min_tokens then yields (a grammar that
    // can only end here ends it; stop ids that cover the allowed tokens stop at once). Rare: refill.
    if (no_token_left(mask, n_vocab)) fill();
  }
  r.mask_empty = no_token_left(mask, n_vocab);
}

std::span<const float> Engine::Impl::masked_logits(RequestState& r, std::span<const float> row) const {
  fill_token_mask(r, r.token_mask);
  if (!r.grammar_error.empty()) throw grammar::GrammarError("grammar", r.grammar_error);
  if (r.mask_empty) throw engine_detail::NoTokenAllowedError();
  r.masked_row.assign(row.begin(), row.end());
  grammar::apply_token_bitmask(r.masked_row, r.token_mask);
  return r.masked_row;
}

int Engine::Impl::mask_threads() const {
  const int n = config.n_threads > 0 ? config.n_threads
                                     : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return std::min(n, kMaxMaskThreads);
}

void Engine::Impl::start_grammar(RequestState& r, const std::shared_ptr<const grammar::CompiledGrammar>& g) {
  r.matcher.emplace(g);
  if (!split_prefetcher)
    split_prefetcher =
        std::make_unique<grammar::SplitPrefetcher>(grammar::CompiledGrammar::kPrecomputeStacks, mask_threads());
  split_prefetcher->add(g);
}

void Engine::Impl::for_each_grammar_row(size_t n, const std::function<void(size_t)>& fn) {
  if (n < 2) {
    for (size_t i = 0; i < n; ++i) fn(i);
    return;
  }
  if (!mask_pool) mask_pool = std::make_unique<ThreadPool>(mask_threads());
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
      } catch (const Error& e) {
        ok = false;
        if (r.grammar_error.empty()) r.grammar_error = e.what();  // finish_pass ends the request with it
      }
    }
    if (ok) r.grammar_ended = r.matcher->is_terminated();
    grammar_accepted[i] = ok ? 1 : 0;
  });
}

}  // namespace kestrel
