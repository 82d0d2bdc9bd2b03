// A fork-join thread pool for the compute kernels.
//
// Decode runs a few hundred small kernels per token, so waking workers must cost well under a
// microsecond: workers spin on a generation counter for a while and only then block (C++20
// atomic wait, a futex on Linux). The caller takes part as thread 0.
#pragma once

#include <atomic>
#include <functional>
#include <thread>
#include <vector>

namespace kestrel {

class ThreadPool {
 public:
  // n_threads: total threads including the caller; <= 0 means std::thread::hardware_concurrency().
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

  int n_threads_;
  std::vector<std::thread> workers_;
  const std::function<void(int, int)>* job_ = nullptr;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<bool> stop_{false};
};

}  // namespace kestrel
