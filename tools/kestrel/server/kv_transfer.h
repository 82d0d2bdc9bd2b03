// Disaggregated prefill's transport on the consumer side: the pull of a producer's held K/V over
// HTTP (GET /v1/kv_transfer/{remote_request_id}, answered by the producer's EngineLoop::pull_kv),
// with Boost.Beast, the library the server already uses; and, between processes on one GPU, the
// pull of the blocks' CUDA IPC handles (GET .../cuda_ipc), whose copy the engine makes device to
// device, followed by the release (DELETE /v1/kv_transfer/{remote_request_id}).
#pragma once

#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "backend/model_runner.h"
#include "engine/engine.h"
#include "kv_transfer_config.h"
#include "server/server_metrics.h"

namespace kestrel::cli {

// One HTTP/1.1 exchange with a producer at host:port within timeout_s seconds (connect, request and
// answer together): the answer's status and body. api_key: sent as "Authorization: Bearer
// <api_key>" (RFC 6750) unless empty. An answer body longer than max_body_bytes is not read (the
// producer is whoever the client names: it must not make this server buffer without bound).
// Errors: kestrel::Error saying what failed (the connection refused or timed out, the body too
// long).
struct KvHttpAnswer {
  int status = 0;
  std::string body;
};
KvHttpAnswer kv_transfer_exchange(const std::string& host, int port, bool del, const std::string& target,
                                  double timeout_s, const std::string& api_key, uint64_t max_body_bytes);

// Pulls request `remote_request_id`'s K/V bytes from the producer at host:port;
// *tokens gets the token ids they were computed from; max_body_bytes as kv_transfer_exchange's.
// Errors: kestrel::Error saying what failed: the connection (refused, timed out), a non-200 answer
// (its status and message, e.g. 401 for a missing or wrong key), or a malformed record
// (decode_kv_blocks).
KvImport pull_kv_blocks(const std::string& host, int port, const std::string& remote_request_id, double timeout_s,
                        const std::string& api_key, uint64_t max_body_bytes, std::vector<int32_t>* tokens);

// A consumer's pulls by its kv_transport (KvTransport): CUDA IPC when the config asks for it, or
// for auto when this server runs on CUDA and the producer has not yet answered without IPC;
// through host memory otherwise. Thread-safe (the server's preparation threads pull).
class KvPuller {
 public:
  // runner: this server's, which maps the producer's handles (ModelRunner::open_kv_ipc). All three
  // must outlive the puller. max_model_len bounds the record a pull reads: a prompt of at most that
  // many tokens, each kv_bytes_per_token() bytes and its id in the header.
  KvPuller(const KvTransferConfig& config, const ModelRunner& runner, ServerMetrics& metrics, int64_t max_model_len);
  ~KvPuller();

  // Pulls p's K/V. By CUDA IPC the import carries the producer's handles (mapped) and block ids,
  // ipc_valid_until (the producer's hold, less a margin) and remote_hold, whose release sends the
  // DELETE on a thread of this puller's, so the engine thread never waits on the network. With
  // auto, an IPC pull the producer cannot answer (409: no IPC there), another GPU or handles that
  // do not open (logged once per producer) fall back to host memory, and that producer is pulled
  // through host memory from then on. Errors: kestrel::Error (the request gets a 502): the
  // exchange, a non-200 answer, a malformed record, or with cuda_ipc any IPC failure (the
  // producer's blocks are then released).
  KvImport pull(const KvTransferParams& p, std::vector<int32_t>* tokens);

 private:
  struct Release {
    std::string host;
    int port = 0;
    std::string id;
  };
  // The releases, sent in order by one thread; shared with the imports' remote_hold deleters,
  // which may run after the puller is gone (the engine outlives the server).
  struct Releaser {
    std::mutex mutex;
    std::condition_variable cv;
    std::deque<Release> queue;
    bool stopping = false;
    double timeout_s = 5;
    std::string api_key;
    std::thread thread;
    void post(Release r);
    void run();
    ~Releaser();
  };

  KvImport pull_host(const KvTransferParams& p, std::vector<int32_t>* tokens);
  bool ipc_off(const std::string& producer);
  void note_ipc_off(const std::string& producer, const std::string& why);

  const KvTransferConfig& config_;
  const ModelRunner& runner_;
  ServerMetrics& metrics_;
  std::shared_ptr<Releaser> releaser_;
  uint64_t max_record_bytes_ = 0;
  std::mutex mutex_;
  std::map<std::string, bool> ipc_off_;  // by "host:port": auto pulls through host memory there
};

}  // namespace kestrel::cli
