// The OpenAI-compatible HTTP front of `kestrel serve` (cpp-httplib; its thread pool runs the
// handlers). Routes: POST /v1/completions, POST /v1/chat/completions (JSON or server-sent events),
// GET /v1/models, GET /health, GET /metrics. Handlers parse and validate the JSON, apply the chat
// template and tokenize, then hand native requests to the EngineLoop and turn its outputs into
// OpenAI objects. httplib stays inside http_server.cpp.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "openai_request.h"
#include "server/engine_loop.h"
#include "server/server_metrics.h"

namespace kestrel::cli {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8000;                // 0: any free port (bind() returns it)
  std::string api_key;            // non-empty: /v1/* requests need "Authorization: Bearer <key>"
  std::string served_model_name;  // what /v1/models lists and `model` must match
  int http_threads = 512;         // connections served at once (a streaming client holds one)
};

class HttpServer {
 public:
  // Everything given must outlive the server. max_model_len: the engine's context per sequence.
  HttpServer(const ServerOptions& options, const PromptFormat& format, int64_t max_model_len, EngineLoop& loop,
             ServerMetrics& metrics);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Binds the address. Returns the port; throws kestrel::Error when the address cannot be bound.
  int bind();
  // Serves until stop() (from another thread); returns once every connection thread has ended.
  void serve();
  // Waits (at most 10 s) for the responses of open generations to be written, then stops
  // listening. Call after EngineLoop::shutdown, which ends those generations.
  void stop();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kestrel::cli
