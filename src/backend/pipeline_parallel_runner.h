// Pipeline parallelism's driver, shared by the backends (RunnerOptions::pipeline_parallel_size,
// model/pipeline_parallel.h): stage s of N is a backend's runner over LlamaModel::pipeline_stage(s,
// N) with PipelineRole{s == 0, s == N - 1}, with its own KV cache of its layers for every block id.
// Every stage runs in its own thread over a queue of micro-batches: stage s works on one while
// stage s + 1 works on the one before, each stage handing its residual stream [n_tokens, n_embd]
// f32 to the next through one of the next stage's hand-off slots. The runner holds up to one pass
// per stage in flight (ModelRunner::submit / collect): at steady state the engine keeps that many
// passes of different sequences going, so each stage is busy with one of them, as vLLM's virtual
// engines do. A pass submitted into an empty pipeline (one alone, or a long prompt's chunk) is
// split into micro-batches that fill it (GPipe, Huang et al. 2019). The CPU stages
// (cpu_pipeline_parallel.cpp) hand on in host memory, the CUDA stages (cuda_pipeline_parallel.cpp)
// by device-to-device copies. Internal to src/backend.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "backend/model_runner.h"
#include "model/forward_batch.h"
#include "model/hparams.h"

namespace kestrel {

// One micro-batch: the step's tokens [t0, t1) with their sequences' rows of the step's arrays; a
// sequence split between micro-batches (one sequence's prefill) has in each the context its
// earlier tokens leave in the cache.
struct MicroBatch {
  int64_t t0 = 0, t1 = 0;
  std::vector<int32_t> query_start, context_lens, logits_indices;
  std::vector<size_t> logits_rows;  // each logits row's index in the step's logits_indices
  ForwardBatch batch;               // views of the step's arrays and of the vectors above
};

// The micro-batches of `b` for `n_stages` stages: min(n_stages, n_seqs) groups of whole sequences
// with about equal token counts, or, for one sequence, min(n_stages, n_tokens) token ranges of it.
// `out`'s batches view `b`'s arrays.
void split_micro_batches(const ForwardBatch& b, int n_stages, std::vector<MicroBatch>& out);

// One stage of a pipeline-parallel runner.
class PipelineStage {
 public:
  virtual ~PipelineStage() = default;
  // The stage's runner: its KV pool (block copies, swaps, K/V records of its layers) and sizes.
  virtual ModelRunner& runner() = 0;
  virtual const ModelRunner& runner() const = 0;
  // With no micro-batch in any stage, from one thread: n_slots hand-off slots of up to n_tokens
  // rows [n_tokens, n_embd] f32 in the stage's memory (a stage after the first).
  virtual void reserve_hand_off(size_t n_slots, int64_t n_tokens) = 0;
  // The stage's pass over a micro-batch whose hand-off slot is m, from the stage's own thread,
  // after the stage before returned from its pass over it and the stage after returned from its
  // pass over the slot's previous micro-batch. A stage after the first reads its input from its
  // slot m; one before the last writes its output residual stream into `next`'s slot m, and has
  // finished with its input, before it returns (next: the following stage, of the same backend);
  // the last returns the logits of b.logits_indices [rows, n_vocab] f32 in host memory, valid
  // until its next pass.
  virtual std::span<const float> forward_micro_batch(const ForwardBatch& b, size_t m, PipelineStage* next) = 0;
};

// The ModelRunner over `stages` (at least one, in pipeline order, of one backend; their KV pools of
// one block count and size) of a model with hyperparameters `hp` (the whole model's, for the batch
// checks). submit() queues a pass's micro-batches for the stages (max_passes_in_flight(): one pass
// per stage), collect() returns the oldest pass's logits rows in its batch's order, forward() is
// the two with no other pass in flight; copy_blocks and swaps go to every stage; a block's K/V
// record is the stages' records in stage order. Errors: validate_forward_batch's from submit(),
// before any stage runs; a stage's failure from the collect() of its pass and of every pass
// submitted by then (the stages pass over their micro-batches); passes submitted later run.
std::unique_ptr<ModelRunner> make_pipeline_parallel_runner(std::vector<std::unique_ptr<PipelineStage>> stages,
                                                           const ModelHparams& hp);

}  // namespace kestrel
