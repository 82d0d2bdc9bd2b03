// The flat batch a forward pass reads (the ScheduledBatch of ../shared/design/ARCHITECTURE.md):
// the tokens of every scheduled sequence, prefill chunks and decode tokens mixed, with their
// positions, the KV slot each token writes, and each sequence's block table.
#pragma once

#include <cstdint>
#include <span>

namespace kestrel {

// A block table entry for a block the sequence no longer holds: positions wholly before its
// sliding window when every layer is windowed (KvManager::release_before). Such entries are
// leading, and kernels must never read them: attention starts at the window.
inline constexpr int32_t kNoBlock = -1;

struct ForwardBatch {
  std::span<const int32_t> token_ids;     // [n_tokens]
  std::span<const int32_t> positions;     // [n_tokens], position of each token in its sequence
  std::span<const int64_t> slot_mapping;  // [n_tokens], KV slot = block_id * block_size + offset
  std::span<const int32_t> query_start;   // [n_seqs + 1], token offsets of each sequence
  std::span<const int32_t> context_lens;  // [n_seqs], tokens in the KV cache after this step
  std::span<const int32_t> block_tables;  // [n_seqs, max_blocks_per_seq], row-major block ids (or kNoBlock)
  int32_t max_blocks_per_seq = 0;
  std::span<const int32_t> logits_indices;  // token rows whose logits the caller wants

  int64_t n_tokens() const { return static_cast<int64_t>(token_ids.size()); }
  int64_t n_seqs() const { return static_cast<int64_t>(context_lens.size()); }
};

// Checks a batch against a model's vocabulary and a KV pool before any kernel reads it: sizes of
// every array, token ids in [0, n_vocab), slots and block ids inside the pool, positions inside
// their sequence's context, logits rows inside the batch. kNoBlock entries are accepted only before
// the first key any of the sequence's tokens reads: position p reads keys from p + 1 - lookback
// (lookback: ModelHparams::kv_lookback(); 0 = from key 0, so no kNoBlock at all, for a backend
// whose attention reads every earlier key). Throws kestrel::Error naming the field.
void validate_forward_batch(const ForwardBatch& b, int64_t n_vocab, int32_t n_blocks, int32_t block_size,
                            int64_t lookback = 0);

}  // namespace kestrel
