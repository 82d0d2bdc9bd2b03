#include "server/kv_transfer.h"

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include <algorithm>
#include <chrono>
#include <iostream>

#include "core/error.h"

namespace kestrel::cli {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;

KvHttpAnswer kv_transfer_exchange(const std::string& host, int port, bool del, const std::string& target,
                                  double timeout_s, const std::string& api_key, uint64_t max_body_bytes) {
  const std::string where = "KV transfer from " + host + ":" + std::to_string(port);
  asio::io_context ioc;
  asio::ip::tcp::resolver resolver(ioc);
  beast::tcp_stream stream(ioc);
  http::request<http::empty_body> req{del ? http::verb::delete_ : http::verb::get, target, 11};
  req.set(http::field::host, host + ":" + std::to_string(port));
  if (!api_key.empty()) req.set(http::field::authorization, "Bearer " + api_key);
  beast::flat_buffer buffer;
  http::response_parser<http::string_body> parser;
  parser.body_limit(max_body_bytes);
  beast::error_code failure;
  const char* stage = "resolving the host";
  // Asynchronous steps run to completion here: the stream's expiry (one deadline for all of them)
  // applies only to asynchronous operations.
  stream.expires_after(std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000)));
  resolver.async_resolve(host, std::to_string(port), [&](beast::error_code ec, asio::ip::tcp::resolver::results_type r) {
    if (ec) return void(failure = ec);
    stage = "connecting";
    stream.async_connect(r, [&](beast::error_code ec2, const asio::ip::tcp::endpoint&) {
      if (ec2) return void(failure = ec2);
      stage = "sending the request";
      http::async_write(stream, req, [&](beast::error_code ec3, size_t) {
        if (ec3) return void(failure = ec3);
        stage = "reading the answer";
        http::async_read(stream, buffer, parser, [&](beast::error_code ec4, size_t) { failure = ec4; });
      });
    });
  });
  ioc.run();
  if (failure) throw Error(where + " failed while " + stage + ": " + failure.message());
  return KvHttpAnswer{static_cast<int>(parser.get().result_int()), std::move(parser.get().body())};
}

namespace {

constexpr uint64_t kMaxSmallAnswer = uint64_t{1} << 20;  // a release's answer; the slack of a record's

std::string failed(const std::string& host, int port, const KvHttpAnswer& a) {
  return "KV transfer from " + host + ":" + std::to_string(port) + " failed: HTTP " + std::to_string(a.status) + ": " +
         a.body.substr(0, 500);
}

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace

KvImport pull_kv_blocks(const std::string& host, int port, const std::string& remote_request_id, double timeout_s,
                        const std::string& api_key, uint64_t max_body_bytes, std::vector<int32_t>* tokens) {
  const KvHttpAnswer a = kv_transfer_exchange(host, port, false, "/v1/kv_transfer/" + remote_request_id, timeout_s,
                                              api_key, max_body_bytes);
  if (a.status != 200) throw Error(failed(host, port, a));
  return decode_kv_blocks(a.body, tokens);
}

void KvPuller::Releaser::post(Release r) {
  {
    std::lock_guard lock(mutex);
    queue.push_back(std::move(r));
  }
  cv.notify_one();
}

void KvPuller::Releaser::run() {
  for (;;) {
    Release r;
    {
      std::unique_lock lock(mutex);
      cv.wait(lock, [&] { return stopping || !queue.empty(); });
      if (queue.empty()) return;  // stopping, everything sent
      r = std::move(queue.front());
      queue.pop_front();
    }
    // Not sent (the producer is gone or answers otherwise): its hold timeout frees the blocks.
    try {
      const KvHttpAnswer a =
          kv_transfer_exchange(r.host, r.port, true, "/v1/kv_transfer/" + r.id, timeout_s, api_key, kMaxSmallAnswer);
      if (a.status != 200 && a.status != 404) std::cerr << "kestrel serve: " << failed(r.host, r.port, a) << std::endl;
    } catch (const Error& e) {
      std::cerr << "kestrel serve: releasing K/V: " << e.what() << std::endl;
    }
  }
}

KvPuller::Releaser::~Releaser() {
  {
    std::lock_guard lock(mutex);
    stopping = true;
  }
  cv.notify_one();
  if (thread.joinable()) {
    if (thread.get_id() == std::this_thread::get_id()) thread.detach();  // not expected: the last owner is never it
    else thread.join();
  }
}

KvPuller::KvPuller(const KvTransferConfig& config, const ModelRunner& runner, ServerMetrics& metrics,
                   int64_t max_model_len)
    : config_(config), runner_(runner), metrics_(metrics), releaser_(std::make_shared<Releaser>()) {
  // The record: a header line (the format, and each token id in at most 12 characters) and the
  // prompt's K/V; an IPC answer (handles and block ids) is smaller.
  max_record_bytes_ = static_cast<uint64_t>(std::max<int64_t>(1, max_model_len)) *
                          (static_cast<uint64_t>(std::max<int64_t>(0, runner.kv_bytes_per_token())) + 12) +
                      kMaxSmallAnswer;
  releaser_->timeout_s = std::min(config.kv_pull_timeout, 10.0);
  releaser_->api_key = config.remote_api_key;
  releaser_->thread = std::thread([r = releaser_.get()] { r->run(); });
}

KvPuller::~KvPuller() = default;

bool KvPuller::ipc_off(const std::string& producer) {
  std::lock_guard lock(mutex_);
  return ipc_off_.count(producer) != 0;
}

void KvPuller::note_ipc_off(const std::string& producer, const std::string& why) {
  {
    std::lock_guard lock(mutex_);
    if (!ipc_off_.emplace(producer, true).second) return;
  }
  std::cerr << "kestrel serve: KV transfer from " << producer << " through host memory (no CUDA IPC: " << why << ")"
            << std::endl;
}

KvImport KvPuller::pull(const KvTransferParams& p, std::vector<int32_t>* tokens) {
  const std::string producer = p.remote_host + ":" + std::to_string(p.remote_port);
  const bool forced = config_.kv_transport == KvTransport::CudaIpc;
  const bool try_ipc = forced || (config_.kv_transport == KvTransport::Auto && !runner_.device_uuid().empty() &&
                                  !ipc_off(producer));
  if (try_ipc) {
    const auto start = std::chrono::steady_clock::now();
    const KvHttpAnswer a = kv_transfer_exchange(p.remote_host, p.remote_port, false,
                                                "/v1/kv_transfer/" + p.remote_request_id + "/cuda_ipc",
                                                config_.kv_pull_timeout, config_.remote_api_key, max_record_bytes_);
    const Release release{p.remote_host, p.remote_port, p.remote_request_id};
    if (a.status == 200) {
      double hold_s = 0;
      KvImport kv = decode_kv_ipc(a.body, tokens, &hold_s);
      try {
        if (kv.ipc->device_uuid != runner_.device_uuid())
          throw Error("the producer runs on " + kv.ipc->device_uuid + ", this server on " +
                      (runner_.device_uuid().empty() ? std::string("the CPU") : runner_.device_uuid()));
        runner_.open_kv_ipc(*kv.ipc);
      } catch (const Error& e) {
        if (forced) {
          releaser_->post(release);
          throw Error(std::string("KV transfer by CUDA IPC (kv_transport \"cuda_ipc\") from ") + producer +
                      " failed: " + e.what());
        }
        note_ipc_off(producer, e.what());  // the blocks are still held: the host pull below takes them
        return pull_host(p, tokens);
      }
      // The producer may reuse its blocks once its hold ends: a margin for the clocks' start.
      kv.ipc_valid_until = start + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                       std::chrono::duration<double>(std::max(0.0, hold_s * 0.9 - 1.0)));
      kv.remote_hold = std::shared_ptr<void>(nullptr, [r = releaser_, release](void*) { r->post(release); });
      metrics_.on_kv_pull(true, seconds_since(start));
      return kv;
    }
    if (a.status != 409 || forced) {  // 404 (nothing held), 401 (the key), 409 with cuda_ipc forced
      if (a.status == 409) releaser_->post(release);
      throw Error(failed(p.remote_host, p.remote_port, a));
    }
    note_ipc_off(producer, a.body.substr(0, 300));
  }
  return pull_host(p, tokens);
}

KvImport KvPuller::pull_host(const KvTransferParams& p, std::vector<int32_t>* tokens) {
  const auto start = std::chrono::steady_clock::now();
  KvImport kv = pull_kv_blocks(p.remote_host, p.remote_port, p.remote_request_id, config_.kv_pull_timeout,
                               config_.remote_api_key, max_record_bytes_, tokens);
  metrics_.on_kv_pull(false, seconds_since(start));
  return kv;
}

}  // namespace kestrel::cli
