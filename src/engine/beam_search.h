// Beam search over a model's next-token log-probabilities, as Hugging Face transformers'
// `generate(num_beams=B, do_sample=False)` does it (GenerationMixin._beam_search and its helpers
// in transformers 5.25, the version tests/reference/beam_reference.py ran): each step ranks the
// live beams' continuations by cumulative log-probability, keeps the best B that do not end as the
// next beams, and files those among the best B that end (a stop id, or max_new_tokens reached) as
// finished hypotheses, of which the best B by length-penalised score are kept:
//   score = sum_logprobs / (n_generated ** length_penalty),
// n_generated counting the generated tokens, the ending one included (the prompt is not counted).
// This is pure bookkeeping over rows of log-probabilities; the engine (engine_beam.cpp) maps each
// beam to a sequence whose KV blocks it forks copy-on-write.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace kestrel {

// When the search may end before max_new_tokens (transformers' `early_stopping`).
enum class EarlyStopping {
  Heuristic,  // false: stop when the best live beam, scored at its current length, cannot beat the worst kept hypothesis
  Done,       // true: stop as soon as B hypotheses are finished
  Never,      // "never": as Heuristic, but with length_penalty > 0 the live beam is scored at max_new_tokens (exact)
};

// "true", "false" or "never" (as JSON spells them); throws kestrel::Error otherwise.
EarlyStopping parse_early_stopping(const std::string& s);
const char* to_string(EarlyStopping e);

struct BeamSearchParams {
  int32_t beam_width = 0;      // B live beams; 0 = no beam search
  int32_t n_best = 1;          // hypotheses returned, 1 ..= beam_width
  double length_penalty = 1.0; // exponent on the generated length in the score
  EarlyStopping early_stopping = EarlyStopping::Heuristic;
  bool enabled() const { return beam_width > 0; }
  // Errors (kestrel::Error naming the field): beam_width outside [1, kMaxBeamWidth], n_best
  // outside [1, beam_width], a non-finite length_penalty.
  void validate() const;
};

inline constexpr int32_t kMaxBeamWidth = 128;

// A finished (or, at the end, returned) beam.
struct BeamHypothesis {
  std::vector<int32_t> tokens;  // generated ids, the stop id that ended it included
  double sum_logprobs = 0;      // cumulative log-probability of tokens (natural log)
  double score = 0;             // sum_logprobs / tokens.size() ** length_penalty
  bool stopped = false;         // ended by a stop id (else by max_new_tokens)
  std::string text;             // tokens decoded (special tokens skipped); filled by the engine when it has a tokenizer
};

// A beam's best next tokens: ids and their log-softmax (natural log, from the raw logits), best
// first (equal values: lower id first).
struct BeamRow {
  std::vector<int32_t> tokens;
  std::vector<double> logprobs;
};

// The k best tokens of one logits row with their log-softmax (log-sum-exp summed in double).
// Returns false, leaving out unspecified, when the row has a NaN, a +inf or no finite value.
bool top_logprobs(std::span<const float> logits, size_t k, BeamRow& out);

class BeamSearch {
 public:
  // stop_ids: tokens that end a hypothesis. max_new_tokens >= 1.
  BeamSearch(const BeamSearchParams& params, std::vector<int32_t> stop_ids, int64_t max_new_tokens);

  // The next beams: beam i continues live beam `parent` (an index into the previous live beams)
  // with `token`.
  struct Next {
    int32_t parent = 0;
    int32_t token = 0;
  };

  // Candidates step() needs from each live beam's row: max(2, 1 + stop ids) x B (transformers'
  // beams_to_keep), so that B remain that do not stop.
  size_t candidates_per_beam() const;
  // Live beams: 1 before the first step, then up to B; 0 once done().
  int32_t n_live() const { return static_cast<int32_t>(live_.size()); }
  bool done() const { return done_; }
  // One step. rows[i]: live beam i's best candidates_per_beam() tokens (top_logprobs of its
  // next-token logits). Returns the next live beams in rank order (empty once the search is done).
  // Errors: KESTREL_ASSERT when rows.size() != n_live() or the search is done.
  std::vector<Next> step(std::span<const BeamRow> rows);
  // Beam i's generated tokens and cumulative log-probability.
  const std::vector<int32_t>& tokens(int32_t i) const { return live_[static_cast<size_t>(i)].tokens; }
  double sum_logprobs(int32_t i) const { return live_[static_cast<size_t>(i)].sum_logprobs; }
  // The best n_best finished hypotheses, best first (call once done()).
  std::vector<BeamHypothesis> results() const;

 private:
  struct Live {
    std::vector<int32_t> tokens;
    double sum_logprobs = 0;
  };
  bool is_stop(int32_t token) const;
  void add_finished(BeamHypothesis h);
  bool can_improve(double best_live_sum, int64_t n_generated) const;

  BeamSearchParams params_;
  std::vector<int32_t> stop_ids_;
  int64_t max_new_tokens_;
  std::vector<Live> live_;
  std::vector<BeamHypothesis> finished_;  // best first, at most beam_width
  bool done_ = false;
};

}  // namespace kestrel
