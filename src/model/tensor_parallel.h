// How a model splits over the ranks of a tensor-parallel group (Megatron-LM, Shoeybi et al. 2019:
// column-parallel Q/K/V and gate/up, row-parallel output and down projections, one all-reduce
// after each; the LM head split by vocabulary rows). LlamaModel::tensor_parallel_shard applies it.
#pragma once

#include <cstdint>

#include "model/hparams.h"

namespace kestrel {

// Rank r's part of the heads, the FFN width and the vocabulary: [begin, begin + count).
struct TensorParallelSlice {
  int64_t head_begin = 0, n_head = 0;        // query heads
  int64_t kv_head_begin = 0, n_head_kv = 0;  // KV heads (one, replicated, when n_head_kv < size)
  int64_t ff_begin = 0, n_ff = 0;
  int64_t vocab_begin = 0, n_vocab = 0;      // LM head rows
};

// Throws kestrel::Error, naming --tensor-parallel-size and the numbers, unless `size` ranks can
// split the model: size >= 1; a Llama-family architecture without mixture-of-experts layers (Gemma
// 3, MoE and MLA models are not supported with tensor parallelism); size dividing n_head, n_ff and
// n_vocab; and size dividing n_head_kv or, with fewer KV heads than ranks, n_head_kv dividing
// size (each rank's query heads then share one KV head).
void validate_tensor_parallel(const ModelHparams& hp, int size);

// Rank `rank` of `size`'s slice (validate_tensor_parallel(hp, size) must hold).
TensorParallelSlice tensor_parallel_slice(const ModelHparams& hp, int rank, int size);

}  // namespace kestrel
