// The drafter side of speculative decoding (Leviathan et al. 2023, "Fast Inference from
// Transformers via Speculative Decoding"; Chen et al. 2023, "Accelerating Large Language Model
// Decoding with Speculative Sampling"): something cheap proposes the next k tokens of a sequence,
// the target model computes the logits of all of them in one step, and the verifier
// (verifier.h) keeps a prefix so that the output has exactly the target's distribution.
//
// One interface for every kind of drafter: prompt lookup (NgramDrafter), a draft model with its
// own paged KV cache, or a head on the target's hidden states (EAGLE, MTP). The engine asks all
// running decodes of a step at once, so a model-based drafter can batch its forward passes, and
// tells the drafter what the verifier kept, so a stateful one can roll its KV back.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "memory/kv_manager.h"
#include "spec/speculative_config.h"

namespace kestrel {

// One sequence to draft for.
struct DraftRequest {
  SeqId id = 0;
  std::span<const int32_t> tokens;  // [n_prompt + n_generated] the sequence's ids so far (no drafts)
  int64_t n_prompt = 0;
  int32_t max_drafts = 0;           // propose at most this many (>= 1)
};

// A drafter's proposal for one sequence.
struct Draft {
  std::vector<int32_t> ids;  // [n <= max_drafts] the proposed next tokens, in order; may be empty
  // The drafter's distribution q at each proposed position, [ids.size(), n_vocab] f32
  // probabilities (row i: q(. | tokens, ids[0..i)), from which ids[i] was drawn). Empty for a
  // deterministic drafter: q is then one-hot at ids[i].
  std::vector<float> q;
};

class Drafter {
 public:
  virtual ~Drafter() = default;
  virtual std::string_view name() const = 0;
  // One proposal per request, in order; `out` is resized to requests.size().
  virtual void propose(std::span<const DraftRequest> requests, std::vector<Draft>& out) = 0;
  // The verifier kept n_accepted of the sequence's drafts and sampled one token after them; the
  // sequence now holds n_tokens ids. A stateful drafter drops what it computed past the accepted
  // drafts.
  virtual void on_verified(SeqId /*id*/, int64_t /*n_accepted*/, int64_t /*n_tokens*/) {}
  // The sequence finished or was preempted (its KV recomputed later): forget it.
  virtual void release(SeqId /*id*/) {}
};

// The drafter `config` asks for. Errors: kestrel::Error for draft_model, which this engine does
// not run yet, and for a config without a method.
std::unique_ptr<Drafter> make_drafter(const SpeculativeConfig& config);

}  // namespace kestrel
