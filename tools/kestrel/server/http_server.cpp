#include "server/http_server.h"

#include <httplib.h>
#include <sys/resource.h>
#include <sys/socket.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <ctime>
#include <iostream>
#include <mutex>
#include <random>

#include "server/connection_probe.h"
#include "server/openai_api.h"

namespace kestrel::cli {

namespace {
using std::chrono::milliseconds;
// How often a waiting handler checks whether its client is still there.
constexpr milliseconds kPoll{100};
// nginx's code for "client closed the request", for the metrics of requests nobody received.
constexpr int kClientClosed = 499;
// The connection threads' nice value (see ConnectionThreads). Measured on the 2-core VM with 256
// streaming clients: 29-35 s for the run against 31-41 s at nice 0 (other jobs made it noisy).
constexpr int kConnectionNice = 10;

// httplib listens with a backlog of 5: a burst of clients connecting at once would lose SYNs and
// wait for retransmits (1 s, then 3 s). listen() again on the bound socket only raises the backlog.
class Server : public httplib::Server {
 public:
  void widen_backlog(int n) { ::listen(svr_sock_, n); }
};

// httplib's pool, with its connection threads below the engine's in CPU priority. The CPU
// backend's fork-join steps wait for their slowest thread; hundreds of connection threads waking
// after every step to write their chunks would otherwise take cores from it in mid-step.
class ConnectionThreads : public httplib::TaskQueue {
 public:
  ConnectionThreads(size_t n, int nice) : pool_(n), nice_(nice) {}
  void enqueue(std::function<void()> fn) override {
    pool_.enqueue([this, fn = std::move(fn)] {
      thread_local bool lowered = false;
      if (!lowered) {
        setpriority(PRIO_PROCESS, 0, nice_);  // Linux: 0 = the calling thread
        lowered = true;
      }
      fn();
    });
  }
  void shutdown() override { pool_.shutdown(); }

 private:
  httplib::ThreadPool pool_;
  int nice_;
};

void send_error(httplib::Response& res, int status, const std::string& message, const std::string& param = "",
                const std::string& code = "", const std::string& type = "invalid_request_error") {
  res.status = status;
  res.set_content(dump(error_body(message, type, param, code)), "application/json");
}

// No Content-Type (curl -d without -H sends a form type, but also clients that send none) or
// application/json with parameters; anything else is 415.
bool is_json_content_type(const httplib::Request& req) {
  std::string t = req.get_header_value("Content-Type");
  std::transform(t.begin(), t.end(), t.begin(), [](unsigned char c) { return std::tolower(c); });
  return t.empty() || t.rfind("application/json", 0) == 0;
}

// Compares without an early exit, so the time taken does not tell how much of a key matched.
bool same_secret(const std::string& a, const std::string& b) {
  unsigned diff = a.size() != b.size();
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i]) ^ static_cast<unsigned char>(b[i % std::max<size_t>(1, b.size())]);
  return diff == 0;
}

// Counts the generations whose responses are not written yet, so that a stop can wait for them.
class OpenJobs {
 public:
  void add() {
    std::lock_guard lock(mutex_);
    ++n_;
  }
  void remove() {
    {
      std::lock_guard lock(mutex_);
      --n_;
    }
    cv_.notify_all();
  }
  // True when none is left within the timeout.
  bool wait_none(std::chrono::milliseconds timeout) {
    std::unique_lock lock(mutex_);
    return cv_.wait_for(lock, timeout, [&] { return n_ == 0; });
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  int64_t n_ = 0;
};

// One HTTP request's generation: its choices as they arrive and what is needed to answer. Lives
// until httplib has written (or given up on) the response.
struct Job {
  ResponseHeader header;
  std::shared_ptr<RequestChannel> channel;
  std::vector<int32_t> stop_ids;
  int64_t n_prompt = 0;
  bool want_logprobs = false;
  bool include_usage = false;
  std::string echo_text;  // completions with echo: the prompt text
  std::vector<int32_t> prompt_ids;  // echo with logprobs: the prompt's tokens, listed in the logprobs
  struct Choice {
    std::string text;
    LoggedTokens logged;      // non-streamed: every logged token
    std::vector<LogprobSummary> prompt_logprobs;  // non-streamed echo with logprobs
    bool echo_sent = false;   // streamed echo with logprobs: the echo chunk is out
    int64_t text_offset = 0;  // completions logprobs: characters before the next token
    bool finished = false;
    std::string finish_reason, error;
    int64_t n_output = 0;
  };
  std::vector<Choice> choices;
  size_t n_finished = 0;
  bool started = false;  // the first chunks (chat: the role; completions: the echo) were written
  bool done = false;     // the whole answer was written
  ConnectionProbe probe;

  std::chrono::steady_clock::time_point last_probe{};

  OpenJobs& open_jobs;

  Job(const httplib::Request& req, OpenJobs& open) : probe(req), open_jobs(open) { open_jobs.add(); }
  ~Job() { open_jobs.remove(); }
  Job(const Job&) = delete;
  Job& operator=(const Job&) = delete;

  // At most every kPoll (outputs may arrive every few ms): has the client closed the connection?
  bool client_gone() {
    const auto now = std::chrono::steady_clock::now();
    if (now - last_probe < kPoll) return false;
    last_probe = now;
    return probe.closed();
  }

  int64_t n_completion() const {
    int64_t n = 0;
    for (const Choice& c : choices) n += c.n_output;
    return n;
  }
  // Records a finished output; the choice's text is appended by the caller.
  void finish(Choice& c, const RequestOutput& o) {
    c.finished = true;
    c.finish_reason = o.finish_reason;
    c.error = o.error;
    c.n_output = o.metrics.n_output_tokens;
    ++n_finished;
  }
};
}  // namespace

struct HttpServer::Impl {
  Impl(const ServerOptions& o, const PromptFormat& f, int64_t len, EngineLoop& l, ServerMetrics& m)
      : options(o), format(f), max_model_len(len), loop(l), metrics(m), seeds(std::random_device{}()),
        started(std::time(nullptr)) {}

  void routes();
  void generate(const httplib::Request& req, httplib::Response& res, RequestApi api);
  void complete(Job& job, httplib::Response& res);
  bool stream_step(Job& job, httplib::DataSink& sink);
  std::string chunks_for(Job& job, ChoiceOutput& o);
  Json models_json() const;
  uint64_t random_seed() {
    std::lock_guard lock(seed_mutex);
    return seeds();
  }

  ServerOptions options;
  const PromptFormat& format;
  int64_t max_model_len;
  EngineLoop& loop;
  ServerMetrics& metrics;
  std::mutex seed_mutex;
  std::mt19937_64 seeds;  // for requests without a seed
  int64_t started;
  OpenJobs open_jobs;
  Server svr;
};

HttpServer::HttpServer(const ServerOptions& options, const PromptFormat& format, int64_t max_model_len,
                       EngineLoop& loop, ServerMetrics& metrics)
    : impl_(std::make_unique<Impl>(options, format, max_model_len, loop, metrics)) {
  impl_->routes();
}

HttpServer::~HttpServer() = default;

int HttpServer::bind() {
  Impl& m = *impl_;
  int port = m.options.port;
  bool ok = false;
  if (port == 0) {
    port = m.svr.bind_to_any_port(m.options.host);
    ok = port > 0;
  } else {
    ok = m.svr.bind_to_port(m.options.host, port);
  }
  if (!ok)
    throw Error("cannot listen on " + m.options.host + ":" + std::to_string(m.options.port) +
                " (address in use, or not an address of this machine)");
  m.svr.widen_backlog(4096);
  return port;
}

void HttpServer::serve() { impl_->svr.listen_after_bind(); }
void HttpServer::stop() {
  // httplib stops calling a stream's provider once it is stopping: give the open responses (which
  // EngineLoop::shutdown has just ended) time to write their last chunks and [DONE] first.
  impl_->open_jobs.wait_none(std::chrono::seconds(10));
  impl_->svr.stop();
}

Json HttpServer::Impl::models_json() const {
  Json model{{"id", options.served_model_name},
             {"object", "model"},
             {"created", started},
             {"owned_by", "kestrel"},
             {"max_model_len", max_model_len}};
  return Json{{"object", "list"}, {"data", Json::array({model})}};
}

void HttpServer::Impl::routes() {
  const int n_threads = std::max(1, options.http_threads);
  svr.new_task_queue = [n_threads] { return new ConnectionThreads(static_cast<size_t>(n_threads), kConnectionNice); };
  // A stop waits for every connection thread: an idle keep-alive connection or a half-sent request
  // holds one for up to these timeouts (reads), a client that stopped reading its stream for the
  // write timeout.
  svr.set_keep_alive_max_count(1000);
  svr.set_keep_alive_timeout(5);
  svr.set_read_timeout(5, 0);
  svr.set_write_timeout(30, 0);
  svr.set_payload_max_length(size_t{64} << 20);  // 413 above 64 MiB
  svr.set_tcp_nodelay(true);                     // each SSE chunk goes out at once

  svr.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (options.api_key.empty() || req.path.rfind("/v1/", 0) != 0) return Server::HandlerResponse::Unhandled;
    const std::string auth = req.get_header_value("Authorization");
    if (auth.rfind("Bearer ", 0) == 0 && same_secret(auth.substr(7), options.api_key))
      return Server::HandlerResponse::Unhandled;
    send_error(res, 401, "missing or incorrect API key: send the header Authorization: Bearer <key>", "",
               "invalid_api_key");
    return Server::HandlerResponse::Handled;
  });
  svr.set_error_handler(Server::HandlerWithResponse([](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return Server::HandlerResponse::Unhandled;  // a handler's own error body
    if (res.status == 404)
      send_error(res, 404, "no route " + req.method + " " + req.path, "", "not_found");
    else
      send_error(res, res.status, "HTTP error " + std::to_string(res.status));
    return Server::HandlerResponse::Handled;
  }));
  svr.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
    std::string what = "unknown exception";
    try {
      std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    send_error(res, 500, "internal error: " + what, "", "", "server_error");
  });
  svr.set_logger([this](const httplib::Request&, const httplib::Response& res) { metrics.on_response(res.status); });

  svr.Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) {
    generate(req, res, RequestApi::Completions);
  });
  svr.Post("/v1/chat/completions", [this](const httplib::Request& req, httplib::Response& res) {
    generate(req, res, RequestApi::Chat);
  });
  svr.Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(dump(models_json()), "application/json");
  });
  svr.Get("/v1/models/(.+)", [this](const httplib::Request& req, httplib::Response& res) {
    if (req.matches[1] != options.served_model_name)
      return send_error(res, 404, "The model `" + req.matches[1].str() + "` does not exist.", "model", "model_not_found");
    res.set_content(dump(models_json()["data"][0]), "application/json");
  });
  svr.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    const bool ok = loop.snapshot().alive && loop.accepting();
    res.status = ok ? 200 : 503;
    res.set_content(ok ? "{\"status\":\"ok\"}" : "{\"status\":\"unavailable\"}", "application/json");
  });
  svr.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics.render(loop.snapshot()), "text/plain; version=0.0.4; charset=utf-8");
  });
  // The other method on a known route: 405 with the allowed one.
  auto not_allowed = [](const char* allow) {
    return [allow](const httplib::Request& req, httplib::Response& res) {
      res.set_header("Allow", allow);
      send_error(res, 405, req.method + " is not allowed on " + req.path + " (use " + allow + ")", "",
                 "method_not_allowed");
    };
  };
  for (const char* p : {"/v1/completions", "/v1/chat/completions"}) svr.Get(p, not_allowed("POST"));
  for (const char* p : {"/v1/models", "/health", "/metrics"}) svr.Post(p, not_allowed("GET"));
}

void HttpServer::Impl::generate(const httplib::Request& req, httplib::Response& res, RequestApi api) {
  if (!is_json_content_type(req))
    return send_error(res, 415, "Content-Type must be application/json, got " + req.get_header_value("Content-Type"),
                      "", "unsupported_media_type");
  Json j;
  try {
    j = Json::parse(req.body);  // rejects invalid UTF-8 and unpaired surrogates too
  } catch (const Json::exception& e) {
    return send_error(res, 400, std::string("invalid JSON body: ") + e.what());
  }
  if (!j.is_object())
    return send_error(res, 400, std::string("the request body must be a JSON object, got ") + j.type_name());
  OpenAiRequest r;
  Request base;
  try {
    r = parse_openai_request(j, api);
    if (!r.model.empty() && r.model != options.served_model_name)
      return send_error(res, 404,
                        "The model `" + r.model + "` does not exist; this server serves `" +
                            options.served_model_name + "`",
                        "model", "model_not_found");
    base = to_engine_request(r, format, 0);
  } catch (const RequestError& e) {
    return send_error(res, 400, e.what(), e.param());
  } catch (const Error& e) {
    return send_error(res, 400, e.what());
  }
  // The context holds prompt and output: a prompt that fills it is refused, never truncated.
  const auto n_prompt = static_cast<int64_t>(base.prompt.size());
  const std::string prompt_param = r.is_chat ? "messages" : "prompt";
  if (n_prompt >= max_model_len)
    return send_error(res, 400,
                      "the prompt has " + std::to_string(n_prompt) + " tokens but the context (max_model_len) is " +
                          std::to_string(max_model_len) + " tokens, which must also hold at least one output token",
                      prompt_param, "context_length_exceeded");
  if (r.max_tokens > 0 && n_prompt + r.max_tokens > max_model_len)
    return send_error(res, 400,
                      "max_tokens = " + std::to_string(r.max_tokens) + " plus the prompt's " + std::to_string(n_prompt) +
                          " tokens exceed the context of " + std::to_string(max_model_len) +
                          " tokens (max_tokens may be at most " + std::to_string(max_model_len - n_prompt) + ")",
                      "max_tokens", "context_length_exceeded");

  // n choices: n engine requests on the same prompt; with a seed, choice i draws from seed + i.
  // They are admitted in the same step, so each prefills the prompt (the prefix cache only shares
  // blocks computed in earlier steps; forking one prefilled sequence would save that work).
  std::vector<Request> requests(static_cast<size_t>(r.n), base);
  for (int32_t i = 0; i < r.n; ++i)
    requests[static_cast<size_t>(i)].sampling.seed = r.seed ? *r.seed + static_cast<uint64_t>(i) : random_seed();

  auto job = std::make_shared<Job>(req, open_jobs);
  job->header = ResponseHeader{new_response_id(r.is_chat ? "chatcmpl-" : "cmpl-"), std::time(nullptr),
                               options.served_model_name, api == RequestApi::Chat};
  job->stop_ids = base.stop_ids;
  job->n_prompt = n_prompt;
  job->want_logprobs = r.logprobs >= 0;
  job->include_usage = r.stream && r.include_usage;
  if (r.echo) job->echo_text = prompt_text(r, *format.tokenizer);
  if (r.echo && job->want_logprobs) job->prompt_ids = base.prompt;
  job->choices.resize(static_cast<size_t>(r.n));
  job->channel = loop.submit(std::move(requests));

  RequestChannel::State state;
  while ((state = job->channel->wait_admission(kPoll)) == RequestChannel::State::Pending) {
    if (job->client_gone()) {
      loop.abort(job->channel);  // queued after the submit: it aborts whatever was admitted
      res.status = kClientClosed;
      return;
    }
  }
  if (state == RequestChannel::State::Rejected) return send_error(res, 400, job->channel->error());
  if (state == RequestChannel::State::Unavailable)
    return send_error(res, 503, job->channel->error(), "", "unavailable", "server_error");

  if (!r.stream) return complete(*job, res);
  res.set_header("Cache-Control", "no-cache");
  res.set_header("X-Accel-Buffering", "no");
  res.set_chunked_content_provider(
      "text/event-stream", [this, job](size_t, httplib::DataSink& sink) { return stream_step(*job, sink); },
      // Runs when the response is over: a write that failed or a stream cut short aborts what is
      // left, so the engine frees the blocks of a client that went away.
      [this, job](bool success) {
        if (!success || !job->done) loop.abort(job->channel);
      });
}

void HttpServer::Impl::complete(Job& job, httplib::Response& res) {
  std::vector<ChoiceOutput> outputs;
  while (job.n_finished < job.choices.size()) {
    outputs.clear();
    const bool got = job.channel->wait_outputs(&outputs, kPoll);
    if (job.client_gone()) {
      loop.abort(job.channel);
      res.status = kClientClosed;
      return;
    }
    if (!got) continue;
    for (ChoiceOutput& o : outputs) {
      Job::Choice& c = job.choices[static_cast<size_t>(o.index)];
      c.text += o.output.text_delta;
      if (!o.output.prompt_logprobs.empty()) c.prompt_logprobs = o.output.prompt_logprobs;
      if (job.want_logprobs) {
        LoggedTokens t = logged_tokens(o.output, job.stop_ids);
        c.logged.ids.insert(c.logged.ids.end(), t.ids.begin(), t.ids.end());
        c.logged.logprobs.insert(c.logged.logprobs.end(), t.logprobs.begin(), t.logprobs.end());
      }
      if (o.output.finished) job.finish(c, o.output);
    }
  }
  std::vector<FinalChoice> choices;
  for (size_t i = 0; i < job.choices.size(); ++i) {
    Job::Choice& c = job.choices[i];
    if (c.finish_reason == "error")
      return send_error(res, 500, "generation failed: " + c.error, "", "", "server_error");
    if (c.finish_reason == "abort")
      return send_error(res, 503, "the server is shutting down", "", "unavailable", "server_error");
    FinalChoice f;
    f.index = static_cast<int32_t>(i);
    f.text = job.echo_text + c.text;
    if (job.want_logprobs && job.header.chat) {
      f.logprobs = chat_logprobs(*format.tokenizer, c.logged);
    } else if (job.want_logprobs) {
      if (!job.echo_text.empty())
        f.logprobs = echo_logprobs(*format.tokenizer, job.prompt_ids, c.prompt_logprobs, &c.text_offset);
      append_completion_logprobs(f.logprobs, completion_logprobs(*format.tokenizer, c.logged, &c.text_offset));
    }
    f.finish_reason = c.finish_reason;
    choices.push_back(std::move(f));
  }
  res.set_content(dump(full_response(job.header, choices, usage_json(job.n_prompt, job.n_completion()))),
                  "application/json");
}

std::string HttpServer::Impl::chunks_for(Job& job, ChoiceOutput& co) {
  Job::Choice& c = job.choices[static_cast<size_t>(co.index)];
  const RequestOutput& o = co.output;
  std::string out;
  if (o.finished && o.finish_reason == "error") {
    job.finish(c, o);
    return sse_event(error_body("generation failed: " + o.error, "server_error"));
  }
  if (!job.echo_text.empty() && job.want_logprobs && !c.echo_sent) {
    // Echo with logprobs: the prompt goes out with its logprobs, which come with the first token.
    c.echo_sent = true;
    ChunkChoice echo;
    echo.index = co.index;
    echo.text = job.echo_text;
    echo.logprobs = echo_logprobs(*format.tokenizer, job.prompt_ids, o.prompt_logprobs, &c.text_offset);
    out += sse_event(stream_chunk(job.header, echo, job.include_usage));
  }
  ChunkChoice chunk;
  chunk.index = co.index;
  if (job.want_logprobs) {
    const LoggedTokens t = logged_tokens(o, job.stop_ids);
    if (!t.ids.empty())
      chunk.logprobs = job.header.chat ? chat_logprobs(*format.tokenizer, t)
                                       : completion_logprobs(*format.tokenizer, t, &c.text_offset);
  }
  const bool has_news = !o.text_delta.empty() || !chunk.logprobs.is_null();
  if (o.finished) job.finish(c, o);
  if (job.header.chat) {
    if (has_news) {
      chunk.text = o.text_delta;
      out += sse_event(stream_chunk(job.header, chunk, job.include_usage));
    }
    if (o.finished) {
      ChunkChoice last;
      last.index = co.index;
      last.finish_reason = o.finish_reason;
      out += sse_event(stream_chunk(job.header, last, job.include_usage));
    }
  } else if (has_news || o.finished) {
    chunk.text = o.text_delta;
    if (o.finished) chunk.finish_reason = o.finish_reason;
    out += sse_event(stream_chunk(job.header, chunk, job.include_usage));
  }
  return out;
}

bool HttpServer::Impl::stream_step(Job& job, httplib::DataSink& sink) {
  if (job.done) {
    sink.done();
    return true;
  }
  std::string buf;
  if (!job.started) {
    job.started = true;
    for (size_t i = 0; i < job.choices.size(); ++i) {
      ChunkChoice first;
      first.index = static_cast<int32_t>(i);
      if (job.header.chat) {
        first.role = true;
        first.text = "";
      } else if (!job.echo_text.empty() && !job.want_logprobs) {  // with logprobs: see chunks_for
        first.text = job.echo_text;
      } else {
        continue;
      }
      buf += sse_event(stream_chunk(job.header, first, job.include_usage));
    }
  }
  std::vector<ChoiceOutput> outputs;
  // With something to send already, only take what has arrived; else wait a while. A failed
  // write tells that the client went away, but only once something is written: check meanwhile.
  if (job.channel->wait_outputs(&outputs, buf.empty() ? kPoll : milliseconds(0)))
    for (ChoiceOutput& o : outputs) buf += chunks_for(job, o);
  if (job.client_gone()) return false;
  const bool all_finished = job.n_finished == job.choices.size();
  if (all_finished) {
    if (job.include_usage) buf += sse_event(usage_chunk(job.header, usage_json(job.n_prompt, job.n_completion())));
    buf += kSseDone;
  }
  if (!buf.empty() && !sink.write(buf.data(), buf.size())) return false;
  if (all_finished) {
    job.done = true;
    sink.done();
  }
  return true;
}

}  // namespace kestrel::cli
