#include "server/http_server.h"

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/write.hpp>

#include <iostream>
#include <thread>
#include <vector>

#include "core/error.h"
#include "server/http_api.h"
#include "server/http_session.h"
#include "server/openai_api.h"

namespace kestrel::cli {

namespace asio = boost::asio;
using error_code = boost::system::error_code;

namespace {
// The event-loop threads run at the engine's priority. At nice 10 (as the old thread-per-connection
// server's hundreds of threads ran, to keep them from the CPU backend's fork-join steps), /health
// took 4-7 ms at the median and up to 54-313 ms on the loaded 2-core VM (1,000 idle + 100 slow
// connections, 256 streaming clients); at nice 0, 0.7-1 ms and up to 18-35 ms, the streams as fast.
// A refused connection (over --max-connections) gets its 503 written within this time, else it is
// just closed; at most kMaxRefusing are being refused at once (beyond: closed at once).
constexpr std::chrono::milliseconds kRefuseTimeout{1000};
constexpr int kMaxRefusing = 256;
// After accept() fails for lack of descriptors, wait this long before the next accept.
constexpr std::chrono::milliseconds kAcceptBackoff{50};

std::string refusal_text(int64_t max_connections) {
  const std::string body = dump(error_body("the server has " + std::to_string(max_connections) +
                                               " open connections, its limit (--max-connections); retry later",
                                           "server_error", "", "too_many_connections"));
  return "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: " +
         std::to_string(body.size()) + "\r\nConnection: close\r\nRetry-After: 1\r\n\r\n" + body;
}
}  // namespace

struct HttpServer::Impl {
  Impl(const ServerOptions& o, const PromptFormat& f, int64_t len, EngineLoop& l, ServerMetrics& m)
      : options(o),
        api(o.served_model_name, f, len, l, m),
        refusal(refusal_text(o.max_connections)),
        acceptor(asio::make_strand(ioc)),
        accept_backoff(acceptor.get_executor()),
        stop_timer(ioc),
        work(ioc.get_executor()) {
    ctx.limits = o.limits;
    api.kv_transfer = o.kv_transfer;
    if (api.kv_transfer && api.kv_transfer->consumes()) {
      KESTREL_ASSERT(o.runner != nullptr, "serve: a KV consumer without its runner");
      api.kv_puller = std::make_unique<KvPuller>(*api.kv_transfer, *o.runner, m, len);
    }
    ctx.api_key = o.api_key;
    ctx.metrics = &m;
    ctx.dispatch = [this](const std::shared_ptr<HttpSession>& s, HttpRequest r) {
      handle_request(api, s, std::move(r));
    };
  }

  void accept();
  void on_accept(const error_code& ec, tcp::socket socket);
  void refuse(tcp::socket socket);
  void wait_for_responses(std::chrono::steady_clock::time_point deadline);

  // What handlers still queued in the io_context refer to comes first: the io_context, destroyed
  // before it, destroys them (sessions, generations, refusals) while it is still there.
  ServerOptions options;
  ApiState api;
  SessionContext ctx;
  const std::string refusal;
  std::atomic<int> refusing{0};
  asio::io_context ioc;
  tcp::acceptor acceptor;
  asio::steady_timer accept_backoff;
  asio::steady_timer stop_timer;
  // Keeps ioc.run() from returning when the last connection closes during stop(): only
  // wait_for_responses() ends the loop, after stop() has let go of every session, so the
  // server is never destroyed while the signal thread still holds one.
  asio::executor_work_guard<asio::io_context::executor_type> work;
};

HttpServer::HttpServer(const ServerOptions& options, const PromptFormat& format, int64_t max_model_len,
                       EngineLoop& loop, ServerMetrics& metrics)
    : impl_(std::make_unique<Impl>(options, format, max_model_len, loop, metrics)) {}

HttpServer::~HttpServer() = default;

int HttpServer::bind() {
  Impl& m = *impl_;
  error_code ec;
  const auto address = asio::ip::make_address(m.options.host, ec);
  auto fail = [&](const std::string& why) {
    throw Error("cannot listen on " + m.options.host + ":" + std::to_string(m.options.port) + " (" + why + ")");
  };
  if (ec) fail("not an IP address");
  const tcp::endpoint ep(address, static_cast<unsigned short>(m.options.port));
  m.acceptor.open(ep.protocol(), ec);
  if (!ec) m.acceptor.set_option(asio::socket_base::reuse_address(true), ec);
  if (!ec) m.acceptor.bind(ep, ec);
  // A burst of clients connecting at once must not lose SYNs to a short backlog.
  if (!ec) m.acceptor.listen(4096, ec);
  if (ec) fail(ec.message());
  m.api.port = m.acceptor.local_endpoint().port();
  return m.api.port;
}

void HttpServer::Impl::accept() {
  acceptor.async_accept(asio::make_strand(ioc), [this](const error_code& ec, tcp::socket s) { on_accept(ec, std::move(s)); });
}

void HttpServer::Impl::on_accept(const error_code& ec, tcp::socket socket) {
  if (ctx.stopping || !acceptor.is_open()) return;
  if (ec) {
    // Out of descriptors (or another transient error): the pending connection stays in the
    // backlog; try again shortly rather than spinning.
    accept_backoff.expires_after(kAcceptBackoff);
    accept_backoff.async_wait([this](const error_code& e) {
      if (!e && !ctx.stopping) accept();
    });
    return;
  }
  if (ctx.open.load() >= options.max_connections) {
    refuse(std::move(socket));
  } else {
    std::make_shared<HttpSession>(std::move(socket), ctx)->start();
  }
  accept();
}

void HttpServer::Impl::refuse(tcp::socket socket) {
  if (refusing.load() >= kMaxRefusing) {
    error_code ec;
    socket.close(ec);
    return;
  }
  ++refusing;
  struct Refusal {
    tcp::socket socket;
    asio::steady_timer timer;
    std::atomic<int>& count;
    Refusal(tcp::socket s, std::atomic<int>& c) : socket(std::move(s)), timer(socket.get_executor()), count(c) {}
    ~Refusal() { --count; }
  };
  auto r = std::make_shared<Refusal>(std::move(socket), refusing);
  r->timer.expires_after(kRefuseTimeout);
  r->timer.async_wait([r](const error_code& ec) {
    if (!ec) r->socket.close();
  });
  asio::async_write(r->socket, asio::buffer(refusal), [r](const error_code& ec, size_t) {
    error_code e;
    if (!ec) r->socket.shutdown(tcp::socket::shutdown_send, e);
    r->socket.close(e);
    r->timer.cancel();
  });
  api.metrics.on_response(503);
}

void HttpServer::serve() {
  Impl& m = *impl_;
  asio::post(m.acceptor.get_executor(), [&m] { m.accept(); });
  const int n = std::max(1, m.options.http_threads);
  // A handler that throws (not expected: they answer bad input themselves; bad_alloc) loses its
  // connection, not the thread or the process.
  auto run = [&m] {
    for (;;) {
      try {
        m.ioc.run();
        return;
      } catch (const std::exception& e) {
        std::cerr << "kestrel serve: HTTP handler failed: " << e.what() << std::endl;
      }
    }
  };
  std::vector<std::thread> threads;
  for (int i = 1; i < n; ++i) threads.emplace_back(run);
  run();
  for (std::thread& t : threads) t.join();
}

void HttpServer::Impl::wait_for_responses(std::chrono::steady_clock::time_point deadline) {
  if (api.open_generations.load() == 0 || std::chrono::steady_clock::now() >= deadline) {
    ioc.stop();
    return;
  }
  stop_timer.expires_after(std::chrono::milliseconds(20));
  stop_timer.async_wait([this, deadline](const error_code&) { wait_for_responses(deadline); });
}

void HttpServer::stop(std::chrono::milliseconds grace) {
  Impl& m = *impl_;
  const auto deadline = std::chrono::steady_clock::now() + grace;
  m.ctx.stopping = true;
  asio::post(m.acceptor.get_executor(), [&m] {
    error_code ec;
    m.acceptor.close(ec);
    m.accept_backoff.cancel();
  });
  // Sessions are collected and released on an io thread: the last reference to a session may
  // be dropped here, and its destructor must run while the server exists.
  asio::post(m.ioc, [&m, deadline] {
    for (const auto& s : m.ctx.sessions()) s->stop();
    m.wait_for_responses(deadline);
  });
}

}  // namespace kestrel::cli
