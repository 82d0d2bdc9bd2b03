// The server's engine thread: the only thread that touches the Engine. HTTP handlers hand it native
// requests through a queue and read each request's outputs from its own channel; no JSON here.
//
//   HTTP handler                         engine thread
//   submit(requests, notify) --commands-->  add_request ... step() ... route outputs --> channel.push
//   notify() posts to the connection; it takes the outputs  <--------------------------------'
//   abort(channel)           --commands-->  abort_request (a client went away: its KV blocks are freed)
//
// Nothing here blocks an HTTP thread: the channel calls its notify function (on the engine thread)
// when there is something to take, and the HTTP side takes it on its own thread.
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

// The outputs of one HTTP request's engine requests, from the engine thread to the HTTP side.
// Thread-safe.
//
// Notification: the notify function given to EngineLoop::submit runs on the engine thread (without
// the channel's lock held) when the state changes or outputs arrive, once; take_outputs() arms it
// again. So a consumer that, on each call, reads state() and takes the outputs never misses one
// and is called at most once per take. It must not block (post to an executor and return).
class RequestChannel {
 public:
  // Rejected: the engine refused a request (error() says why; a client error). Unavailable: the
  // server is shutting down or its engine failed.
  enum class State { Pending, Admitted, Rejected, Unavailable };

  State state() const;
  // Moves every output that has arrived into *out (appending) and arms the notification again.
  // Returns false when nothing had arrived.
  bool take_outputs(std::vector<ChoiceOutput>* out);
  std::string error() const;
  size_t n_choices() const { return n_choices_; }

 private:
  friend class EngineLoop;
  RequestChannel(size_t n_choices, std::function<void()> notify) : n_choices_(n_choices), notify_(std::move(notify)) {}
  void set_state(State s, std::string error = {});
  void push(ChoiceOutput o);
  // Under mutex_: takes the notification if it is armed (the caller runs it after unlocking).
  const std::function<void()>* fire_locked();

  const size_t n_choices_;
  const std::function<void()> notify_;  // may be empty
  mutable std::mutex mutex_;
  bool armed_ = true;
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
  size_t n_held_kv = 0;  // do_remote_decode requests whose K/V blocks wait for a pull
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
  // output; notify (see RequestChannel) tells when to look. Never throws for a bad request.
  std::shared_ptr<RequestChannel> submit(std::vector<Request> requests, std::function<void()> notify = {});
  // Aborts every unfinished choice of the channel (the client went away); their blocks are freed
  // by the engine thread before its next step.
  void abort(const std::shared_ptr<RequestChannel>& channel);
  // Stops taking requests, aborts the running ones (their channels get finished "abort" outputs)
  // and ends the engine thread. Idempotent.
  void shutdown();
  bool accepting() const;
  // Disaggregated prefill, producer side. Held K/V no one pulls within `seconds` of its
  // request's end are freed (kv_transfer_config's abort_request_timeout); 0 = never.
  void set_kv_hold_timeout(double seconds) { hold_timeout_s_ = seconds; }
  // A consumer's pull of request `id`'s held K/V: on the engine thread, the blocks' record
  // (encode_kv_blocks) is made and the blocks are freed; `done` gets the body, or an empty body and
  // the error and an HTTP status for it (404: unknown id, never held, already pulled or released,
  // or timed out; 409: no CUDA IPC on this backend; 503: shutting down). done runs on the engine
  // thread and must not block.
  // With cuda_ipc the record is encode_kv_ipc's (the runner's CUDA IPC handles and the block ids)
  // and the blocks stay held, for hold seconds from now (the hold timeout), until release_kv.
  using KvPullDone = std::function<void(std::string body, std::string error, int status)>;
  void pull_kv(RequestId id, bool cuda_ipc, KvPullDone done);
  // A consumer is done with request `id`'s held K/V (its CUDA IPC copy): they are freed on the
  // engine thread; done(true) when it held them, (false) for an unknown id. done runs on the engine
  // thread and must not block.
  void release_kv(RequestId id, std::function<void(bool)> done);

  EngineSnapshot snapshot() const;

 private:
  struct Command {
    enum class Kind { Submit, Abort, PullKv, ReleaseKv } kind;
    std::shared_ptr<RequestChannel> channel;
    std::vector<Request> requests;  // Submit
    RequestId kv_id = 0;            // PullKv, ReleaseKv
    bool kv_ipc = false;            // PullKv: CUDA IPC
    KvPullDone kv_done;
    std::function<void(bool)> release_done;
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
  void apply_pull(Command& c);
  void hold_until(RequestId id);
  void release_expired_kv();

  Engine& engine_;
  std::function<void(const RequestOutput&)> on_finished_;
  mutable std::mutex mutex_;  // guards commands_, stopping_
  std::condition_variable cv_;
  std::deque<Command> commands_;
  bool stopping_ = false;
  std::unordered_map<RequestId, Route> routes_;  // engine thread only
  double hold_timeout_s_ = 0;
  // Held K/V by request id: when each is freed unpulled (engine thread only).
  std::unordered_map<RequestId, std::chrono::steady_clock::time_point> held_until_;
  mutable std::mutex snapshot_mutex_;
  EngineSnapshot snapshot_;
  std::thread thread_;
};

}  // namespace kestrel::cli
