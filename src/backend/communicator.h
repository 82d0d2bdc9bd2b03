// Collectives among the ranks of a tensor-parallel group (Megatron-LM, Shoeybi et al. 2019): each
// rank holds a slice of every layer's weights and runs the same forward pass over the same batch;
// the row-parallel projections' partial sums meet in all_reduce_sum and the vocabulary slices of
// the logits in all_gather. Every rank calls every collective in the same order with the same
// sizes (NCCL's rule); a call returns when this rank's result is in place.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

namespace kestrel {

enum class CommDtype { F32, BF16 };

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // data [n] of `dtype` (bf16: uint16 bit patterns) on every rank becomes the elementwise sum over
  // the ranks. The in-process implementation adds in rank order 0, 1, ..., size-1 in f32 (bf16
  // rounded once at the end), so the result does not depend on thread timing.
  virtual void all_reduce_sum(void* data, int64_t n, CommDtype dtype) = 0;
  void all_reduce_sum(float* data, int64_t n) { all_reduce_sum(data, n, CommDtype::F32); }
  // in [n] f32 on every rank -> out [size, n] on every rank, rank r's in at row r.
  virtual void all_gather(const float* in, int64_t n, float* out) = 0;
  // Returns once every rank has called it: a host-side rendezvous, no device work. The CUDA ranks
  // meet here after a pass's allocations and before its first collective, since a thread
  // allocating device memory while another rank's NCCL kernel waits for this one can deadlock
  // (memory management takes driver locks the waiting device holds up).
  virtual void host_barrier() = 0;
  // Ends the whole group after a rank failed, so that the others do not wait for it forever on the
  // host: host_barrier and the in-process collectives in progress on any rank, and every later
  // collective, throw kestrel::Error. An NCCL collective already enqueued is not cancelled (its
  // communicators are aborted when the group is destroyed, after the graphs that captured them).
  // The group cannot be used again. Callable from any thread, more than once.
  virtual void abort() = 0;
};

// The communicators of `size` ranks that run as threads of this process (shared buffers and a
// barrier), rank r at index r. Each must be used by one thread only; together they stand in for
// NCCL in CPU tensor parallelism and its tests. Errors: kestrel::Error for size < 1.
std::vector<std::unique_ptr<Communicator>> make_in_process_communicators(int size);

}  // namespace kestrel
