// The routes of `kestrel serve` behind the HTTP layer (http_session.h hands it complete requests on
// the connection's strand): the OpenAI endpoints (/v1/completions and /v1/chat/completions in
// http_generate.h; /v1/models), vLLM's tokenizer endpoints (/tokenize, /detokenize,
// /tokenizer_info), /health and /metrics. Nothing here waits: generations answer as the engine's
// outputs arrive, /health and /metrics read the engine thread's snapshot, and what costs CPU time
// in proportion to the body (parsing, templating, tokenizing, detokenizing: the generation routes,
// /tokenize, /detokenize) runs on a WorkPool thread (work_pool.h), so the event-loop threads
// answer other connections meanwhile.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <string_view>

#include "kv_transfer_config.h"
#include "openai_request.h"
#include "server/engine_loop.h"
#include "server/http_session.h"
#include "server/kv_transfer.h"
#include "server/server_metrics.h"

namespace kestrel::cli {

// What the handlers share. Everything referenced outlives the server.
struct ApiState {
  ApiState(std::string name, const PromptFormat& f, int64_t len, EngineLoop& l, ServerMetrics& m);

  std::string served_model_name;  // what /v1/models lists and `model` must match
  const PromptFormat& format;
  int64_t max_model_len;  // the engine's context per sequence
  // The most bytes of input text one token of Tokenizer::encode stands for: the longest
  // vocabulary text or decoded piece, and at least 4. Each token covers the input bytes its
  // piece decodes to (byte-level BPE), or its vocabulary text (SentencePiece, whose '\u2581' a
  // literal U+2581 in the input also matches; added tokens), or one UTF-8 character (an unknown
  // token); U+FFFD replacement and the dummy prefix only add bytes. So text longer than
  // max_model_len x this has more than max_model_len tokens.
  size_t max_token_bytes;
  EngineLoop& loop;
  ServerMetrics& metrics;
  int64_t started;  // Unix seconds, /v1/models' "created"
  std::atomic<int64_t> open_generations{0};  // generations whose responses are not written yet
  // Disaggregated prefill (kv_transfer_config.h): the role and settings, and the port this server
  // listens on (remote_port in a producer's answers), set before it serves.
  std::optional<KvTransferConfig> kv_transfer;
  int port = 0;
  std::unique_ptr<KvPuller> kv_puller;  // a consumer's pulls (kv_transfer.h); null unless it consumes

  uint64_t random_seed();  // for requests without a seed

  // A producer's remote_request_id for engine request id: "<id>-<tag>", the tag 32 hex digits of a
  // hash of id keyed by 192 random bytes drawn at start-up, so that held K/V (and the prompt's token
  // ids in it) cannot be pulled or released by guessing the engine's sequential ids.
  // kv_transfer_request_id reverses it: nullopt for any other text.
  std::string kv_transfer_id(RequestId id) const;
  std::optional<RequestId> kv_transfer_request_id(std::string_view text) const;

 private:
  std::mutex seed_mutex_;
  std::mt19937_64 seeds_;
  std::array<unsigned char, 192> kv_id_key_{};
};

// The Dispatch of the HTTP layer.
void handle_request(ApiState& api, const std::shared_ptr<HttpSession>& session, HttpRequest req);

}  // namespace kestrel::cli
