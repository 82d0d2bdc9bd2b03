// Token masks for constrained decoding: which vocabulary tokens can continue a grammar's text.
//
// The grammar (grammar.h) is run as a pushdown automaton over code points: a state is a set of
// stacks of grammar positions, each stack's top a character class, with the stacks kept as
// shared, interned nodes (one node per (position, rest of stack)). Token bytes are fed one at a
// time; a UTF-8 character split across tokens is held as a partial code point and checked
// against the classes by the range of code points it can still become.
//
// Masks use the split xgrammar describes (Dong et al. 2024, "XGrammar: Flexible and Efficient
// Structured Generation Engine for Large Language Models", section 3.1): for the top frames of a
// stack the tokens are sorted once into those accepted without popping below them (the same for
// every stack beneath), those rejected there, and the few that pop past them with bytes left,
// which alone are checked against the real stack. Each split is computed on first use and shared
// by every matcher of the grammar. The vocabulary is walked in
// byte order so tokens with a common prefix share its steps, and a dead prefix skips every token
// that starts with it.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "sampling/grammar/grammar.h"

namespace kestrel {
class Tokenizer;
}

namespace kestrel::grammar {

class StackPool;

// The vocabulary as byte strings, sorted. Special tokens (CONTROL, UNKNOWN, UNUSED) and tokens
// without bytes are never allowed; EOS is allowed exactly when the grammar can end.
struct TokenVocab {
  int32_t n_vocab = 0;
  int32_t eos_id = -1;
  std::vector<std::string> bytes;  // by id; empty for tokens that are never allowed
  std::vector<int32_t> sorted;     // allowed ids in byte order
  std::vector<uint32_t> lcp;       // [i]: common prefix length of sorted[i] and sorted[i - 1]
  // The bytes of sorted[i] at sorted_bytes[sorted_offset[i], sorted_offset[i + 1]): one contiguous
  // read for a walk over the whole vocabulary (a split's), not a string object per token.
  std::string sorted_bytes;
  std::vector<uint32_t> sorted_offset;

  // Token bytes from Tokenizer::token_to_piece (byte-fallback tokens give their byte; a piece may
  // be part of a UTF-8 character).
  static std::shared_ptr<const TokenVocab> from_tokenizer(const Tokenizer& tok);
  // From explicit byte strings (tests); empty strings are never allowed.
  static std::shared_ptr<const TokenVocab> from_bytes(std::vector<std::string> bytes, int32_t eos_id);
};

// Words of a token bitmask: bit (id % 32) of word (id / 32) is set when token id is allowed. The
// layout the CUDA sampler's per-row mask takes as well.
inline size_t bitmask_words(int32_t n_vocab) { return (static_cast<size_t>(n_vocab) + 31) / 32; }

// Sets logits[id] = -inf for every token whose bit is clear. logits: [n_vocab] f32; mask:
// [bitmask_words(n_vocab)].
void apply_token_bitmask(std::span<float> logits, std::span<const uint32_t> mask);

// A grammar bound to a vocabulary, shareable by any number of matchers (thread-safe).
class CompiledGrammar {
 public:
  // The links of a bounded repetition (Grammar::chains) that allow at least this many more
  // repetitions share one token split: the split of the link that allows exactly kChainCap, with
  // the tokens of kChainCap bytes or more that it does not accept left uncertain (checked against
  // the real stack at each mask). A token shorter than that cannot tell the links apart (each
  // repetition it starts takes at least one of its bytes), so the masks stay exact, and a
  // `maxLength: 160` string costs 33 vocabulary walks instead of 160. 32 leaves 47 of SmolLM2's
  // 49,152 tokens uncertain there. 0 switches the sharing off.
  static constexpr uint32_t kChainCap = 32;

  CompiledGrammar(Grammar g, std::shared_ptr<const TokenVocab> vocab, uint32_t chain_cap = kChainCap);
  const Grammar& grammar() const { return grammar_; }
  const TokenVocab& vocab() const { return *vocab_; }

  // How many stack frames (top first) key a token split: the top's rule alone often ends after
  // one character (a JSON string's character rule), which would leave most tokens uncertain; with
  // the two frames below it the split reaches the end of the enclosing string or literal, and
  // stays shared by every stack with those frames on top (all strings of one JSON grammar).
  static constexpr size_t kKeyFrames = 3;

  // The split for stacks whose top frames hold these positions (top first; fewer than
  // kKeyFrames when the stack is shallower), computed on first use.
  struct PositionMasks {
    // The accepted ids: a bitset over ids, or, where they are few (most positions outside
    // strings), accepted_ids instead and the bitset empty, at a 32nd of the bytes or less.
    std::vector<uint64_t> accepted;
    std::vector<int32_t> accepted_ids;
    std::vector<int32_t> uncertain;  // ids in byte order
    std::vector<uint32_t> uncertain_lcp;
  };
  const PositionMasks& position_masks(std::span<const uint32_t> frames) const;
  // The split of the stack whose top is node `top` of `pool`: its top frames' positions, those of
  // links beyond the chain cap taken as the capped link's.
  const PositionMasks& position_masks(const StackPool& pool, int32_t top) const;
  // Computes ahead the splits of the stacks reachable from the start (every stack a matcher can
  // hold is reachable by stepping one grammar character at a time), breadth first, so that the
  // first masks of a fresh grammar find them ready instead of walking the vocabulary in the
  // step that meets them. Stops after max_stacks stacks (a recursive grammar has no end of them;
  // breadth first, the shallow ones come first) or when *stop turns true. Thread-safe beside
  // matchers (a split one of them needs meanwhile is computed once, by whoever comes first).
  // Returns the stacks visited.
  size_t precompute_splits(size_t max_stacks, const std::atomic<bool>* stop = nullptr) const;
  // The engine's max_stacks: every stack of the 20 bench schemas but the 4 recursive ones (up to
  // 1,631 stacks, 898 splits, 112 ms on a busy 2-core VM with SmolLM2's vocabulary).
  static constexpr size_t kPrecomputeStacks = 20000;
  // True for the first caller only: who runs precompute_splits for this grammar.
  bool claim_precompute() const { return !precompute_claimed_.exchange(true); }
  // How many splits have been asked for so far (computed, or being computed).
  size_t n_splits() const {
    std::lock_guard<std::mutex> lock(mu_);
    return masks_.size();
  }

 private:
  Grammar grammar_;
  std::shared_ptr<const TokenVocab> vocab_;
  uint32_t chain_cap_;
  mutable std::atomic<bool> precompute_claimed_{false};
  // [elements]: the position a split key holds for each grammar position (the capped link's
  // matching one for links beyond the chain cap, else itself).
  std::vector<uint32_t> key_pos_;
  std::vector<uint8_t> capped_;    // [elements]: a position of a link at or beyond the cap
  // A split is computed once, by the first matcher that needs it, outside mu_: matchers that need
  // other splits of this grammar meanwhile are not held up (a vocabulary walk takes up to a few
  // milliseconds), those that need the same one wait on its once flag.
  struct Split {
    std::once_flag once;
    PositionMasks masks;
  };
  void compute_split(std::span<const uint32_t> frames, PositionMasks* pm) const;
  mutable std::mutex mu_;  // guards the map, not its entries' contents
  mutable std::unordered_map<std::string, std::unique_ptr<Split>> masks_;  // by frames' bytes
};

// Interned stack nodes and the step over one code point; shared by the matcher and the
// precomputation.
class StackPool {
 public:
  // The most stacks a state may hold. A grammar ambiguous by its own strings ((a{1,8}){0,8}
  // nested five deep) holds one stack per way of parsing the text so far, and a step and a mask
  // cost time in proportion (a mask about 1 us a stack): past this bound start, step and advance
  // throw GrammarError instead of holding the engine. GrammarMatcher also bounds the stacks of
  // all its states together (kMaxStacksSeen).
  static constexpr size_t kMaxStacks = size_t{1} << 16;
  explicit StackPool(const Grammar& g) : g_(g) {}
  struct Node {
    uint32_t pos;
    int32_t parent;  // -1: bottom
  };
  const Node& node(int32_t id) const { return nodes_[static_cast<size_t>(id)]; }
  int32_t intern(uint32_t pos, int32_t parent);
  // Appends the tops reached from (pos, parent) without consuming input to *out; sets *completed
  // when the bottom rule can end there.
  void expand(uint32_t pos, int32_t parent, std::vector<int32_t>* out, bool* completed);
  // The start state's tops (the root rule's alternatives, expanded). start, step and advance:
  // Errors: GrammarError("grammar") when the tops would be more than kMaxStacks.
  void start(std::vector<int32_t>* out, bool* completed);
  // The tops after consuming code point cp from `tops` (sorted, unique); *completed as above.
  void step(std::span<const int32_t> tops, uint32_t cp, std::vector<int32_t>* out, bool* completed);
  // The tops after top's character class takes any of its code points (sorted, unique).
  void advance(int32_t top, std::vector<int32_t>* out, bool* completed);
  const Grammar& grammar() const { return g_; }

 private:
  const Grammar& g_;
  std::vector<Node> nodes_;
  std::vector<int32_t> table_;  // open-addressing hash of (pos, parent) -> node id
  size_t used_ = 0;
  std::vector<uint32_t> visited_;  // by node id: the step that last expanded it
  uint32_t epoch_ = 0;
  std::vector<std::pair<uint32_t, int32_t>> work_;  // expand's stack of (position, parent)
  void finish_tops(std::vector<int32_t>* out) const;  // sorts, dedups, checks kMaxStacks
};

// A parse state: stack tops plus a partly read UTF-8 character.
struct MatchState {
  std::vector<int32_t> tops;  // sorted, unique
  uint32_t partial = 0;       // bits read so far of a multi-byte character
  uint8_t remaining = 0;      // continuation bytes still expected
  uint8_t seen = 0;           // bytes of that character read so far
  bool completed = false;     // the bottom rule ended right at this point (no partial pending)
  bool completed_before = false;  // it ended earlier and bytes followed (precomputation only)
  bool dead() const { return tops.empty() && !completed && !completed_before; }
};

// Feeds one byte to a state. Returns false (and leaves *out unspecified) when no stack accepts it.
bool step_byte(StackPool& pool, const MatchState& in, uint8_t byte, MatchState* out);

// One request's grammar state. Not thread-safe.
class GrammarMatcher {
 public:
  explicit GrammarMatcher(std::shared_ptr<const CompiledGrammar> g);

  // The most stacks the states of one matcher may hold together, summed over the tokens it
  // accepts (rollbacks do not give them back): a grammar that keeps thousands of parses alive at
  // every token costs every mask that much (about 15 us a stack with SmolLM2's vocabulary on a
  // 2-core VM), so past this sum it is refused, a few seconds in, while a choice of 10,000 strings
  // still runs (its stacks die as it goes).
  static constexpr uint64_t kMaxStacksSeen = uint64_t{1} << 18;

  // Advances by one token. Returns false, leaving the state unchanged, when the token cannot
  // continue the text (EOS: accepted when the grammar can end, after which the matcher is
  // terminated). Errors: asserts id in [0, n_vocab); GrammarError("grammar") past kMaxStacks or
  // kMaxStacksSeen (accept_bytes too; and the constructor past kMaxStacks).
  bool accept_token(int32_t id);
  // Whether `text` (bytes) can continue the current state; advances when it can.
  bool accept_bytes(std::string_view text);
  // Undoes the last n accepted tokens (n <= tokens accepted). For speculative decoding.
  void rollback(size_t n);
  size_t num_accepted() const { return history_.size() - 1; }
  // The text so far is a complete sentence of the grammar.
  bool can_end() const { return history_.back().completed; }
  // EOS was accepted, or the grammar can end and no stack can take more input.
  bool is_terminated() const { return terminated_ || (can_end() && history_.back().tops.empty()); }

  // Fills mask ([bitmask_words(n_vocab)]) with the tokens accept_token would take now.
  void fill_next_token_bitmask(std::span<uint32_t> mask);

 private:
  bool token_ok_from(const MatchState& from, const std::string& bytes);

  std::shared_ptr<const CompiledGrammar> g_;
  StackPool pool_;
  std::vector<MatchState> history_;  // [0]: the start state
  std::vector<bool> terminated_at_;  // parallel to history_: EOS taken at that step
  bool terminated_ = false;
  std::vector<MatchState> scratch_;
  uint64_t stacks_seen_ = 0;  // summed tops of the states accepted (kMaxStacksSeen)
};

// Background threads (up to max_threads, started as grammars come) that run
// CompiledGrammar::precompute_splits for the grammars given to them, each once (claim_precompute),
// in the order given: a burst of fresh schemas (a batch file, a server's first requests) is
// precomputed side by side. The destructor stops the ones running and joins.
class SplitPrefetcher {
 public:
  SplitPrefetcher(size_t max_stacks, int max_threads) : max_stacks_(max_stacks), max_threads_(max_threads) {}
  ~SplitPrefetcher();
  SplitPrefetcher(const SplitPrefetcher&) = delete;
  SplitPrefetcher& operator=(const SplitPrefetcher&) = delete;
  void add(std::shared_ptr<const CompiledGrammar> g);

 private:
  void run();
  size_t max_stacks_;
  int max_threads_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<const CompiledGrammar>> queue_;
  int idle_ = 0;  // threads waiting for a grammar
  std::atomic<bool> stop_{false};
  std::vector<std::thread> threads_;
};

}  // namespace kestrel::grammar
