// kestrel router: the proxy in front of disaggregated prefill (vLLM's disaggregated-serving proxy):
// each OpenAI request (/v1/completions, /v1/chat/completions, streamed or not) goes first to a
// producer (`serve --kv-transfer-config '{"kv_role": "kv_producer"}'`) with max_tokens 1, stream
// false and kv_transfer_params {"do_remote_decode": true}; its answer's kv_transfer_params go with
// the original request to a consumer (kv_role kv_consumer), whose answer (or stream) is relayed to
// the client. Producers and consumers are each taken round-robin. Any failure of either side
// (connection refused, timeout, an HTTP error) ends the request with an OpenAI error, never a hang:
// every upstream read has the --timeout deadline, and a client that leaves closes the consumer's
// connection, which aborts its request there.
//
// One thread per client connection (Boost.Beast, synchronous towards the client): the router does
// no computing, and a connection's thread waits only on its own sockets.
#include <CLI/CLI.hpp>

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include <signal.h>

#include <atomic>
#include <chrono>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "openai_request.h"

namespace kestrel::cli {

namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;

struct Endpoint {
  std::string host;
  std::string port;
  std::string text() const { return host + ":" + port; }
};

// "http://host:port", "host:port" (a trailing slash is dropped). Errors: kestrel::Error naming the flag.
Endpoint parse_endpoint(const std::string& url, const std::string& flag) {
  std::string s = url;
  if (s.rfind("http://", 0) == 0) s = s.substr(7);
  if (!s.empty() && s.back() == '/') s.pop_back();
  const size_t colon = s.rfind(':');
  if (s.rfind("https://", 0) == 0 || colon == std::string::npos || colon == 0 || colon + 1 == s.size() ||
      s.find('/') != std::string::npos)
    throw Error(flag + " " + url + ": expected http://host:port");
  const std::string port = s.substr(colon + 1);
  for (char c : port)
    if (c < '0' || c > '9') throw Error(flag + " " + url + ": the port is not a number");
  if (std::stoi(port) < 1 || std::stoi(port) > 65535) throw Error(flag + " " + url + ": the port must be in [1, 65535]");
  return {s.substr(0, colon), port};
}

struct RouterArgs {
  std::vector<std::string> prefill, decode;
  std::string host = "127.0.0.1";
  int port = 8000;
  double timeout_s = 600;
};

class UpstreamError : public Error {
 public:
  UpstreamError(int status, const std::string& message) : Error(message), status_(status) {}
  int status() const { return status_; }

 private:
  int status_;
};

// One HTTP exchange with a producer or consumer. Each step runs asynchronously to completion under
// the stream's deadline (which applies only to asynchronous operations), so nothing waits longer
// than the timeout for a side that does not answer.
class Upstream {
 public:
  Upstream(const Endpoint& e, double timeout_s, const char* side)
      : e_(e), timeout_(std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000))), side_(side),
        stream_(ioc_) {}

  void send(const std::string& target, const std::string& body) {
    stream_.expires_after(timeout_);
    tcp::resolver resolver(ioc_);
    beast::error_code ec;
    tcp::resolver::results_type found;
    resolver.async_resolve(e_.host, e_.port, [&](beast::error_code e, tcp::resolver::results_type r) {
      ec = e;
      found = std::move(r);
    });
    run(ec, "resolving");
    stream_.async_connect(found, [&](beast::error_code e, const tcp::endpoint&) { ec = e; });
    run(ec, "connecting");
    http::request<http::string_body> req{http::verb::post, target, 11};
    req.set(http::field::host, e_.text());
    req.set(http::field::content_type, "application/json");
    req.body() = body;
    req.prepare_payload();
    stream_.expires_after(timeout_);
    http::async_write(stream_, req, [&](beast::error_code e, size_t) { ec = e; });
    run(ec, "sending the request");
    parser_.body_limit(boost::none);
    stream_.expires_after(timeout_);
    http::async_read_header(stream_, buffer_, parser_, [&](beast::error_code e, size_t) { ec = e; });
    run(ec, "reading the answer");
  }
  int status() const { return parser_.get().result_int(); }
  std::string content_type() const { return std::string(parser_.get()[http::field::content_type]); }
  // The next piece of the body, "" at its end.
  // (A read may parse only framing, a chunk header: it reads on until body bytes come or the end.)
  std::string read_some() {
    std::string& body = parser_.get().body();
    while (body.empty() && !parser_.is_done()) {
      beast::error_code ec;
      stream_.expires_after(timeout_);
      http::async_read_some(stream_, buffer_, parser_, [&](beast::error_code e, size_t) { ec = e; });
      run(ec, "reading the answer");
    }
    std::string piece;
    piece.swap(body);
    return piece;
  }
  std::string read_all() {
    std::string out;
    for (std::string p = read_some(); !p.empty(); p = read_some()) out += p;
    return out;
  }
  void close() {
    beast::error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_both, ignored);
    stream_.close();
  }

 private:
  void run(const beast::error_code& ec, const char* stage) {
    ioc_.restart();
    ioc_.run();
    if (ec)
      throw UpstreamError(502, std::string("the ") + side_ + " " + e_.text() + " failed while " + stage + ": " +
                                   (ec == beast::error::timeout ? std::string("timed out") : ec.message()));
  }

  Endpoint e_;
  std::chrono::milliseconds timeout_;
  const char* side_;
  asio::io_context ioc_;
  beast::tcp_stream stream_;
  beast::flat_buffer buffer_;
  http::response_parser<http::string_body> parser_;
};

std::string error_text(const std::string& message, const std::string& type, const std::string& code = "") {
  Json e = {{"message", message}, {"type", type}, {"param", nullptr}, {"code", code.empty() ? Json() : Json(code)}};
  return Json{{"error", e}}.dump();
}

class Router {
 public:
  explicit Router(const RouterArgs& a) : timeout_s_(a.timeout_s) {
    for (const auto& u : a.prefill) prefill_.push_back(parse_endpoint(u, "--prefill"));
    for (const auto& u : a.decode) decode_.push_back(parse_endpoint(u, "--decode"));
    if (prefill_.empty() || decode_.empty()) throw Error("kestrel router needs at least one --prefill and one --decode URL");
  }

  void serve_connection(tcp::socket socket) {
    beast::flat_buffer buffer;
    for (;;) {
      http::request_parser<http::string_body> parser;
      parser.body_limit(64u << 20);
      beast::error_code ec;
      http::read(socket, buffer, parser, ec);
      if (ec) return;  // the client closed (or sent garbage): nothing to answer
      const auto& req = parser.get();
      const bool keep = req.keep_alive();
      if (!handle(socket, req) || !keep) break;
    }
    beast::error_code ignored;
    socket.shutdown(tcp::socket::shutdown_send, ignored);
  }

 private:
  // Answers one request; false when the connection cannot go on (a relayed stream, a write failure).
  bool handle(tcp::socket& socket, const http::request<http::string_body>& req) {
    const std::string target(req.target());
    if (target == "/health" && req.method() == http::verb::get) return reply(socket, 200, "{\"status\":\"ok\"}");
    if (target != "/v1/completions" && target != "/v1/chat/completions")
      return reply(socket, 404, error_text("the router serves /v1/completions and /v1/chat/completions", "invalid_request_error"));
    if (req.method() != http::verb::post)
      return reply(socket, 405, error_text("use POST", "invalid_request_error"));
    RequestJson body = RequestJson::parse(req.body(), nullptr, false);
    if (body.is_discarded() || !body.is_object())
      return reply(socket, 400, error_text("the request body must be a JSON object", "invalid_request_error"));
    try {
      RequestJson params = prefill(target, body);
      body["kv_transfer_params"] = std::move(params);
      return decode(socket, target, body);
    } catch (const UpstreamError& e) {
      return reply(socket, e.status(), e.status() == 502 ? error_text(e.what(), "server_error", "upstream_failed") : e.what());
    }
  }

  RequestJson prefill(const std::string& target, const RequestJson& original) {
    RequestJson p = original;
    p["max_tokens"] = 1;
    if (p.contains("max_completion_tokens")) p["max_completion_tokens"] = 1;
    p["stream"] = false;
    p.erase("stream_options");
    p["kv_transfer_params"] = {{"do_remote_decode", true}};
    Upstream up(next(prefill_, next_prefill_), timeout_s_, "producer");
    up.send(target, p.dump());
    const std::string answer = up.read_all();
    if (up.status() != 200) throw UpstreamError(up.status(), answer);  // the producer's own error, relayed
    const RequestJson j = RequestJson::parse(answer, nullptr, false);
    if (j.is_discarded() || !j.contains("kv_transfer_params") || !j["kv_transfer_params"].is_object())
      throw UpstreamError(502, "the producer's answer has no kv_transfer_params (is it started with --kv-transfer-config "
                               "'{\"kv_role\": \"kv_producer\"}'?)");
    return j["kv_transfer_params"];
  }

  bool decode(tcp::socket& socket, const std::string& target, const RequestJson& body) {
    Upstream up(next(decode_, next_decode_), timeout_s_, "consumer");
    up.send(target, body.dump());
    const bool stream = body.value("stream", false) && up.status() == 200;
    if (!stream) {
      const std::string answer = up.read_all();
      return reply(socket, up.status(), answer, up.content_type());
    }
    // Relayed as it arrives, chunked; a client that leaves closes the consumer's connection.
    http::response<http::empty_body> head{http::status::ok, 11};
    head.set(http::field::content_type, up.content_type());
    head.set(http::field::cache_control, "no-cache");
    head.chunked(true);
    http::response_serializer<http::empty_body> sr{head};
    beast::error_code ec;
    http::write_header(socket, sr, ec);
    for (std::string piece = up.read_some(); !ec && !piece.empty(); piece = up.read_some())
      asio::write(socket, http::make_chunk(asio::buffer(piece)), ec);
    if (!ec) asio::write(socket, http::make_chunk_last(), ec);
    up.close();
    return false;
  }

  bool reply(tcp::socket& socket, int status, const std::string& body, const std::string& type = "application/json") {
    http::response<http::string_body> r{static_cast<http::status>(status), 11};
    r.set(http::field::content_type, type.empty() ? "application/json" : type);
    r.body() = body;
    r.prepare_payload();
    beast::error_code ec;
    http::write(socket, r, ec);
    return !ec;
  }

  static const Endpoint& next(const std::vector<Endpoint>& side, std::atomic<size_t>& counter) {
    return side[counter++ % side.size()];
  }

  double timeout_s_;
  std::vector<Endpoint> prefill_, decode_;
  std::atomic<size_t> next_prefill_{0}, next_decode_{0};
};

void run_router(const RouterArgs& a) {
  signal(SIGPIPE, SIG_IGN);
  auto router = std::make_shared<Router>(a);
  asio::io_context ioc;
  beast::error_code ec;
  const auto address = asio::ip::make_address(a.host, ec);
  if (ec) throw Error("--host " + a.host + ": not an IP address");
  tcp::acceptor acceptor(ioc);
  const tcp::endpoint ep(address, static_cast<unsigned short>(a.port));
  acceptor.open(ep.protocol(), ec);
  if (!ec) acceptor.set_option(asio::socket_base::reuse_address(true), ec);
  if (!ec) acceptor.bind(ep, ec);
  if (!ec) acceptor.listen(1024, ec);
  if (ec) throw Error("cannot listen on " + a.host + ":" + std::to_string(a.port) + " (" + ec.message() + ")");
  std::cerr << "kestrel router: on http://" << a.host << ":" << acceptor.local_endpoint().port() << " ("
            << a.prefill.size() << " prefill, " << a.decode.size() << " decode)" << std::endl;
  for (;;) {
    tcp::socket socket(ioc);
    acceptor.accept(socket, ec);
    if (ec) continue;
    std::thread([router, s = std::move(socket)]() mutable { router->serve_connection(std::move(s)); }).detach();
  }
}

}  // namespace

void register_router(CLI::App& app) {
  auto a = std::make_shared<RouterArgs>();
  CLI::App* sub = app.add_subcommand(
      "router", "Disaggregated prefill proxy: each request's prefill to a --prefill server, its decode to a --decode server");
  sub->add_option("--prefill", a->prefill, "A producer's URL (http://host:port), repeatable")->required();
  sub->add_option("--decode", a->decode, "A consumer's URL (http://host:port), repeatable")->required();
  sub->add_option("--host", a->host, "Address to listen on")->capture_default_str();
  sub->add_option("--port", a->port, "TCP port; 0 = any free port (printed at start)")
      ->check(CLI::Range(0, 65535))
      ->capture_default_str();
  sub->add_option("--timeout", a->timeout_s, "Seconds any upstream step (connect, send, each read) may take")
      ->check(CLI::Range(0.001, 86400.0))
      ->capture_default_str();
  sub->callback([a] {
    for (const auto& u : a->prefill) parse_endpoint(u, "--prefill");
    for (const auto& u : a->decode) parse_endpoint(u, "--decode");
    run_router(*a);
  });
}

}  // namespace kestrel::cli
