#include "server/work_pool.h"

#include <boost/asio/query.hpp>

#include <algorithm>
#include <thread>

namespace kestrel::cli {

namespace {
// Tokenizing is single-threaded per request; a few threads let that many requests prepare at once
// without taking every core from the engine thread.
size_t pool_threads() { return std::clamp<size_t>(std::thread::hardware_concurrency(), 1, 4); }
}  // namespace

boost::asio::execution_context::id WorkPool::id;

WorkPool::WorkPool(boost::asio::execution_context& ctx) : service(ctx), pool_(pool_threads()) {}

WorkPool& WorkPool::of(const boost::asio::any_io_executor& ex) {
  return boost::asio::use_service<WorkPool>(boost::asio::query(ex, boost::asio::execution::context));
}

void WorkPool::shutdown() {
  stopping_ = true;
  pool_.join();  // waits for the jobs running now; the others return at once
}

}  // namespace kestrel::cli
