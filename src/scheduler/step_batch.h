// The flat forward batch of one scheduled step (ForwardBatch's arrays, owned), built from the
// scheduler's output and the sequences' block tables.
//
// Logits rows: a sequence whose scheduled tokens reach its last token gets rows at its last
// 1 + n_draft positions, in position order (the draft tokens' verification rows, then the row the
// next token is sampled from; vLLM v1 computes its logits the same way). Callers may append more
// rows (a prompt's logprob rows) after build().
#pragma once

#include <cstdint>
#include <vector>

#include "memory/kv_manager.h"
#include "model/forward_batch.h"
#include "scheduler/scheduler.h"

namespace kestrel {

struct StepBatch {
  std::vector<int32_t> token_ids, positions, query_start, context_lens, block_tables, logits_indices;
  std::vector<int64_t> slot_mapping;
  int32_t max_blocks_per_seq = 0;
  // Per scheduled sequence (out.scheduled's order): its first token's row in the batch, and its
  // first logits row's index in logits_indices with the number of rows it has (0 when it does not
  // reach its last token).
  std::vector<int32_t> first_token;
  std::vector<int32_t> first_logits_row;
  std::vector<int32_t> n_logits_rows;

  // Fills every array for `out`. Slots come from kv's block table of each sequence.
  void build(const SchedulerOutput& out, const KvManager& kv);
  // Views into the arrays (valid until the next build() or change).
  ForwardBatch view() const;
};

}  // namespace kestrel
