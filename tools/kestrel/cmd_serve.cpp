// kestrel serve: the engine behind an OpenAI-compatible HTTP server (server/http_server.h). Threads:
// httplib's pool (parse, template, tokenize, write responses), one engine thread (server/
// engine_loop.h: the only one that touches the Engine), the CPU backend's pool, and a signal thread
// that turns SIGINT/SIGTERM into a graceful stop.
#include <CLI/CLI.hpp>

#include <pthread.h>
#include <signal.h>

#include <cstdio>
#include <filesystem>
#include <iostream>
#include <thread>

#include "common.h"
#include "core/error.h"
#include "openai_request.h"
#include "server/engine_loop.h"
#include "server/http_server.h"
#include "server/server_metrics.h"

namespace kestrel::cli {

namespace {
struct ServeArgs {
  std::string model;
  ServerOptions server;
  EngineServingFlags engine;
};

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

  const std::string path = resolve_model_path(a.model);
  LoadedModel lm = load_model(path);
  if (a.server.served_model_name.empty()) a.server.served_model_name = default_model_name(path);
  const std::unique_ptr<Engine> engine = a.engine.make_engine(lm);
  const PromptFormat format = PromptFormat::for_model(*lm.model, *lm.tokenizer);
  const EngineConfig& config = engine->config();

  ServerMetrics metrics;
  EngineLoop loop(*engine, [&metrics](const RequestOutput& o) { metrics.on_finished(o); });
  HttpServer http(a.server, format, config.max_model_len, loop, metrics);
  const int port = http.bind();
  std::cerr << "kestrel serve: " << a.server.served_model_name << " on http://" << a.server.host << ":" << port
            << " (max_model_len " << config.max_model_len << ", " << config.n_kv_blocks << " KV blocks of "
            << config.block_size << " tokens, max_num_seqs " << config.max_num_seqs << ", "
            << a.server.http_threads << " HTTP threads" << (a.server.api_key.empty() ? "" : ", API key required")
            << ")" << std::endl;

  std::thread signals([&] {
    int sig = 0;
    sigwait(&stop_signals, &sig);
    std::cerr << "kestrel serve: " << (sig == SIGINT ? "SIGINT" : "SIGTERM")
              << ": stopping (open requests are aborted)" << std::endl;
    loop.shutdown();  // open requests end with "abort", new ones get 503
    http.stop();
    sigwait(&stop_signals, &sig);  // a second signal: do not wait for slow connections
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
  a->engine.engine.max_num_seqs = 256;  // serving: many clients decode together
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
                  "Connections served at once; each streaming client holds one")
      ->check(CLI::Range(1, 16384))
      ->capture_default_str();
  a->engine.add_to(*sub);
  sub->callback([a] { run_serve(*a); });
}

}  // namespace kestrel::cli
