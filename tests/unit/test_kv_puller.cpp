// The consumer's choice of transport for a pull (KvPuller, server/kv_transfer.h) against a stand-in
// producer on a local port that answers the pull routes as `kestrel serve` does (GET
// /v1/kv_transfer/<id>/cuda_ipc: encode_kv_ipc's JSON or 409; GET /v1/kv_transfer/<id>: the block
// record; DELETE: the release) and records what it was asked. The consumer's runner is a stand-in
// too: its device UUID and whether mapping handles fails are the test's. Checked: auto takes CUDA
// IPC on the same GPU and releases the blocks once the import goes; falls back to host memory
// (and stays there for that producer) on another GPU, a producer without IPC or handles that do
// not open; cuda_ipc fails instead, releasing the blocks; host and a CPU consumer never ask for IPC.
#include <gtest/gtest.h>

#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include <atomic>
#include <chrono>
#include <functional>
#include <mutex>
#include <thread>

#include "core/error.h"
#include "kv_transfer_config.h"
#include "server/kv_transfer.h"
#include "server/server_metrics.h"
#include "test_util.h"

using namespace kestrel;
using namespace kestrel::cli;

namespace {

namespace asio = boost::asio;
namespace http = boost::beast::http;
using tcp = asio::ip::tcp;

const std::string kGpuA = "GPU-aaaaaaaa-0000-0000-0000-000000000000";
const std::string kGpuB = "GPU-bbbbbbbb-0000-0000-0000-000000000000";

KvImport held_kv(const std::string& uuid) {
  KvImport kv;
  kv.format.block_size = 4;
  kv.format.bytes_per_token = 2;
  kv.format.n_layer = 1;
  kv.format.n_head_kv = 1;
  kv.format.head_dim = 1;
  kv.n_tokens = 6;
  kv.bytes.assign(16, std::byte{9});
  KvIpcMemory m;
  m.device_uuid = uuid;
  m.handles = {std::string(64, 'h')};
  m.block_bytes = {8};
  m.n_blocks = 32;
  kv.ipc = m;
  kv.ipc_blocks = {3, 4};
  return kv;
}

// One connection at a time, one request each: answers by `answer` (default: the routes of a CUDA
// producer on kGpuA holding request 7).
class FakeProducer {
 public:
  FakeProducer() : acceptor_(ioc_, tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0)) {
    port = acceptor_.local_endpoint().port();
    thread_ = std::thread([this] { serve(); });
  }
  ~FakeProducer() {
    stop_ = true;
    asio::io_context c;
    tcp::socket s(c);
    boost::system::error_code ec;
    s.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), static_cast<uint16_t>(port)), ec);
    thread_.join();
  }
  std::vector<std::string> seen() {
    std::lock_guard lock(mutex_);
    return seen_;
  }
  // Waits up to 5 s for `n` requests.
  bool wait_for(size_t n) {
    for (int i = 0; i < 500 && seen().size() < n; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    return seen().size() >= n;
  }

  int port = 0;
  std::string ipc_uuid = kGpuA;
  bool has_ipc = true;

 private:
  std::pair<int, std::string> answer(const std::string& line) {
    const std::vector<int32_t> tokens = {1, 2, 3, 4, 5, 6};
    if (line == "GET /v1/kv_transfer/7/cuda_ipc")
      return has_ipc ? std::pair{200, encode_kv_ipc(held_kv(ipc_uuid), tokens, 30)}
                     : std::pair{409, std::string(R"({"error": {"message": "no CUDA IPC on the CPU"}})")};
    if (line == "GET /v1/kv_transfer/7") {
      KvImport kv = held_kv(ipc_uuid);
      kv.ipc.reset();
      return {200, encode_kv_blocks(kv, tokens)};
    }
    if (line == "DELETE /v1/kv_transfer/7") return {200, R"({"released": true})"};
    return {404, "{}"};
  }
  void serve() {
    for (;;) {
      tcp::socket sock(ioc_);
      boost::system::error_code ec;
      acceptor_.accept(sock, ec);
      if (stop_) return;
      if (ec) continue;
      boost::beast::flat_buffer buf;
      http::request<http::string_body> req;
      http::read(sock, buf, req, ec);
      if (ec) continue;
      const std::string line = std::string(req.method_string()) + " " + std::string(req.target());
      {
        std::lock_guard lock(mutex_);
        seen_.push_back(line);
      }
      const auto [status, body] = answer(line);
      http::response<http::string_body> res{static_cast<http::status>(status), 11};
      res.body() = body;
      res.prepare_payload();
      http::write(sock, res, ec);
      sock.shutdown(tcp::socket::shutdown_both, ec);
    }
  }

  asio::io_context ioc_;
  tcp::acceptor acceptor_;
  std::atomic<bool> stop_{false};
  std::mutex mutex_;
  std::vector<std::string> seen_;
  std::thread thread_;
};

// A consumer's runner: only the IPC calls the puller makes.
class ConsumerRunner final : public ModelRunner {
 public:
  ConsumerRunner(std::string uuid, bool opens) : uuid_(std::move(uuid)), opens_(opens) {}
  std::span<const float> forward(const ForwardBatch&) override { return {}; }
  void copy_blocks(std::span<const BlockCopy>) override {}
  std::string device_uuid() const override { return uuid_; }
  void open_kv_ipc(const KvIpcMemory& peer) const override {
    ++opened;
    if (!opens_) throw Error("CUDA IPC: cudaIpcOpenMemHandle of the producer's KV cache failed: test");
    EXPECT_EQ(peer.handles, std::vector<std::string>{std::string(64, 'h')});
  }
  int32_t n_kv_blocks() const override { return 32; }
  int32_t block_size() const override { return 4; }
  KvDtype kv_dtype() const override { return KvDtype::F16; }
  int64_t kv_bytes_per_token() const override { return 2; }
  std::string description() const override { return "test consumer"; }
  mutable int opened = 0;

 private:
  std::string uuid_;
  bool opens_;
};

KvTransferParams params_of(const FakeProducer& p) {
  KvTransferParams q;
  q.do_remote_prefill = true;
  q.remote_host = "127.0.0.1";
  q.remote_port = p.port;
  q.remote_request_id = "7";
  return q;
}

KvTransferConfig config_of(KvTransport t) {
  KvTransferConfig c = parse_kv_transfer_config(R"({"kv_role": "kv_consumer", "kv_pull_timeout": 5})");
  c.kv_transport = t;
  return c;
}

const std::string kIpcGet = "GET /v1/kv_transfer/7/cuda_ipc", kHostGet = "GET /v1/kv_transfer/7",
                  kRelease = "DELETE /v1/kv_transfer/7";

}  // namespace

TEST(KvPuller, AutoOnTheSameGpuCopiesByCudaIpcAndReleasesWhenTheImportGoes) {
  FakeProducer producer;
  const KvTransferConfig config = config_of(KvTransport::Auto);
  ConsumerRunner runner(kGpuA, true);
  ServerMetrics metrics;
  KvPuller puller(config, runner, metrics, 1 << 16);
  std::vector<int32_t> tokens;
  const auto start = std::chrono::steady_clock::now();
  auto kv = std::make_shared<KvImport>(puller.pull(params_of(producer), &tokens));
  EXPECT_EQ(tokens, (std::vector<int32_t>{1, 2, 3, 4, 5, 6}));
  ASSERT_TRUE(kv->ipc.has_value());
  EXPECT_TRUE(kv->bytes.empty());
  EXPECT_EQ(kv->ipc_blocks, (std::vector<int32_t>{3, 4}));
  EXPECT_EQ(runner.opened, 1);
  // The producer holds them 30 s: the consumer counts on 0.9 x 30 - 1 s from the pull's start.
  EXPECT_GT(kv->ipc_valid_until, start + std::chrono::seconds(25));
  EXPECT_LT(kv->ipc_valid_until, start + std::chrono::seconds(27));
  EXPECT_EQ(producer.seen(), std::vector<std::string>{kIpcGet});
  kv.reset();  // written (or refused): the producer is told
  ASSERT_TRUE(producer.wait_for(2));
  EXPECT_EQ(producer.seen(), (std::vector<std::string>{kIpcGet, kRelease}));
  const std::string text = metrics.render(EngineSnapshot{});
  EXPECT_NE(text.find("kestrel_kv_transfer_pulls_total{kv_transport=\"cuda_ipc\"} 1\n"), std::string::npos) << text;
  EXPECT_NE(text.find("kestrel_kv_transfer_pulls_total{kv_transport=\"host\"} 0\n"), std::string::npos);
}

TEST(KvPuller, AutoFallsBackToHostMemoryAndStaysThereForThatProducer) {
  // Another GPU; a producer without IPC (409); handles that do not open.
  for (int c = 0; c < 3; ++c) {
    SCOPED_TRACE(c);
    FakeProducer producer;
    if (c == 0) producer.ipc_uuid = kGpuB;
    if (c == 1) producer.has_ipc = false;
    const KvTransferConfig config = config_of(KvTransport::Auto);
    ConsumerRunner runner(kGpuA, c != 2);
    ServerMetrics metrics;
    KvPuller puller(config, runner, metrics, 1 << 16);
    KvImport kv = puller.pull(params_of(producer), nullptr);
    EXPECT_FALSE(kv.ipc.has_value());
    EXPECT_EQ(kv.bytes.size(), 16u);
    EXPECT_EQ(kv.remote_hold, nullptr);
    EXPECT_EQ(runner.opened, c == 2 ? 1 : 0);  // another GPU is refused before any handle is opened
    kv = puller.pull(params_of(producer), nullptr);  // no second try with this producer
    EXPECT_EQ(producer.seen(), (std::vector<std::string>{kIpcGet, kHostGet, kHostGet}));
    const std::string text = metrics.render(EngineSnapshot{});
    EXPECT_NE(text.find("kestrel_kv_transfer_pulls_total{kv_transport=\"host\"} 2\n"), std::string::npos) << text;
  }
}

TEST(KvPuller, CudaIpcForcedFailsAndReleasesTheBlocks) {
  for (int c = 0; c < 3; ++c) {
    SCOPED_TRACE(c);
    FakeProducer producer;
    if (c == 0) producer.ipc_uuid = kGpuB;
    if (c == 1) producer.has_ipc = false;
    const KvTransferConfig config = config_of(KvTransport::CudaIpc);
    ConsumerRunner runner(kGpuA, c != 2);
    ServerMetrics metrics;
    KvPuller puller(config, runner, metrics, 1 << 16);
    const std::string error = test::error_of([&] { puller.pull(params_of(producer), nullptr); });
    EXPECT_NE(error.find(c == 0 ? "the producer runs on GPU-bbbbbbbb" : c == 1 ? "HTTP 409" : "cudaIpcOpenMemHandle"),
              std::string::npos)
        << error;
    ASSERT_TRUE(producer.wait_for(2));
    EXPECT_EQ(producer.seen(), (std::vector<std::string>{kIpcGet, kRelease}));
  }
}

TEST(KvPuller, HostAndCpuConsumersNeverAskForCudaIpc) {
  FakeProducer producer;
  ServerMetrics metrics;
  const KvTransferConfig host = config_of(KvTransport::Host), automatic = config_of(KvTransport::Auto);
  ConsumerRunner gpu(kGpuA, true), cpu("", true);
  KvPuller by_host(host, gpu, metrics, 1 << 16), on_cpu(automatic, cpu, metrics, 1 << 16);
  EXPECT_FALSE(by_host.pull(params_of(producer), nullptr).ipc.has_value());
  EXPECT_FALSE(on_cpu.pull(params_of(producer), nullptr).ipc.has_value());
  EXPECT_EQ(producer.seen(), (std::vector<std::string>{kHostGet, kHostGet}));
  EXPECT_EQ(gpu.opened + cpu.opened, 0);
}

// The pull's answer is read up to a bound (the producer is whoever the client names): past it the
// exchange fails instead of buffering on.
TEST(KvPuller, AnAnswerLongerThanTheBoundIsNotRead) {
  FakeProducer producer;
  const KvHttpAnswer whole = kv_transfer_exchange("127.0.0.1", producer.port, false, "/v1/kv_transfer/7", 5, "", 1 << 20);
  ASSERT_EQ(whole.status, 200);
  ASSERT_GT(whole.body.size(), 16u);
  try {
    kv_transfer_exchange("127.0.0.1", producer.port, false, "/v1/kv_transfer/7", 5, "", whole.body.size() - 1);
    FAIL() << "an answer past the bound was read";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("reading the answer"), std::string::npos) << e.what();
  }
}
