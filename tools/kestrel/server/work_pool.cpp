#include "server/work_pool.h"

#include <boost/asio/query.hpp>

#include <algorithm>
#include <thread>

namespace kestrel::cli {

namespace {
// Tokenizing is single-threaded per request; a few threads let that many requests prepare at once
// without taking every core from the engine thread. The tokenizer endpoints get their own threads,
// at least 2 so that one multi-megabyte /tokenize does not hold up a small one.
size_t generation_threads() { return std::clamp<size_t>(std::thread::hardware_concurrency(), 1, 4); }
size_t tokenizer_threads() { return std::clamp<size_t>(std::thread::hardware_concurrency() / 2, 2, 4); }
}  // namespace

boost::asio::execution_context::id WorkPool::id;

WorkPool::WorkPool(boost::asio::execution_context& ctx)
    : service(ctx), generation_(generation_threads()), tokenizer_(tokenizer_threads()) {}

WorkPool& WorkPool::of(const boost::asio::any_io_executor& ex) {
  return boost::asio::use_service<WorkPool>(boost::asio::query(ex, boost::asio::execution::context));
}

bool WorkPool::enter(std::atomic<bool>* cancel) {
  std::lock_guard lock(mutex_);
  if (stopping_) return false;
  running_.insert(cancel);
  return true;
}

void WorkPool::leave(std::atomic<bool>* cancel) {
  std::lock_guard lock(mutex_);
  running_.erase(cancel);
}

void WorkPool::shutdown() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
    for (std::atomic<bool>* c : running_) *c = true;  // the running jobs give up
  }
  // Waits for the running jobs, which see their flags within milliseconds; the others return at once.
  generation_.join();
  tokenizer_.join();
}

}  // namespace kestrel::cli
