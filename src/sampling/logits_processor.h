// One step of the sampling chain: edits or truncates the candidate list of one sequence.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

#include "sampling/candidate_list.h"

namespace kestrel {

class LogitsProcessor {
 public:
  virtual ~LogitsProcessor() = default;
  // Short name for logs and tests ("top_k", "temperature", ...).
  virtual std::string_view name() const = 0;
  // `previous_tokens`: the sequence's earlier token ids, oldest first (penalties read them).
  // A processor never empties a non-empty list.
  virtual void apply(CandidateList& candidates, std::span<const int32_t> previous_tokens) const = 0;
  // Whether the penalty counts prompt tokens too (CTRL repetition penalty, as in vLLM and
  // llama.cpp) or only generated ones (OpenAI presence/frequency penalties). See Sampler::sample.
  virtual bool reads_prompt() const { return true; }
};

}  // namespace kestrel
