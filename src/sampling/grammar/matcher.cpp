// Pushdown matching of grammar.h grammars over token bytes, and the token masks.
#include "sampling/grammar/matcher.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <system_error>
#include <unordered_map>

#include "tokenizer/tokenizer.h"

namespace kestrel::grammar {

std::shared_ptr<const TokenVocab> TokenVocab::from_bytes(std::vector<std::string> bytes, int32_t eos_id) {
  auto v = std::make_shared<TokenVocab>();
  v->n_vocab = static_cast<int32_t>(bytes.size());
  v->eos_id = eos_id;
  if (eos_id >= 0 && eos_id < v->n_vocab) bytes[static_cast<size_t>(eos_id)].clear();
  v->bytes = std::move(bytes);
  for (int32_t id = 0; id < v->n_vocab; ++id)
    if (!v->bytes[static_cast<size_t>(id)].empty()) v->sorted.push_back(id);
  std::sort(v->sorted.begin(), v->sorted.end(), [&](int32_t a, int32_t b) {
    const auto& x = v->bytes[static_cast<size_t>(a)];
    const auto& y = v->bytes[static_cast<size_t>(b)];
    return x != y ? x < y : a < b;
  });
  v->sorted_offset.reserve(v->sorted.size() + 1);
  for (int32_t id : v->sorted) {
    v->sorted_offset.push_back(static_cast<uint32_t>(v->sorted_bytes.size()));
    v->sorted_bytes += v->bytes[static_cast<size_t>(id)];
  }
  v->sorted_offset.push_back(static_cast<uint32_t>(v->sorted_bytes.size()));
  v->lcp.assign(v->sorted.size(), 0);
  for (size_t i = 1; i < v->sorted.size(); ++i) {
    const auto& x = v->bytes[static_cast<size_t>(v->sorted[i - 1])];
    const auto& y = v->bytes[static_cast<size_t>(v->sorted[i])];
    uint32_t k = 0;
    while (k < x.size() && k < y.size() && x[k] == y[k]) ++k;
    v->lcp[i] = k;
  }
  return v;
}

std::shared_ptr<const TokenVocab> TokenVocab::from_tokenizer(const Tokenizer& tok) {
  std::vector<std::string> bytes(static_cast<size_t>(tok.n_vocab()));
  for (int32_t id = 0; id < tok.n_vocab(); ++id)
    if (!tok.is_special(id)) bytes[static_cast<size_t>(id)] = tok.token_to_piece(id);
  return from_bytes(std::move(bytes), tok.eos_id());
}

void apply_token_bitmask(std::span<float> logits, std::span<const uint32_t> mask) {
  const float ninf = -std::numeric_limits<float>::infinity();
  for (size_t w = 0; w < mask.size(); ++w) {
    uint32_t blocked = ~mask[w];
    while (blocked != 0) {
      size_t id = w * 32 + static_cast<size_t>(std::countr_zero(blocked));
      blocked &= blocked - 1;
      if (id < logits.size()) logits[id] = ninf;
    }
  }
}

// ---- stacks ----------------------------------------------------------------------------------

int32_t StackPool::intern(uint32_t pos, int32_t parent) {
  if ((used_ + 1) * 2 > table_.size()) {  // grow to keep the load under one half
    std::vector<int32_t> old = std::move(table_);
    table_.assign(std::max<size_t>(1024, old.size() * 2), -1);
    for (int32_t id : old)
      if (id >= 0) {
        const Node& n = nodes_[static_cast<size_t>(id)];
        size_t mask = table_.size() - 1;
        size_t h = (static_cast<size_t>(n.pos) * 0x9E3779B97F4A7C15ull ^ static_cast<size_t>(n.parent + 1)) * 0xBF58476D1CE4E5B9ull;
        for (size_t i = (h >> 17) & mask;; i = (i + 1) & mask)
          if (table_[i] < 0) {
            table_[i] = id;
            break;
          }
      }
  }
  size_t mask = table_.size() - 1;
  size_t h = (static_cast<size_t>(pos) * 0x9E3779B97F4A7C15ull ^ static_cast<size_t>(parent + 1)) * 0xBF58476D1CE4E5B9ull;
  for (size_t i = (h >> 17) & mask;; i = (i + 1) & mask) {
    int32_t id = table_[i];
    if (id < 0) {
      id = static_cast<int32_t>(nodes_.size());
      nodes_.push_back({pos, parent});
      table_[i] = id;
      ++used_;
      return id;
    }
    const Node& n = nodes_[static_cast<size_t>(id)];
    if (n.pos == pos && n.parent == parent) return id;
  }
}

void StackPool::expand(uint32_t pos0, int32_t parent0, std::vector<int32_t>* out, bool* completed) {
  // Depth first with an explicit stack (nested rules and ends can chain as deep as a grammar's
  // longest repetition), alternatives in order, as a recursive walk would take them.
  work_.clear();
  work_.push_back({pos0, parent0});
  while (!work_.empty()) {
    const auto [pos, parent] = work_.back();
    work_.pop_back();
    const Element& e = g_.elements[pos];
    if (e.kind == ElementKind::CLASS) {
      out->push_back(intern(pos, parent));
      continue;
    }
    if (e.kind == ElementKind::END) {
      if (parent < 0) {
        *completed = true;
        continue;
      }
      const Node n = nodes_[static_cast<size_t>(parent)];
      work_.push_back({n.pos, n.parent});
      continue;
    }
    // A rule reference: its alternatives continue into the element after it (dropped when that
    // is the end of this alternative, so right recursion keeps the stack flat).
    const int32_t cont = g_.elements[pos + 1].kind == ElementKind::END ? parent : intern(pos + 1, parent);
    const int32_t self = intern(pos, parent);
    if (visited_.size() <= static_cast<size_t>(self)) visited_.resize(nodes_.size() * 2, 0);
    if (visited_[static_cast<size_t>(self)] == epoch_) continue;
    visited_[static_cast<size_t>(self)] = epoch_;
    const std::vector<uint32_t>& alts = g_.rules[e.index].alternatives;
    for (auto a = alts.rbegin(); a != alts.rend(); ++a) work_.push_back({*a, cont});
  }
}

void StackPool::finish_tops(std::vector<int32_t>* out) const {
  std::sort(out->begin(), out->end());
  out->erase(std::unique(out->begin(), out->end()), out->end());
  if (out->size() > kMaxStacks)
    throw GrammarError("grammar", "grammar: more than " + std::to_string(kMaxStacks) +
                                      " ways to parse the text at one point (a repetition of a repetition?); "
                                      "the grammar is too ambiguous to match in bounded time");
}

void StackPool::start(std::vector<int32_t>* out, bool* completed) {
  ++epoch_;
  out->clear();
  for (uint32_t a : g_.rules[g_.root].alternatives) expand(a, -1, out, completed);
  finish_tops(out);
}

void StackPool::step(std::span<const int32_t> tops, uint32_t cp, std::vector<int32_t>* out, bool* completed) {
  ++epoch_;
  out->clear();
  for (int32_t id : tops) {
    const Node n = nodes_[static_cast<size_t>(id)];
    if (g_.classes[g_.elements[n.pos].index].contains(cp)) expand(n.pos + 1, n.parent, out, completed);
  }
  finish_tops(out);
}

void StackPool::advance(int32_t top, std::vector<int32_t>* out, bool* completed) {
  ++epoch_;
  out->clear();
  const Node n = nodes_[static_cast<size_t>(top)];
  expand(n.pos + 1, n.parent, out, completed);
  finish_tops(out);
}

bool step_byte(StackPool& pool, const MatchState& in, uint8_t byte, MatchState* out) {
  out->completed_before = in.completed_before || in.completed;
  out->completed = false;
  uint32_t cp = 0;
  if (in.remaining == 0) {
    if (byte < 0x80) {
      cp = byte;
    } else {
      uint8_t rem;
      if (byte >= 0xC2 && byte <= 0xDF) {
        out->partial = byte & 0x1Fu;
        rem = 1;
      } else if (byte >= 0xE0 && byte <= 0xEF) {
        out->partial = byte & 0x0Fu;
        rem = 2;
      } else if (byte >= 0xF0 && byte <= 0xF4) {
        out->partial = byte & 0x07u;
        rem = 3;
      } else {
        return false;
      }
      out->remaining = rem;
      out->seen = 1;
    }
  } else {
    if ((byte & 0xC0) != 0x80) return false;
    if (in.seen == 1) {  // the second byte bounds overlong forms, surrogates and > U+10FFFF
      uint32_t lead = in.partial;
      if (in.remaining == 2 && lead == 0x0 && byte < 0xA0) return false;
      if (in.remaining == 2 && lead == 0xD && byte > 0x9F) return false;
      if (in.remaining == 3 && lead == 0x0 && byte < 0x90) return false;
      if (in.remaining == 3 && lead == 0x4 && byte > 0x8F) return false;
    }
    uint32_t v = (in.partial << 6) | (byte & 0x3Fu);
    if (in.remaining > 1) {
      out->partial = v;
      out->remaining = static_cast<uint8_t>(in.remaining - 1);
      out->seen = static_cast<uint8_t>(in.seen + 1);
    } else {
      cp = v;
      out->remaining = 0;
    }
  }
  if ((in.remaining == 0 && byte >= 0x80) || in.remaining > 1) {
    // Still inside a character: keep the stacks whose class holds some code point it can become.
    // Code points it can still become: the bits so far, any continuation bits, and no fewer than
    // the smallest code point of its length (shorter ones would be overlong forms).
    uint32_t shift = 6u * out->remaining;
    uint32_t total = static_cast<uint32_t>(out->seen) + out->remaining;
    uint32_t min_cp = total == 2 ? 0x80u : total == 3 ? 0x800u : 0x10000u;
    uint32_t lo = std::max(out->partial << shift, min_cp), hi = std::min((out->partial << shift) | ((1u << shift) - 1), 0x10FFFFu);
    out->tops.clear();
    for (int32_t id : in.tops) {
      const auto& n = pool.node(id);
      if (pool.grammar().classes[pool.grammar().elements[n.pos].index].intersects(lo, hi)) out->tops.push_back(id);
    }
    return true;
  }
  out->partial = 0;
  out->remaining = 0;
  out->seen = 0;
  pool.step(in.tops, cp, &out->tops, &out->completed);
  return true;
}

// ---- vocabulary walks ------------------------------------------------------------------------

namespace {

// Visits `ids` (in byte order, lcp[i] = common prefix with ids[i - 1]) from state `init`, sharing
// the steps of common prefixes. on_token(id, final) gets the state after the whole token, or
// nullptr when a prefix died (`dead` says when a state cannot go on).
template <class Dead, class OnToken>
void walk(StackPool& pool, const MatchState& init, std::span<const int32_t> ids, std::span<const uint32_t> lcp,
          const TokenVocab& vocab, std::vector<MatchState>& states, Dead dead, OnToken on_token) {
  if (states.empty()) states.resize(1);
  states[0] = init;
  size_t have = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    const std::string& b = vocab.bytes[static_cast<size_t>(ids[i])];
    if (i > 0) have = std::min<size_t>(have, lcp[i]);
    if (states.size() < b.size() + 1) states.resize(b.size() + 1);
    bool died = false;
    while (have < b.size()) {
      MatchState& next = states[have + 1];
      if (!step_byte(pool, states[have], static_cast<uint8_t>(b[have]), &next) || dead(next)) {
        died = true;
        break;
      }
      ++have;
    }
    if (!died) {
      on_token(ids[i], &states[b.size()]);
      continue;
    }
    on_token(ids[i], nullptr);
    // Every following token with the same first have + 1 bytes dies too.
    while (i + 1 < ids.size() && lcp[i + 1] >= have + 1) on_token(ids[++i], nullptr);
  }
}

// Interned states and their transitions by byte, for a walk over the whole vocabulary: most steps
// (a character inside a string, say) lead back to a state already seen, and then cost one lookup.
class StateTable {
 public:
  explicit StateTable(StackPool& pool) : pool_(pool) {}
  int32_t intern(const MatchState& s) {
    std::string key(reinterpret_cast<const char*>(s.tops.data()), s.tops.size() * sizeof(int32_t));
    key.append(reinterpret_cast<const char*>(&s.partial), sizeof s.partial);
    key += static_cast<char>(s.remaining);
    key += static_cast<char>(s.seen);
    key += static_cast<char>((s.completed ? 1 : 0) | (s.completed_before ? 2 : 0));
    auto [it, fresh] = index_.try_emplace(std::move(key), static_cast<int32_t>(states_.size()));
    if (fresh) {
      states_.push_back(s);
      trans_.resize(trans_.size() + 256, kUnknown);
    }
    return it->second;
  }
  const MatchState& state(int32_t id) const { return states_[static_cast<size_t>(id)]; }
  // The state after `byte`, or -1 when none (or a dead one) follows.
  template <class Dead>
  int32_t next(int32_t id, uint8_t byte, Dead dead) {
    const size_t at = static_cast<size_t>(id) * 256 + byte;
    if (trans_[at] != kUnknown) return trans_[at];
    int32_t r = -1;
    if (step_byte(pool_, states_[static_cast<size_t>(id)], byte, &tmp_) && !dead(tmp_)) r = intern(tmp_);
    trans_[at] = r;  // after intern, which may have grown trans_
    return r;
  }

 private:
  static constexpr int32_t kUnknown = -2;
  StackPool& pool_;
  std::vector<MatchState> states_;
  std::unordered_map<std::string, int32_t> index_;
  // [state * 256 + byte]: the state after that byte, -1 none, kUnknown not stepped yet. A walk
  // meets tens to a few thousand states, and this lookup is its innermost step.
  std::vector<int32_t> trans_;
  MatchState tmp_;
};

// walk() over interned states (see StateTable), over the whole vocabulary in byte order, its bytes
// read from TokenVocab's contiguous copy (sorted_bytes).
template <class Dead, class OnToken>
void walk_memo(StateTable& table, int32_t init, const TokenVocab& vocab, Dead dead, OnToken on_token) {
  const std::span<const int32_t> ids = vocab.sorted;
  const std::span<const uint32_t> lcp = vocab.lcp;
  std::vector<int32_t> sid(1, init);
  size_t have = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    const std::string_view b(vocab.sorted_bytes.data() + vocab.sorted_offset[i],
                             vocab.sorted_offset[i + 1] - vocab.sorted_offset[i]);
    if (i > 0) have = std::min<size_t>(have, lcp[i]);
    if (sid.size() < b.size() + 1) sid.resize(b.size() + 1);
    bool died = false;
    while (have < b.size()) {
      const int32_t n = table.next(sid[have], static_cast<uint8_t>(b[have]), dead);
      if (n < 0) {
        died = true;
        break;
      }
      sid[++have] = n;
    }
    if (!died) {
      on_token(ids[i], &table.state(sid[b.size()]));
      continue;
    }
    on_token(ids[i], nullptr);
    while (i + 1 < ids.size() && lcp[i + 1] >= have + 1) on_token(ids[++i], nullptr);
  }
}

bool runtime_dead(const MatchState& s) { return s.tops.empty() && !s.completed; }

void set_bit(std::span<uint32_t> mask, int32_t id) {
  mask[static_cast<size_t>(id) / 32] |= 1u << (static_cast<uint32_t>(id) % 32);
}

}  // namespace

CompiledGrammar::CompiledGrammar(Grammar g, std::shared_ptr<const TokenVocab> vocab, uint32_t chain_cap)
    : grammar_(std::move(g)), vocab_(std::move(vocab)), chain_cap_(chain_cap) {
  const size_t n = grammar_.elements.size();
  key_pos_.resize(n);
  for (size_t p = 0; p < n; ++p) key_pos_[p] = static_cast<uint32_t>(p);
  capped_.assign(n, 0);
  if (chain_cap_ < 2) return;  // R_1's layout differs from the other links'
  for (const auto& chain : grammar_.chains) {
    if (chain.size() <= chain_cap_) continue;
    const Rule& cap_rule = grammar_.rules[chain[chain_cap_ - 1]];
    for (size_t d = chain_cap_; d <= chain.size(); ++d) {
      const Rule& r = grammar_.rules[chain[d - 1]];
      KESTREL_ASSERT(r.alternatives.size() == cap_rule.alternatives.size(), "grammar: chain links differ");
      for (size_t a = 0; a < r.alternatives.size(); ++a) {
        for (uint32_t p = r.alternatives[a], q = cap_rule.alternatives[a];; ++p, ++q) {
          KESTREL_ASSERT(grammar_.elements[p].kind == grammar_.elements[q].kind, "grammar: chain links differ");
          key_pos_[p] = q;
          capped_[p] = 1;
          if (grammar_.elements[p].kind == ElementKind::END) break;
        }
      }
    }
  }
}

const CompiledGrammar::PositionMasks& CompiledGrammar::position_masks(std::span<const uint32_t> frames) const {
  std::string key(reinterpret_cast<const char*>(frames.data()), frames.size() * sizeof(uint32_t));
  Split* split = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto& slot = masks_[key];
    if (!slot) slot = std::make_unique<Split>();
    split = slot.get();  // stable: entries are never erased and the map holds them by pointer
  }
  std::call_once(split->once, [&] { compute_split(frames, &split->masks); });
  return split->masks;
}

const CompiledGrammar::PositionMasks& CompiledGrammar::position_masks(const StackPool& pool, int32_t top) const {
  uint32_t frames[kKeyFrames];
  size_t n = 0;
  for (int32_t at = top; at >= 0 && n < kKeyFrames; at = pool.node(at).parent) frames[n++] = key_pos_[pool.node(at).pos];
  return position_masks(std::span<const uint32_t>(frames, n));
}

size_t CompiledGrammar::precompute_splits(size_t max_stacks, const std::atomic<bool>* stop) const {
  StackPool pool(grammar_);
  std::vector<int32_t> frontier, next, out;
  std::vector<uint8_t> seen;  // by node id
  bool completed = false;
  const auto first_visit = [&](int32_t id) {
    if (seen.size() <= static_cast<size_t>(id)) seen.resize(2 * static_cast<size_t>(id) + 64, 0);
    if (seen[static_cast<size_t>(id)] != 0) return false;
    seen[static_cast<size_t>(id)] = 1;
    return true;
  };
  pool.start(&frontier, &completed);
  for (int32_t id : frontier) first_visit(id);
  size_t visited = 0;
  while (!frontier.empty()) {
    next.clear();
    for (int32_t id : frontier) {
      if (visited == max_stacks || (stop != nullptr && stop->load(std::memory_order_relaxed))) return visited;
      ++visited;
      position_masks(pool, id);
      pool.advance(id, &out, &completed);
      for (int32_t s : out)
        if (first_visit(s)) next.push_back(s);
    }
    std::swap(frontier, next);
  }
  return visited;
}

SplitPrefetcher::~SplitPrefetcher() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (std::thread& t : threads_) t.join();
}

void SplitPrefetcher::add(std::shared_ptr<const CompiledGrammar> g) {
  if (!g || !g->claim_precompute()) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(g));
    if (idle_ == 0 && static_cast<int>(threads_.size()) < max_threads_) {
      try {
        threads_.emplace_back([this] { run(); });
      } catch (const std::system_error&) {
        // No thread to be had: the ones running take the grammar (or its masks compute its splits).
      }
    }
  }
  cv_.notify_one();
}

void SplitPrefetcher::run() {
  for (;;) {
    std::shared_ptr<const CompiledGrammar> g;
    {
      std::unique_lock<std::mutex> lock(mu_);
      ++idle_;
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      --idle_;
      if (stop_) return;
      g = std::move(queue_.front());
      queue_.pop_front();
    }
    try {
      g->precompute_splits(max_stacks_, &stop_);
    } catch (const std::exception&) {
      // Out of memory, say: the splits not computed here are computed when a mask needs them.
    }
  }
}

void CompiledGrammar::compute_split(std::span<const uint32_t> frames, PositionMasks* pm) const {
  pm->accepted.assign((static_cast<size_t>(vocab_->n_vocab) + 63) / 64, 0);
  StackPool pool(grammar_);
  MatchState init;
  int32_t node = -1;
  for (size_t i = frames.size(); i-- > 0;) node = pool.intern(frames[i], node);
  init.tops = {node};
  // A capped link stands for every link beyond it: a token long enough to run past its last
  // repetition may still fit a longer link, so unless it is accepted here it is uncertain.
  bool capped = false;
  for (uint32_t f : frames) capped |= capped_[f] != 0;
  StateTable table(pool);
  walk_memo(table, table.intern(init), *vocab_, [](const MatchState& s) { return s.dead(); },
       [&](int32_t id, const MatchState* s) {
         if (s == nullptr) {
           if (capped && vocab_->bytes[static_cast<size_t>(id)].size() >= chain_cap_) pm->uncertain.push_back(id);
           return;
         }
         if (!s->tops.empty() || s->completed) {
           pm->accepted[static_cast<size_t>(id) / 64] |= 1ull << (id % 64);
         } else if (s->completed_before) {
           pm->uncertain.push_back(id);
         }
       });
  size_t n_accepted = 0;
  for (uint64_t w : pm->accepted) n_accepted += static_cast<size_t>(std::popcount(w));
  if (n_accepted * 32 < static_cast<size_t>(vocab_->n_vocab)) {
    pm->accepted_ids.reserve(n_accepted);
    for (size_t w = 0; w < pm->accepted.size(); ++w)
      for (uint64_t bits = pm->accepted[w]; bits != 0; bits &= bits - 1)
        pm->accepted_ids.push_back(static_cast<int32_t>(w * 64 + static_cast<size_t>(std::countr_zero(bits))));
    pm->accepted = {};
  }
  pm->uncertain_lcp.assign(pm->uncertain.size(), 0);
  for (size_t i = 1; i < pm->uncertain.size(); ++i) {
    const auto& x = vocab_->bytes[static_cast<size_t>(pm->uncertain[i - 1])];
    const auto& y = vocab_->bytes[static_cast<size_t>(pm->uncertain[i])];
    uint32_t k = 0;
    while (k < x.size() && k < y.size() && x[k] == y[k]) ++k;
    pm->uncertain_lcp[i] = k;
  }
}

// ---- matcher ---------------------------------------------------------------------------------

GrammarMatcher::GrammarMatcher(std::shared_ptr<const CompiledGrammar> g) : g_(std::move(g)), pool_(g_->grammar()) {
  MatchState s;
  pool_.start(&s.tops, &s.completed);
  history_.push_back(std::move(s));
  terminated_at_.push_back(false);
}

bool GrammarMatcher::token_ok_from(const MatchState& from, const std::string& bytes) {
  if (scratch_.size() < bytes.size() + 1) scratch_.resize(bytes.size() + 1);
  scratch_[0] = from;
  for (size_t i = 0; i < bytes.size(); ++i)
    if (!step_byte(pool_, scratch_[i], static_cast<uint8_t>(bytes[i]), &scratch_[i + 1]) || runtime_dead(scratch_[i + 1]))
      return false;
  return true;
}

bool GrammarMatcher::accept_bytes(std::string_view text) {
  if (terminated_) return false;
  std::string b(text);
  if (!token_ok_from(history_.back(), b)) return false;
  stacks_seen_ += scratch_[b.size()].tops.size();
  if (stacks_seen_ > kMaxStacksSeen)
    throw GrammarError("grammar", "grammar: more than " + std::to_string(kMaxStacksSeen) +
                                      " ways to parse the text so far, summed over the tokens (a repetition of a "
                                      "repetition?); the grammar is too ambiguous to match in bounded time");
  history_.push_back(scratch_[b.size()]);
  terminated_at_.push_back(false);
  return true;
}

bool GrammarMatcher::accept_token(int32_t id) {
  const TokenVocab& v = g_->vocab();
  KESTREL_ASSERT(id >= 0 && id < v.n_vocab, "grammar matcher: token id out of range");
  if (terminated_) return false;
  if (id == v.eos_id) {
    if (!can_end()) return false;
    history_.push_back(history_.back());
    terminated_at_.push_back(true);
    terminated_ = true;
    return true;
  }
  const std::string& b = v.bytes[static_cast<size_t>(id)];
  if (b.empty()) return false;
  return accept_bytes(b);
}

void GrammarMatcher::rollback(size_t n) {
  KESTREL_ASSERT(n < history_.size(), "grammar matcher: rollback past the start");
  history_.resize(history_.size() - n);
  terminated_at_.resize(history_.size());
  terminated_ = terminated_at_.back();
}

void GrammarMatcher::fill_next_token_bitmask(std::span<uint32_t> mask) {
  const TokenVocab& v = g_->vocab();
  KESTREL_ASSERT(mask.size() >= bitmask_words(v.n_vocab), "grammar matcher: bitmask too small");
  std::fill(mask.begin(), mask.end(), 0u);
  if (terminated_) return;
  const MatchState& st = history_.back();
  if (st.completed && v.eos_id >= 0) set_bit(mask, v.eos_id);
  auto on_token = [&](int32_t id, const MatchState* s) {
    if (s != nullptr) set_bit(mask, id);
  };
  if (st.remaining > 0) {
    // Inside a character: no split applies. Only tokens that start with a continuation byte
    // (0x80-0xBF) can go on, and in byte order they are one run of the sorted vocabulary.
    auto first_byte = [&](int32_t id) { return static_cast<uint8_t>(v.bytes[static_cast<size_t>(id)][0]); };
    auto lo = std::partition_point(v.sorted.begin(), v.sorted.end(), [&](int32_t id) { return first_byte(id) < 0x80; });
    auto hi = std::partition_point(lo, v.sorted.end(), [&](int32_t id) { return first_byte(id) < 0xC0; });
    const size_t b = static_cast<size_t>(lo - v.sorted.begin()), e = static_cast<size_t>(hi - v.sorted.begin());
    walk(pool_, st, std::span<const int32_t>(v.sorted).subspan(b, e - b), std::span<const uint32_t>(v.lcp).subspan(b, e - b),
         v, scratch_, runtime_dead, on_token);
    return;
  }
  MatchState one;
  for (int32_t top : st.tops) {
    const auto& pm = g_->position_masks(pool_, top);
    for (const int32_t id : pm.accepted_ids) set_bit(mask, id);
    for (size_t w = 0; w < pm.accepted.size(); ++w) {
      uint64_t bits = pm.accepted[w];
      if (bits == 0) continue;
      mask[2 * w] |= static_cast<uint32_t>(bits);
      if (2 * w + 1 < mask.size()) mask[2 * w + 1] |= static_cast<uint32_t>(bits >> 32);
    }
    if (pm.uncertain.empty()) continue;
    one.tops = {top};
    walk(pool_, one, pm.uncertain, pm.uncertain_lcp, v, scratch_, runtime_dead, on_token);
  }
}

}  // namespace kestrel::grammar
