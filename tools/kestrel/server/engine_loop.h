// The server's engine thread: the only thread that touches the Engine. HTTP threads hand it native
// requests through a queue and read each request's outputs from its own channel; no JSON here.
//
//   HTTP thread                       engine thread
//   submit(requests) --commands-->    add_request ... step() ... route outputs --> channel.push
//   channel.wait() <------------------------------------------------------------------'
//   abort(channel)   --commands-->    abort_request (a client went away: its KV blocks are freed)
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "engine/engine.h"

namespace kestrel::cli {

// One output of one choice (the index-th engine request of an HTTP request).
struct ChoiceOutput {
  int32_t index = 0;
  RequestOutput output;
};

// The outputs of one HTTP request's engine requests, from the engine thread to the HTTP thread that
// waits for them. Thread-safe.
class RequestChannel {
 public:
  // Rejected: the engine refused a request (error() says why; a client error). Unavailable: the
  // server is shutting down or its engine failed.
  enum class State { Pending, Admitted, Rejected, Unavailable };

  // Waits until the engine thread has taken or refused the requests, at most `timeout`. Returns
  // the state then.
  State wait_admission(std::chrono::milliseconds timeout);
  // Moves every output that has arrived into *out (appending); waits up to `timeout` when there is
  // none yet. Returns false when nothing arrived.
  bool wait_outputs(std::vector<ChoiceOutput>* out, std::chrono::milliseconds timeout);
  std::string error() const;
  size_t n_choices() const { return n_choices_; }

 private:
  friend class EngineLoop;
  explicit RequestChannel(size_t n_choices) : n_choices_(n_choices) {}
  void set_state(State s, std::string error = {});
  void push(ChoiceOutput o);

  const size_t n_choices_;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  State state_ = State::Pending;
  std::string error_;
  std::vector<ChoiceOutput> outputs_;
  // Engine ids of the choices, in index order (engine thread only).
  std::vector<RequestId> ids_;
};

// What /metrics and /health read, published by the engine thread after each step.
struct EngineSnapshot {
  EngineStats stats;
  size_t n_running = 0;
  size_t n_waiting = 0;
  bool alive = true;  // false once the engine thread stopped (shutdown or an engine failure)
};

class EngineLoop {
 public:
  // Starts the engine thread. The engine must outlive the loop. on_finished runs on the engine
  // thread for each finished engine request (metrics); it must not block.
  EngineLoop(Engine& engine, std::function<void(const RequestOutput&)> on_finished);
  ~EngineLoop();  // shutdown() and join
  EngineLoop(const EngineLoop&) = delete;
  EngineLoop& operator=(const EngineLoop&) = delete;

  // Queues the choices of one HTTP request (at least one). The channel reports admission (all of
  // them added, or none: the engine's add_request error, or a shutting-down loop) and then every
  // output. Never throws for a bad request.
  std::shared_ptr<RequestChannel> submit(std::vector<Request> requests);
  // Aborts every unfinished choice of the channel (the client went away); their blocks are freed
  // by the engine thread before its next step.
  void abort(const std::shared_ptr<RequestChannel>& channel);
  // Stops taking requests, aborts the running ones (their channels get finished "abort" outputs)
  // and ends the engine thread. Idempotent.
  void shutdown();
  bool accepting() const;

  EngineSnapshot snapshot() const;

 private:
  struct Command {
    enum class Kind { Submit, Abort } kind;
    std::shared_ptr<RequestChannel> channel;
    std::vector<Request> requests;  // Submit
  };
  struct Route {
    std::shared_ptr<RequestChannel> channel;
    int32_t index;
  };

  void run();
  void apply(Command& c);
  void route(std::vector<RequestOutput>& outputs);
  void publish();
  void fail_all(const std::string& error);

  Engine& engine_;
  std::function<void(const RequestOutput&)> on_finished_;
  mutable std::mutex mutex_;  // guards commands_, stopping_
  std::condition_variable cv_;
  std::deque<Command> commands_;
  bool stopping_ = false;
  std::unordered_map<RequestId, Route> routes_;  // engine thread only
  mutable std::mutex snapshot_mutex_;
  EngineSnapshot snapshot_;
  std::thread thread_;
};

}  // namespace kestrel::cli
