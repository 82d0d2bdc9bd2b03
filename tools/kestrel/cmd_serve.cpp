// kestrel serve: the engine behind an OpenAI-compatible HTTP server (server/http_server.h). Threads:
// --http-threads running the HTTP event loop and the handlers (parse, template, tokenize, write
// responses), one engine thread (server/engine_loop.h: the only one that touches the Engine), the
// CPU backend's pool, and a signal thread that turns SIGINT/SIGTERM into a graceful stop.
#include <CLI/CLI.hpp>

#include <pthread.h>
#include <signal.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <thread>

#include "common.h"
#include "core/error.h"
#include "kv_transfer_config.h"
#include "openai_request.h"
#include "server/engine_loop.h"
#include "server/http_server.h"
#include "server/server_metrics.h"

namespace kestrel::cli {

namespace {
struct ServeArgs {
  std::string model;
  ServerOptions server;
  KestrelConfig config;
  double keep_alive_s = 5;
  // HttpLimits' deadlines, in seconds (the flags' unit).
  double head_timeout_s = 10, body_timeout_s = 30, write_timeout_s = 30;
  uint64_t max_body_bytes = 8 << 20;
  std::string kv_transfer_config;  // --kv-transfer-config JSON; "" = no disaggregation
};

// Descriptors kept for everything but client connections (model files, the listening socket,
// pipes, logs).
constexpr int64_t kReservedFds = 64;

// Raises the soft descriptor limit to the hard one (each connection is a descriptor) and returns it.
int64_t raise_fd_limit() {
  rlimit rl{};
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0) return 1024;
  if (rl.rlim_cur < rl.rlim_max) {
    rlimit raised = rl;
    raised.rlim_cur = rl.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &raised) == 0) rl = raised;
  }
  return rl.rlim_cur == RLIM_INFINITY ? int64_t{1} << 20 : static_cast<int64_t>(rl.rlim_cur);
}

// The name clients use in `model`: the file or folder name of the model.
std::string default_model_name(const std::string& path) {
  std::filesystem::path p(path);
  while (!p.empty() && p.filename().empty()) p = p.parent_path();  // "dir/" -> "dir"
  return p.filename().string();
}

void run_serve(ServeArgs a) {
  // Every thread started from here on inherits the mask, so only the signal thread below sees
  // SIGINT/SIGTERM; a client that disconnects must not kill the process with SIGPIPE.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  signal(SIGPIPE, SIG_IGN);

  const int64_t fd_limit = raise_fd_limit();
  const int64_t max_connections_fit = std::max<int64_t>(1, fd_limit - kReservedFds);
  if (a.server.max_connections == 0) a.server.max_connections = max_connections_fit;
  if (a.server.max_connections > max_connections_fit)
    throw Error("--max-connections " + std::to_string(a.server.max_connections) + " exceeds what the descriptor limit (" +
                std::to_string(fd_limit) + ", ulimit -Hn) allows: at most " + std::to_string(max_connections_fit));
  const auto ms = [](double seconds) { return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000)); };
  a.server.limits.keep_alive_timeout = ms(a.keep_alive_s);
  a.server.limits.head_timeout = ms(a.head_timeout_s);
  a.server.limits.body_timeout = ms(a.body_timeout_s);
  a.server.limits.write_timeout = ms(a.write_timeout_s);
  a.server.limits.max_body_bytes = a.max_body_bytes;

  if (!a.kv_transfer_config.empty()) {
    a.server.kv_transfer = parse_kv_transfer_config(a.kv_transfer_config);
    // Without remote_api_key the producer is taken to share this server's key.
    if (a.server.kv_transfer->remote_api_key.empty()) a.server.kv_transfer->remote_api_key = a.server.api_key;
    if (a.server.kv_transfer->kv_transport == KvTransport::CudaIpc && a.config.device.device != "cuda")
      throw Error("--kv-transfer-config: kv_connector_extra_config.kv_transport \"cuda_ipc\" needs --device cuda "
                  "(CUDA IPC maps GPU memory; this server runs on the " + a.config.device.device + ")");
  }

  const std::string path = resolve_model_path(a.model);
  LoadedModel lm = load_model(path, a.config);
  require_tokenizer(lm, "serve");
  if (a.server.served_model_name.empty()) a.server.served_model_name = default_model_name(path);
  const std::unique_ptr<Engine> engine = make_engine(lm, a.config);
  PromptFormat format = PromptFormat::for_model(*lm.model, *lm.tokenizer);
  format.max_model_len = engine->config().max_model_len;
  // A template that does not parse would fail every chat request with an error that is not the client's.
  if (!format.template_error.empty())
    throw Error("the model's chat template (tokenizer.chat_template) does not parse: " + format.template_error);
  const EngineConfig& config = engine->config();

  a.server.runner = &engine->runner();

  ServerMetrics metrics;
  EngineLoop loop(*engine, [&metrics](const RequestOutput& o) { metrics.on_finished(o); });
  if (a.server.kv_transfer) loop.set_kv_hold_timeout(a.server.kv_transfer->abort_request_timeout);
  HttpServer http(a.server, format, config.max_model_len, loop, metrics);
  const int port = http.bind();
  std::cerr << "kestrel serve: " << a.server.served_model_name << " on http://" << a.server.host << ":" << port
            << " (max_model_len " << config.max_model_len << ", " << config.n_kv_blocks << " KV blocks of "
            << config.block_size << " tokens, max_num_seqs " << config.max_num_seqs << ", "
            << a.server.http_threads << " HTTP threads, at most " << a.server.max_connections << " connections"
            << (a.server.api_key.empty() ? "" : ", API key required")
            << (!a.server.kv_transfer ? ""
                : a.server.kv_transfer->kv_role == KvRole::Producer ? ", KV producer"
                : a.server.kv_transfer->kv_role == KvRole::Consumer ? ", KV consumer"
                                                                    : ", KV producer and consumer")
            << ")" << std::endl;

  std::thread signals([&] {
    int sig = 0;
    sigwait(&stop_signals, &sig);
    std::cerr << "kestrel serve: " << (sig == SIGINT ? "SIGINT" : "SIGTERM")
              << ": stopping (open requests are aborted; a second signal exits at once)" << std::endl;
    // The 3 s for writing the last chunks count from the signal: joining the engine thread
    // waits for the step in progress, which under a full batch takes a good part of a second.
    const auto signalled = std::chrono::steady_clock::now();
    loop.shutdown();  // open requests end with "abort", new ones get 503
    const auto spent = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - signalled);
    http.stop(std::max(std::chrono::milliseconds(0), std::chrono::milliseconds(3000) - spent));
    sigwait(&stop_signals, &sig);  // a second signal: exit now
    std::_Exit(1);
  });
  signals.detach();  // serve() returns only after it called stop(); the process then ends
  http.serve();
  loop.shutdown();
  std::cerr << "kestrel serve: stopped" << std::endl;
}
}  // namespace

void register_serve(CLI::App& app) {
  auto a = std::make_shared<ServeArgs>();
  a->config.scheduler.max_num_seqs = 256;  // serving: many clients decode together
  a->config.cache.populate_kv = true;  // serving: the KV pool resident from the start (flat RSS, no late OOM)
  CLI::App* sub = app.add_subcommand(
      "serve", "OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics");
  sub->add_option("-m,--model", a->model, kModelHelp);
  sub->add_option("--host", a->server.host, "Address to listen on")->capture_default_str();
  sub->add_option("--port", a->server.port, "TCP port; 0 = any free port (printed at start)")
      ->check(CLI::Range(0, 65535))
      ->capture_default_str();
  sub->add_option("--api-key", a->server.api_key,
                  "Require \"Authorization: Bearer KEY\" on /v1/* requests (default: $KESTREL_API_KEY, else none)")
      ->envname("KESTREL_API_KEY");
  sub->add_option("--served-model-name", a->server.served_model_name,
                  "Model name for /v1/models and the `model` field (default: the model's file or folder name)");
  sub->add_option("--http-threads", a->server.http_threads,
                  "Threads running the HTTP event loop and the request handlers (connections hold none)")
      ->check(CLI::Range(1, 256))
      ->capture_default_str();
  sub->add_option("--max-connections", a->server.max_connections,
                  "Open client connections at most; more get a 503 and are closed (default: the descriptor "
                  "limit, raised to its hard value, less " + std::to_string(kReservedFds) + ")")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 24));
  sub->add_option("--timeout-keep-alive", a->keep_alive_s,
                  "Seconds an idle keep-alive connection stays open between requests")
      ->check(CLI::Range(0.001, 3600.0))
      ->capture_default_str();
  sub->add_option("--timeout-request-head", a->head_timeout_s,
                  "Seconds a request head may take from its first byte; a slower one gets 408 and the connection "
                  "is closed")
      ->check(CLI::Range(0.001, 3600.0))
      ->capture_default_str();
  sub->add_option("--timeout-request-body", a->body_timeout_s,
                  "Seconds a request body may take from the end of its head (a client that sends less than its "
                  "Content-Length, or stalls in a chunked body); a slower one gets 408 and the connection is closed")
      ->check(CLI::Range(0.001, 3600.0))
      ->capture_default_str();
  sub->add_option("--timeout-write", a->write_timeout_s,
                  "Seconds one write of a response may wait for a client that stopped reading; the connection is "
                  "then dropped and its request aborted")
      ->check(CLI::Range(0.001, 3600.0))
      ->capture_default_str();
  sub->add_option("--max-body-size", a->max_body_bytes,
                  "Largest request body in bytes (suffixes KB, MB, KiB, MiB); larger ones get 413")
      ->transform(CLI::AsSizeValue(true))
      ->check(CLI::Range(uint64_t{1}, uint64_t{1} << 32))
      ->default_str("8MiB");
  sub->add_option("--kv-transfer-config", a->kv_transfer_config,
                  "Disaggregated prefill (vLLM's spelling), a JSON object: {\"kv_role\": \"kv_producer\" | "
                  "\"kv_consumer\" | \"kv_both\", \"kv_ip\": host consumers pull from (127.0.0.1), "
                  "\"engine_id\", \"abort_request_timeout\": seconds unpulled K/V stay held (480), "
                  "\"kv_pull_timeout\": seconds a pull may take (60), \"kv_connector_extra_config\": "
                  "{\"remote_api_key\": the producer's --api-key (default: this server's), \"kv_transport\": "
                  "\"auto\" (CUDA IPC when both sides run on one GPU, else host memory) | \"host\" | \"cuda_ipc\"}}")
      ->check([](const std::string& v) {
        try {
          parse_kv_transfer_config(v);
        } catch (const Error& e) {
          return std::string(e.what());
        }
        return std::string();
      });
  a->config.add_flags(*sub, EngineMode::Serving);
  sub->callback([a] { run_serve(*a); });
}

}  // namespace kestrel::cli
