// A fork-join thread pool for the compute kernels.
//
// Decode runs a few hundred small kernels per token, so waking workers must cost well under a
// microsecond: workers spin on a generation counter for a while and only then block (C++20
// atomic wait, a futex on Linux). The caller takes part as thread 0.
//
// On a busy machine a worker may not get a CPU for milliseconds. So that one descheduled thread
// cannot stall every call, each share of a job (thread index ith) is claimed exactly once, by
// its worker or by the caller: after its own share the caller runs every share no worker has
// claimed yet, and then waits only for shares that a running worker already holds.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

namespace kestrel {

class ThreadPool {
 public:
  // n_threads: total threads including the caller; <= 0 means std::thread::hardware_concurrency().
  // Throws kestrel::Error when the threads cannot be started.
  explicit ThreadPool(int n_threads = 0);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_threads_; }

  // Runs fn(ith, nth) for every ith in [0, nth) at once (nth == size()); returns when all are done.
  // Not reentrant: fn must not call run() on the same pool.
  void run(const std::function<void(int ith, int nth)>& fn);

  // Splits [0, n) into contiguous chunks of at least `grain` items, one per thread.
  void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t begin, int64_t end)>& fn);

 private:
  void worker_loop(int ith);
  void stop_workers();

  int n_threads_;
  std::vector<std::thread> workers_;
  // Claims share ith of the job of generation g; false if someone already holds it.
  bool claim(int ith, uint64_t g);

  const std::function<void(int, int)>* job_ = nullptr;
  std::atomic<uint64_t> generation_{0};
  std::atomic<bool> stop_{false};
  // Per share: the last generation claimed and the last generation finished (one cache line each).
  struct alignas(64) Share {
    std::atomic<uint64_t> claimed{0};
    std::atomic<uint64_t> done{0};
  };
  std::unique_ptr<Share[]> shares_;
};

}  // namespace kestrel
