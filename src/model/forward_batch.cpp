#include "model/forward_batch.h"

#include <string>

#include "core/error.h"

namespace kestrel {

void validate_forward_batch(const ForwardBatch& b, int64_t n_vocab, int32_t n_blocks, int32_t block_size) {
  const int64_t n = b.n_tokens();
  if (n == 0) throw Error("forward: empty batch");
  if (static_cast<int64_t>(b.positions.size()) != n || static_cast<int64_t>(b.slot_mapping.size()) != n)
    throw Error("forward: positions and slot_mapping must have one entry per token");
  if (static_cast<int64_t>(b.query_start.size()) != b.n_seqs() + 1 || b.query_start.front() != 0 ||
      b.query_start.back() != n)
    throw Error("forward: query_start must have n_seqs + 1 offsets from 0 to n_tokens");
  if (static_cast<int64_t>(b.block_tables.size()) != b.n_seqs() * b.max_blocks_per_seq)
    throw Error("forward: block_tables must be [n_seqs, max_blocks_per_seq]");
  for (int64_t t = 0; t < n; ++t) {
    if (b.token_ids[t] < 0 || b.token_ids[t] >= n_vocab)
      throw Error("forward: token id " + std::to_string(b.token_ids[t]) + " outside the vocabulary");
    if (b.slot_mapping[t] < 0 || b.slot_mapping[t] >= static_cast<int64_t>(n_blocks) * block_size)
      throw Error("forward: slot " + std::to_string(b.slot_mapping[t]) + " outside the KV cache");
  }
  for (int64_t s = 0; s < b.n_seqs(); ++s) {
    if (b.query_start[s + 1] < b.query_start[s]) throw Error("forward: query_start not ascending");
    if (b.context_lens[s] > static_cast<int64_t>(b.max_blocks_per_seq) * block_size)
      throw Error("forward: context longer than the block table");
    for (int32_t t = b.query_start[s]; t < b.query_start[s + 1]; ++t)
      if (b.positions[t] < 0 || b.positions[t] >= b.context_lens[s])
        throw Error("forward: position " + std::to_string(b.positions[t]) +
                    " outside the sequence's context");
  }
  for (int32_t block : b.block_tables)
    if (block < 0 || block >= n_blocks) throw Error("forward: block id " + std::to_string(block) + " outside the KV cache");
  for (int32_t r : b.logits_indices)
    if (r < 0 || r >= n) throw Error("forward: logits index outside the batch");
}

}  // namespace kestrel
