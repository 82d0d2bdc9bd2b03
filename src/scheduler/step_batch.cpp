#include "scheduler/step_batch.h"

#include <algorithm>

namespace kestrel {

static_assert(KvManager::kNoBlock == kNoBlock, "the KV manager's released entries are the forward batch's");

void StepBatch::build(const SchedulerOutput& out, const KvManager& kv) {
  token_ids.clear();
  positions.clear();
  slot_mapping.clear();
  logits_indices.clear();
  first_token.clear();
  first_logits_row.clear();
  n_logits_rows.clear();
  query_start.assign(1, 0);
  context_lens.clear();
  size_t max_blocks = 0;
  for (const ScheduledSeq& sc : out.scheduled) max_blocks = std::max(max_blocks, kv.block_table(sc.seq->id).size());
  max_blocks_per_seq = static_cast<int32_t>(max_blocks);
  block_tables.assign(out.scheduled.size() * max_blocks, 0);
  const int64_t bs = kv.block_size();
  for (size_t i = 0; i < out.scheduled.size(); ++i) {
    const ScheduledSeq& sc = out.scheduled[i];
    const std::vector<int32_t>& table = kv.block_table(sc.seq->id);
    std::copy(table.begin(), table.end(), block_tables.begin() + static_cast<std::ptrdiff_t>(i * max_blocks));
    first_token.push_back(static_cast<int32_t>(token_ids.size()));
    for (int64_t p = sc.n_computed; p < sc.n_computed + sc.n_new; ++p) {
      token_ids.push_back(sc.seq->tokens[static_cast<size_t>(p)]);
      positions.push_back(static_cast<int32_t>(p));
      slot_mapping.push_back(static_cast<int64_t>(table[static_cast<size_t>(p / bs)]) * bs + p % bs);
    }
    query_start.push_back(static_cast<int32_t>(token_ids.size()));
    context_lens.push_back(static_cast<int32_t>(sc.n_computed + sc.n_new));
    const int64_t n_rows = sc.n_logits();
    first_logits_row.push_back(static_cast<int32_t>(logits_indices.size()));
    n_logits_rows.push_back(static_cast<int32_t>(n_rows));
    for (int64_t k = n_rows; k >= 1; --k) logits_indices.push_back(static_cast<int32_t>(token_ids.size() - k));
  }
}

ForwardBatch StepBatch::view() const {
  ForwardBatch fb;
  fb.token_ids = token_ids;
  fb.positions = positions;
  fb.slot_mapping = slot_mapping;
  fb.query_start = query_start;
  fb.context_lens = context_lens;
  fb.block_tables = block_tables;
  fb.max_blocks_per_seq = max_blocks_per_seq;
  fb.logits_indices = logits_indices;
  return fb;
}

}  // namespace kestrel
