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

#include "backend/model_runner.h"
#include "memory/kv_manager.h"
#include "model/llama_weights.h"
#include "sampling/sampling_params.h"
#include "spec/speculative_config.h"
#include "tokenizer/tokenizer.h"

namespace kestrel {

// One sequence to draft for.
struct DraftRequest {
  SeqId id = 0;
  std::span<const int32_t> tokens;  // [n_prompt + n_generated] the sequence's ids so far (no drafts)
  int64_t n_prompt = 0;
  int32_t max_drafts = 0;           // propose at most this many (>= 1)
  // The request's sampling settings (chain and seed; validated): a drafter that samples draws
  // its tokens under the same chain. Null: greedy.
  const SamplingParams* sampling = nullptr;
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

// What a drafter learns from the engine: the target, and the sizes its own state must hold (the
// engine's resolved EngineConfig).
struct DrafterContext {
  const LlamaModel* target = nullptr;
  const Tokenizer* target_tokenizer = nullptr;  // may be null (no text): then only n_vocab is compared
  int32_t max_num_seqs = 1;
  int64_t max_model_len = 0;
  int64_t max_num_batched_tokens = 512;  // tokens per draft forward pass at most
  int32_t block_size = 16;
  bool enable_prefix_caching = true;
  KvDtype kv_dtype = KvDtype::F16;
  int n_threads = 0;
};

// A draft model for "method": "draft_model", owned by the drafter made from it.
struct DraftModel {
  std::unique_ptr<LlamaModel> model;
  std::unique_ptr<Tokenizer> tokenizer;  // null: only n_vocab is compared with the target's
  // The backend it runs on, its KV pool sized by draft_kv_blocks (draft_model_drafter.h); null =
  // a CPU runner with the context's settings.
  std::unique_ptr<ModelRunner> runner;
};

// The drafter `config` asks for: NgramDrafter, or DraftModelDrafter over `draft`. Errors:
// kestrel::Error for draft_model without a loaded model, a draft model with another method, a
// draft whose vocabulary differs from the target's (DraftModelDrafter), a config without a method.
std::unique_ptr<Drafter> make_drafter(const SpeculativeConfig& config, const DrafterContext& context,
                                      DraftModel draft = {});

}  // namespace kestrel
