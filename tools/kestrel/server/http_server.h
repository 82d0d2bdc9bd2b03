// The OpenAI-compatible HTTP front of `kestrel serve`: Boost.Beast on an Asio io_context run by a few
// threads (--http-threads). Connections (http_session.h) are event-driven, so idle, slow or
// streaming clients hold no thread; the handlers (http_api.h) never wait on the engine thread but
// are told when its outputs arrive. Routes: POST /v1/completions, POST /v1/chat/completions,
// GET /v1/models[/{id}], POST /tokenize, POST /detokenize, GET /tokenizer_info, GET /health,
// GET /metrics.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "kv_transfer_config.h"
#include "openai_request.h"
#include "server/engine_loop.h"
#include "server/http_head.h"
#include "server/server_metrics.h"

namespace kestrel::cli {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8000;                // 0: any free port (bind() returns it)
  std::string api_key;            // non-empty: /v1/* requests need "Authorization: Bearer <key>"
  std::string served_model_name;  // what /v1/models lists and `model` must match
  int http_threads = 4;           // threads running the event loop and the handlers
  int64_t max_connections = 0;    // open connections at most; more get a 503 and are closed
  HttpLimits limits;
  std::optional<KvTransferConfig> kv_transfer;  // --kv-transfer-config: disaggregated prefill
  // The engine's runner: a consumer maps producers' CUDA IPC handles with it (KvPuller); must be
  // set for a consumer.
  const ModelRunner* runner = nullptr;
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
  // Serves on options.http_threads threads (this one among them) until stop(); returns once they
  // have all ended.
  void serve();
  // Thread-safe. Stops accepting, closes idle and half-read connections, lets the open responses
  // (which EngineLoop::shutdown has just ended) write their last chunks, then ends serve(): at most
  // `grace` later, whatever the clients do. Call after EngineLoop::shutdown.
  void stop(std::chrono::milliseconds grace = std::chrono::milliseconds(3000));

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kestrel::cli
