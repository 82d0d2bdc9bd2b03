// The threads that do a request's CPU-heavy preparation (JSON parsing, chat templating,
// tokenization, detokenization) for `kestrel serve`, so that the event-loop threads stay free for
// every other connection: /health answers at once while multi-megabyte prompts are tokenized.
//
// One pool per io_context, as an Asio service: destroying the io_context shuts its services down
// newest first, so this pool (created after the scheduler and the strand service) is joined before
// they go, and a job that finishes late still posts to a live io_context, whose destruction then
// discards the posted handler. Jobs not yet started when the pool shuts down are skipped.
#pragma once

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/execution_context.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/thread_pool.hpp>

#include <atomic>
#include <exception>
#include <iostream>
#include <utility>

namespace kestrel::cli {

class WorkPool : public boost::asio::execution_context::service {
 public:
  static boost::asio::execution_context::id id;

  explicit WorkPool(boost::asio::execution_context& ctx);
  WorkPool(const WorkPool&) = delete;
  WorkPool& operator=(const WorkPool&) = delete;

  // The pool of the io_context that runs `ex` (created on first use).
  static WorkPool& of(const boost::asio::any_io_executor& ex);

  // Runs work() on a pool thread, then done(result) on `ex` (a connection's strand, which keeps
  // the connection's handlers in order). work must answer its own errors (it should not throw:
  // an exception is logged and done never runs).
  template <class Work, class Done>
  void run(boost::asio::any_io_executor ex, Work work, Done done) {
    boost::asio::post(
        pool_, [this, ex = std::move(ex), work = std::move(work), done = std::move(done)]() mutable {
          if (stopping_) return;
          try {
            auto result = work();
            boost::asio::post(ex, [done = std::move(done), result = std::move(result)]() mutable {
              done(std::move(result));
            });
          } catch (const std::exception& e) {
            std::cerr << "kestrel serve: request preparation failed: " << e.what() << std::endl;
          }
        });
  }

 private:
  void shutdown() override;

  std::atomic<bool> stopping_{false};
  boost::asio::thread_pool pool_;
};

}  // namespace kestrel::cli
