// The CPU backend's attention over a flat batch: every sequence's query tokens against its keys in
// the paged KvCache, split into ops().attention calls and spread over the thread pool.
//
// Work items are (sequence, KV head, query tile): up to kQueryTileRows query rows (the GQA group's
// heads x consecutive tokens of one sequence) share each converted key tile. Items are claimed
// longest first (a causal prefill's last tiles read the most keys), so both threads finish
// together. With fewer items than 4 per thread (decode of one or a few sequences) the key range of
// each item is split by chunks (kAttentionChunk keys) over the threads and the chunk states are
// merged in key order afterwards (split-KV). A row's bits depend only on its own keys: not on the
// batch, the tiling, the split or the thread count (see ops.h).
#pragma once

#include <cstdint>
#include <vector>

#include "backend/cpu/ops.h"
#include "core/thread_pool.h"

namespace kestrel::cpu {

constexpr int64_t kQueryTileRows = 32;

struct AttentionBatch {
  int64_t n_seqs;
  const int32_t* query_start;   // [n_seqs + 1]: sequence s's tokens are [query_start[s], query_start[s + 1])
  const int32_t* block_tables;  // [n_seqs, max_blocks_per_seq]
  int64_t max_blocks_per_seq;
  const int64_t* n_ctx;         // [n_tokens]: keys [kv_begin[t], n_ctx[t]) of token t are attended
  const int64_t* kv_begin;      // [n_tokens]
  const float* q;               // token t's query heads at q + t * q_stride, head h at + h * head_dim
  int64_t q_stride;
  float* out;                   // token t's output heads at out + t * out_stride, head h at + h * v_dim
  int64_t out_stride;
  int64_t n_head_kv;            // KV heads; query head h reads KV head h / group
  int64_t head_stride;          // elements from one KV head's rows to the next within a block
};

// layer: the fields of AttentionArgs that describe the layer's cache and heads (k_cache ... scale,
// head_offset of KV head 0); the per-call fields are filled here. states: scratch for split-KV.
void paged_attention(ThreadPool& pool, const AttentionArgs& layer, const AttentionBatch& batch,
                     std::vector<float>& states);

}  // namespace kestrel::cpu
