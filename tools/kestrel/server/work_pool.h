// The threads that do a request's CPU-heavy preparation (JSON parsing, chat templating,
// tokenization, detokenization) for `kestrel serve`, so that the event-loop threads stay free for
// every other connection: /health answers at once while multi-megabyte prompts are tokenized.
//
// Two lanes, each with its own threads, so that one kind of work never queues behind the other:
// Generation (completions and chat, whose prompts are bounded by the context: milliseconds to a
// few hundred) and Tokenizer (/tokenize and /detokenize, unbounded in size as in vLLM: seconds per
// request for megabytes). Within a lane jobs start in arrival order.
//
// Every job carries a cancel flag (the request's: set when its client goes away). The pool sets
// the flags of the running jobs when it shuts down, and work that may take long (Tokenizer::encode)
// reads its flag and stops, so shutdown waits milliseconds, not for the tokenization to end.
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
#include <mutex>
#include <unordered_set>
#include <utility>

namespace kestrel::cli {

enum class WorkLane { Generation, Tokenizer };

class WorkPool : public boost::asio::execution_context::service {
 public:
  static boost::asio::execution_context::id id;

  explicit WorkPool(boost::asio::execution_context& ctx);
  WorkPool(const WorkPool&) = delete;
  WorkPool& operator=(const WorkPool&) = delete;

  // The pool of the io_context that runs `ex` (created on first use).
  static WorkPool& of(const boost::asio::any_io_executor& ex);

  // Runs work() on a thread of `lane`, then done(result) on `ex` (a connection's strand, which
  // keeps the connection's handlers in order). cancel: the job's flag, which must live until work
  // returns (work owns it); the pool sets it on shutdown while work runs, and work should give up
  // when it is set. work must answer its own errors (it should not throw: an exception is logged
  // and done never runs).
  template <class Work, class Done>
  void run(WorkLane lane, boost::asio::any_io_executor ex, std::atomic<bool>* cancel, Work work, Done done) {
    boost::asio::post(lane == WorkLane::Generation ? generation_ : tokenizer_,
                      [this, ex = std::move(ex), cancel, work = std::move(work), done = std::move(done)]() mutable {
                        if (!enter(cancel)) return;
                        try {
                          auto result = work();
                          leave(cancel);
                          boost::asio::post(ex, [done = std::move(done), result = std::move(result)]() mutable {
                            done(std::move(result));
                          });
                        } catch (const std::exception& e) {
                          leave(cancel);
                          std::cerr << "kestrel serve: request preparation failed: " << e.what() << std::endl;
                        }
                      });
  }

 private:
  void shutdown() override;
  // Registers a starting job's flag; false when the pool is stopping (the job is skipped).
  bool enter(std::atomic<bool>* cancel);
  void leave(std::atomic<bool>* cancel);

  std::mutex mutex_;
  bool stopping_ = false;                         // guarded by mutex_
  std::unordered_set<std::atomic<bool>*> running_;  // guarded by mutex_: flags of the jobs running now
  boost::asio::thread_pool generation_;
  boost::asio::thread_pool tokenizer_;
};

}  // namespace kestrel::cli
