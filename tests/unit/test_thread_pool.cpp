#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

#include "core/thread_pool.h"

using kestrel::ThreadPool;

TEST(ThreadPool, EveryShareRunsExactlyOncePerCall) {
  for (int n_threads : {1, 2, 3, 8}) {
    ThreadPool pool(n_threads);
    std::vector<std::atomic<int>> hits(static_cast<size_t>(n_threads));
    for (int rep = 0; rep < 2000; ++rep) {
      pool.run([&](int ith, int nth) {
        EXPECT_EQ(nth, n_threads);
        hits[static_cast<size_t>(ith)].fetch_add(1);
      });
    }
    for (int i = 0; i < n_threads; ++i) EXPECT_EQ(hits[static_cast<size_t>(i)].load(), 2000) << i;
  }
}

TEST(ThreadPool, ParallelForCoversTheRangeOnce) {
  ThreadPool pool(4);  // more threads than this machine's cores: shares get claimed by the caller
  for (int64_t n : {0, 1, 2, 5, 17, 1000}) {
    std::vector<std::atomic<int>> seen(static_cast<size_t>(n));
    for (int rep = 0; rep < 200; ++rep)
      pool.parallel_for(n, 3, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) seen[static_cast<size_t>(i)].fetch_add(1);
      });
    for (int64_t i = 0; i < n; ++i) EXPECT_EQ(seen[static_cast<size_t>(i)].load(), 200) << i;
  }
}

TEST(ThreadPool, CallsAfterIdleSleepStillComplete) {
  ThreadPool pool(2);
  std::atomic<int> count{0};
  for (int rep = 0; rep < 3; ++rep) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // workers fall asleep on the futex
    pool.run([&](int, int) { count.fetch_add(1); });
  }
  EXPECT_EQ(count.load(), 6);
}
