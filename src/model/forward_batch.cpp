#include "model/forward_batch.h"

#include <algorithm>
#include <string>

#include "core/error.h"

namespace kestrel {

void validate_forward_batch(const ForwardBatch& b, int64_t n_vocab, int32_t n_blocks, int32_t block_size,
                            int64_t lookback) {
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
    int64_t first_pos = b.context_lens[s];
    for (int32_t t = b.query_start[s]; t < b.query_start[s + 1]; ++t) {
      if (b.positions[t] < 0 || b.positions[t] >= b.context_lens[s])
        throw Error("forward: position " + std::to_string(b.positions[t]) +
                    " outside the sequence's context");
      first_pos = std::min<int64_t>(first_pos, b.positions[t]);
    }
    // Blocks from the first key read to the end of the context must be held.
    const int64_t first_key = lookback > 0 ? std::max<int64_t>(0, first_pos + 1 - lookback) : 0;
    const int32_t* table = b.block_tables.data() + s * b.max_blocks_per_seq;
    for (int64_t j = first_key / block_size; j * block_size < b.context_lens[s]; ++j)
      if (table[j] == kNoBlock)
        throw Error("forward: block " + std::to_string(j) + " of sequence " + std::to_string(s) +
                    " is released (kNoBlock) but position " + std::to_string(first_pos) + " reads it");
  }
  for (int32_t block : b.block_tables)
    if ((block < 0 && block != kNoBlock) || block >= n_blocks)
      throw Error("forward: block id " + std::to_string(block) + " outside the KV cache");
  for (int32_t r : b.logits_indices)
    if (r < 0 || r >= n) throw Error("forward: logits index outside the batch");
}

}  // namespace kestrel
