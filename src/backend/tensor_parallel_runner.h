// Tensor parallelism's driver, shared by the backends (RunnerOptions::tensor_parallel_size,
// model/tensor_parallel.h; Megatron-LM, Shoeybi et al. 2019): rank r of N is a backend's runner
// over LlamaModel::tensor_parallel_shard(r, N) with its own KV cache of its heads for every block
// id and its Communicator, through which the runners sum their row-parallel outputs inside their
// passes. Every rank runs the same batch in its own thread; each returns the logits of its slice of
// the vocabulary on the host, and the driver lays the slices side by side. The CPU ranks
// (cpu_backend.cpp) communicate in host memory, the CUDA ranks (cuda_tensor_parallel.cpp) through
// NCCL on their streams. Internal to src/backend.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "backend/communicator.h"
#include "backend/model_runner.h"
#include "model/hparams.h"
#include "model/llama_weights.h"

namespace kestrel {

// The ModelRunner over `ranks` (N >= 1, rank r's runner over shards[r] holding comms[r]; one
// backend; their KV pools of one block count and size) of a model with hyperparameters `hp` (the
// whole model's, for the batch checks). forward() checks the batch (validate_forward_batch), runs
// every rank on it at once and returns [n_rows, n_vocab] (rank r's logits [n_rows,
// n_vocab / N] at columns [r n_vocab / N, (r + 1) n_vocab / N)); the host samples (no device
// sampling). Block copies and swaps go to every rank (each holds its heads of every block); a
// block's K/V record is the ranks' records in rank order, and the bytes per token are the ranks'
// together (a replicated KV head counted on every rank that holds it). The runner owns shards,
// comms and ranks and destroys the ranks first. Errors: validate_forward_batch's; the first
// failing rank's: a rank that throws in forward() aborts the communicators (Communicator::abort),
// so the ranks waiting for it on the host (a barrier, an in-process collective) return too, and
// every later forward() throws kestrel::Error. An NCCL collective another rank already enqueued
// for it is not cancelled (see Communicator::abort).
std::unique_ptr<ModelRunner> make_tensor_parallel_runner(std::vector<std::unique_ptr<LlamaModel>> shards,
                                                         std::vector<std::unique_ptr<Communicator>> comms,
                                                         std::vector<std::unique_ptr<ModelRunner>> ranks,
                                                         const ModelHparams& hp);

}  // namespace kestrel
