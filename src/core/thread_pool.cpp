#include "core/thread_pool.h"

#include <algorithm>
#include <string>
#include <system_error>

#include "core/error.h"
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define KESTREL_PAUSE() _mm_pause()
#else
#define KESTREL_PAUSE() std::this_thread::yield()
#endif

namespace kestrel {

namespace {
// About 50-200 us of spinning before a worker sleeps: long enough to cover the gap between two
// kernels of one forward pass, short enough not to burn a core while the engine waits for input.
constexpr int kSpinIterations = 1 << 15;
}  // namespace

ThreadPool::ThreadPool(int n_threads) {
  if (n_threads <= 0) n_threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  n_threads_ = n_threads;
  shares_ = std::make_unique<Share[]>(static_cast<size_t>(n_threads_));
  try {
    for (int i = 1; i < n_threads_; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
  } catch (const std::system_error& e) {
    stop_workers();
    throw Error("cannot start " + std::to_string(n_threads_) + " threads: " + e.what());
  }
}

void ThreadPool::stop_workers() {
  stop_.store(true, std::memory_order_release);
  generation_.fetch_add(1, std::memory_order_acq_rel);  // wakes the workers, which see stop_
  generation_.notify_all();
  for (auto& t : workers_) t.join();
  workers_.clear();
}

ThreadPool::~ThreadPool() { stop_workers(); }

bool ThreadPool::claim(int ith, uint64_t g) {
  auto& c = shares_[static_cast<size_t>(ith)].claimed;
  uint64_t seen = c.load(std::memory_order_acquire);
  while (seen < g)
    if (c.compare_exchange_weak(seen, g, std::memory_order_acq_rel)) return true;
  return false;
}

void ThreadPool::worker_loop(int ith) {
  uint64_t seen = 0;
  for (;;) {
    uint64_t g = generation_.load(std::memory_order_acquire);
    for (int spin = 0; g == seen && spin < kSpinIterations; ++spin) {
      KESTREL_PAUSE();
      g = generation_.load(std::memory_order_acquire);
    }
    while (g == seen) {
      generation_.wait(seen, std::memory_order_acquire);
      g = generation_.load(std::memory_order_acquire);
    }
    seen = g;
    if (stop_.load(std::memory_order_acquire)) return;
    if (claim(ith, g)) {
      (*job_)(ith, n_threads_);
      shares_[static_cast<size_t>(ith)].done.store(g, std::memory_order_release);
    }
  }
}

void ThreadPool::run(const std::function<void(int, int)>& fn) {
  if (n_threads_ == 1) {
    fn(0, 1);
    return;
  }
  job_ = &fn;
  const uint64_t g = generation_.load(std::memory_order_relaxed) + 1;
  generation_.store(g, std::memory_order_release);
  generation_.notify_all();
  fn(0, n_threads_);
  for (int ith = 1; ith < n_threads_; ++ith) {
    if (claim(ith, g)) {
      fn(ith, n_threads_);
      shares_[static_cast<size_t>(ith)].done.store(g, std::memory_order_release);
    }
  }
  for (int ith = 1; ith < n_threads_; ++ith) {
    int spin = 0;
    while (shares_[static_cast<size_t>(ith)].done.load(std::memory_order_acquire) != g) {
      // The share's worker is running (it claimed it); give it the CPU if it was preempted.
      if (++spin < 4096) KESTREL_PAUSE();
      else std::this_thread::yield();
    }
  }
}

void ThreadPool::parallel_for(int64_t n, int64_t grain,
                              const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  const int64_t max_chunks = (n + grain - 1) / grain;
  const int nth = static_cast<int>(std::min<int64_t>(n_threads_, max_chunks));
  if (nth <= 1) {
    fn(0, n);
    return;
  }
  run([&](int ith, int) {
    if (ith >= nth) return;
    const int64_t begin = n * ith / nth;
    const int64_t end = n * (ith + 1) / nth;
    fn(begin, end);
  });
}

}  // namespace kestrel
