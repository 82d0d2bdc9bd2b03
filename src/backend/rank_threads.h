// Threads that run one function per rank of a tensor-parallel group, shared by the backends'
// tensor-parallel runners. Internal to src/backend.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "core/error.h"

namespace kestrel {

// One thread per rank (or stage) beyond the caller's (rank 0): run(fn) calls fn(r) for every rank at once and
// returns when all are done, rethrowing the lowest rank's exception.
class RankThreads {
 public:
  explicit RankThreads(int n) : errors_(static_cast<size_t>(n)) {
    for (int r = 1; r < n; ++r) threads_.emplace_back([this, r] { loop(r); });
  }
  ~RankThreads() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    start_.notify_all();
    for (std::thread& t : threads_) t.join();
  }
  void run(const std::function<void(int)>& fn) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      fn_ = &fn;
      pending_ = static_cast<int>(threads_.size());
      ++generation_;
    }
    start_.notify_all();
    call(0, fn);
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [&] { return pending_ == 0; });
    for (std::exception_ptr& e : errors_)
      if (e) std::rethrow_exception(std::exchange(e, nullptr));
  }

 private:
  void call(int r, const std::function<void(int)>& fn) {
    try {
      fn(r);
    } catch (...) {
      errors_[static_cast<size_t>(r)] = std::current_exception();
    }
  }
  void loop(int r) {
    uint64_t seen = 0;
    for (;;) {
      const std::function<void(int)>* fn;
      {
        std::unique_lock<std::mutex> lock(mu_);
        start_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
        fn = fn_;
      }
      call(r, *fn);
      std::lock_guard<std::mutex> lock(mu_);
      if (--pending_ == 0) done_.notify_one();
    }
  }
  std::mutex mu_;
  std::condition_variable start_, done_;
  const std::function<void(int)>* fn_ = nullptr;
  uint64_t generation_ = 0;
  int pending_ = 0;
  bool stop_ = false;
  std::vector<std::exception_ptr> errors_;
  std::vector<std::thread> threads_;
};

// A reusable barrier of n threads that abort() breaks for good.
class AbortableBarrier {
 public:
  explicit AbortableBarrier(int n) : n_(n) {}
  void arrive_and_wait() {
    std::unique_lock<std::mutex> lock(mu_);
    if (aborted_) throw_aborted();
    const uint64_t gen = generation_;
    if (++arrived_ == n_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return;
    }
    cv_.wait(lock, [&] { return generation_ != gen || aborted_; });
    if (generation_ == gen) throw_aborted();
  }
  void abort() {
    std::lock_guard<std::mutex> lock(mu_);
    aborted_ = true;
    cv_.notify_all();
  }

 private:
  [[noreturn]] static void throw_aborted() {
    throw Error("tensor parallel: another rank failed, so this collective cannot complete");
  }
  std::mutex mu_;
  std::condition_variable cv_;
  int n_, arrived_ = 0;
  uint64_t generation_ = 0;
  bool aborted_ = false;
};

}  // namespace kestrel
