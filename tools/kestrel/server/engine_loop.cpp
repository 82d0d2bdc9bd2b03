#include "server/engine_loop.h"

#include <algorithm>
#include <exception>
#include <iostream>
#include <string>

#include "kv_transfer_config.h"

namespace kestrel::cli {

RequestChannel::State RequestChannel::state() const {
  std::lock_guard lock(mutex_);
  return state_;
}

bool RequestChannel::take_outputs(std::vector<ChoiceOutput>* out) {
  std::lock_guard lock(mutex_);
  armed_ = true;
  if (outputs_.empty()) return false;
  for (ChoiceOutput& o : outputs_) out->push_back(std::move(o));
  outputs_.clear();
  return true;
}

const std::function<void()>* RequestChannel::fire_locked() {
  if (!armed_ || !notify_) return nullptr;
  armed_ = false;
  return &notify_;  // const after construction: the caller may run it without the lock
}

std::string RequestChannel::error() const {
  std::lock_guard lock(mutex_);
  return error_;
}

void RequestChannel::set_state(State s, std::string error) {
  const std::function<void()>* fire = nullptr;
  {
    std::lock_guard lock(mutex_);
    state_ = s;
    error_ = std::move(error);
    fire = fire_locked();
  }
  if (fire) (*fire)();
}

void RequestChannel::push(ChoiceOutput o) {
  const std::function<void()>* fire = nullptr;
  {
    std::lock_guard lock(mutex_);
    outputs_.push_back(std::move(o));
    fire = fire_locked();
  }
  if (fire) (*fire)();
}

EngineLoop::EngineLoop(Engine& engine, std::function<void(const RequestOutput&)> on_finished)
    : engine_(engine), on_finished_(std::move(on_finished)) {
  publish();
  thread_ = std::thread([this] { run(); });
}

EngineLoop::~EngineLoop() { shutdown(); }

std::shared_ptr<RequestChannel> EngineLoop::submit(std::vector<Request> requests, std::function<void()> notify) {
  std::shared_ptr<RequestChannel> channel(new RequestChannel(requests.size(), std::move(notify)));
  {
    std::lock_guard lock(mutex_);
    if (!stopping_) {
      commands_.push_back(Command{Command::Kind::Submit, channel, std::move(requests)});
      cv_.notify_one();
      return channel;
    }
  }
  channel->set_state(RequestChannel::State::Unavailable, "the server is shutting down");
  return channel;
}

void EngineLoop::abort(const std::shared_ptr<RequestChannel>& channel) {
  std::lock_guard lock(mutex_);
  if (stopping_) return;  // everything is being aborted anyway
  commands_.push_back(Command{Command::Kind::Abort, channel, {}});
  cv_.notify_one();
}

void EngineLoop::shutdown() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  cv_.notify_one();
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
}

bool EngineLoop::accepting() const {
  std::lock_guard lock(mutex_);
  return !stopping_;
}

EngineSnapshot EngineLoop::snapshot() const {
  std::lock_guard lock(snapshot_mutex_);
  return snapshot_;
}

void EngineLoop::pull_kv(RequestId id, bool cuda_ipc, KvPullDone done) {
  {
    std::lock_guard lock(mutex_);
    if (!stopping_) {
      Command c{Command::Kind::PullKv, nullptr, {}, id, cuda_ipc, std::move(done), {}};
      commands_.push_back(std::move(c));
      cv_.notify_one();
      return;
    }
  }
  done({}, "the server is shutting down", 503);
}

void EngineLoop::release_kv(RequestId id, std::function<void(bool)> done) {
  {
    std::lock_guard lock(mutex_);
    if (!stopping_) {
      Command c{Command::Kind::ReleaseKv, nullptr, {}, id, false, {}, std::move(done)};
      commands_.push_back(std::move(c));
      cv_.notify_one();
      return;
    }
  }
  done(false);
}

void EngineLoop::hold_until(RequestId id) {
  const auto timeout = hold_timeout_s_ > 0 ? std::chrono::duration<double>(hold_timeout_s_)
                                           : std::chrono::duration<double>(1e9);
  held_until_[id] =
      std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(timeout);
}

void EngineLoop::apply_pull(Command& c) {
  if (engine_.held_kv_blocks(c.kv_id).empty()) {  // never held, already pulled or released, or timed out
    held_until_.erase(c.kv_id);
    return c.kv_done({}, "KV transfer: request " + std::to_string(c.kv_id) + " holds no K/V", 404);
  }
  std::string body, error;
  try {
    std::vector<int32_t> tokens;
    if (c.kv_ipc) {
      const KvImport kv = engine_.export_held_kv_ipc(c.kv_id, &tokens);
      // Held on for the consumer's copy: the hold restarts, so a consumer that admits the request
      // within it reads blocks no one has reused.
      hold_until(c.kv_id);
      return c.kv_done(encode_kv_ipc(kv, tokens, hold_timeout_s_ > 0 ? hold_timeout_s_ : 1e9), {}, 200);
    }
    const KvImport kv = engine_.export_held_kv(c.kv_id, &tokens);
    body = encode_kv_blocks(kv, tokens);
  } catch (const std::exception& e) {
    // A CUDA IPC pull this producer cannot answer (no IPC on its backend) leaves the blocks held:
    // a pull through host memory may follow.
    if (c.kv_ipc) return c.kv_done({}, e.what(), 409);
    error = e.what();
  }
  // Pulled or not pullable: either way the blocks are not held any longer.
  engine_.release_held_kv(c.kv_id);
  held_until_.erase(c.kv_id);
  c.kv_done(std::move(body), std::move(error), error.empty() ? 200 : 500);
}

void EngineLoop::release_expired_kv() {
  const auto now = std::chrono::steady_clock::now();
  for (auto it = held_until_.begin(); it != held_until_.end();) {
    if (it->second <= now) {
      engine_.release_held_kv(it->first);
      it = held_until_.erase(it);
    } else {
      ++it;
    }
  }
}

void EngineLoop::apply(Command& c) {
  if (c.kind == Command::Kind::PullKv) return apply_pull(c);
  if (c.kind == Command::Kind::ReleaseKv) {
    const bool held = !engine_.held_kv_blocks(c.kv_id).empty();
    engine_.release_held_kv(c.kv_id);
    held_until_.erase(c.kv_id);
    return c.release_done(held);
  }
  RequestChannel& ch = *c.channel;
  if (c.kind == Command::Kind::Abort) {
    for (RequestId id : ch.ids_)
      if (routes_.count(id) != 0) engine_.abort_request(id);
    return;
  }
  std::vector<RequestId> ids;
  try {
    for (Request& r : c.requests) ids.push_back(engine_.add_request(std::move(r)));
  } catch (const std::exception& e) {
    // All or none: the choices already added go (their "abort" outputs have no route).
    for (RequestId id : ids) engine_.abort_request(id);
    ch.set_state(RequestChannel::State::Rejected, e.what());
    return;
  }
  ch.ids_ = ids;
  for (size_t i = 0; i < ids.size(); ++i) routes_[ids[i]] = Route{c.channel, static_cast<int32_t>(i)};
  ch.set_state(RequestChannel::State::Admitted);
}

void EngineLoop::route(std::vector<RequestOutput>& outputs) {
  for (RequestOutput& o : outputs) {
    const auto it = routes_.find(o.id);
    if (it == routes_.end()) continue;
    const Route r = it->second;
    if (o.finished) {
      if (!o.kv_held_blocks.empty()) hold_until(o.id);
      on_finished_(o);
      routes_.erase(it);
    }
    r.channel->push(ChoiceOutput{r.index, std::move(o)});
  }
}

void EngineLoop::publish() {
  EngineSnapshot s;
  s.stats = engine_.stats();
  s.n_running = engine_.n_running();
  s.n_waiting = engine_.n_waiting();
  s.n_held_kv = engine_.n_held_kv();
  s.alive = true;
  std::lock_guard lock(snapshot_mutex_);
  snapshot_ = s;
}

void EngineLoop::fail_all(const std::string& error) {
  for (auto& [id, r] : routes_) {
    ChoiceOutput o{r.index, RequestOutput{}};
    o.output.id = id;
    o.output.finished = true;
    o.output.finish_reason = "error";
    o.output.error = error;
    r.channel->push(std::move(o));
  }
  routes_.clear();
}

void EngineLoop::run() {
  bool aborted_all = false;
  for (;;) {
    std::deque<Command> commands;
    bool stopping = false;
    {
      std::unique_lock lock(mutex_);
      // Sleep only when the engine has nothing to do (has_unfinished is read by this thread only).
      if (!engine_.has_unfinished()) {
        const auto wake = [&] { return !commands_.empty() || stopping_; };
        if (held_until_.empty()) {
          cv_.wait(lock, wake);
        } else {  // wake for the first held K/V to expire
          auto first = held_until_.begin()->second;
          for (const auto& [id, t] : held_until_) first = std::min(first, t);
          cv_.wait_until(lock, first, wake);
        }
      }
      commands.swap(commands_);
      stopping = stopping_;
    }
    try {
      release_expired_kv();
      for (Command& c : commands) {
        if (stopping && c.kind == Command::Kind::PullKv) {
          c.kv_done({}, "the server is shutting down", 503);
          continue;
        }
        if (stopping && c.kind == Command::Kind::ReleaseKv) {
          c.release_done(false);
          continue;
        }
        if (stopping && c.kind == Command::Kind::Submit) {
          c.channel->set_state(RequestChannel::State::Unavailable, "the server is shutting down");
          continue;
        }
        apply(c);
      }
      if (stopping && !aborted_all) {
        for (const auto& [id, r] : routes_) engine_.abort_request(id);
        aborted_all = true;
      }
      if (engine_.has_unfinished()) {
        std::vector<RequestOutput> outputs = engine_.step();
        publish();  // first: a client that has its output sees the step in /metrics too
        route(outputs);
      } else if (stopping) {
        break;
      } else {
        publish();
      }
    } catch (const std::exception& e) {
      // Not expected (the engine ends a request with an error rather than throwing): every open
      // request fails, and the server stops taking new ones.
      std::cerr << "kestrel serve: engine failure: " << e.what() << "\n";
      fail_all(std::string("engine failure: ") + e.what());
      std::lock_guard lock(mutex_);
      stopping_ = true;
      break;
    }
  }
  std::deque<Command> left;
  {
    std::lock_guard lock(mutex_);
    left.swap(commands_);
  }
  for (Command& c : left) {
    if (c.kind == Command::Kind::Submit)
      c.channel->set_state(RequestChannel::State::Unavailable, "the server is shutting down");
    if (c.kind == Command::Kind::PullKv) c.kv_done({}, "the server is shutting down", 503);
    if (c.kind == Command::Kind::ReleaseKv) c.release_done(false);
  }
  fail_all("the server is shutting down");
  std::lock_guard lock(snapshot_mutex_);
  snapshot_.alive = false;
}

}  // namespace kestrel::cli
