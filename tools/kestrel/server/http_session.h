// One client connection of `kestrel serve` (Boost.Beast on Asio): reads requests with the deadlines
// and limits of HttpLimits, answers the errors of the head checks itself, hands complete requests to
// the API (http_api.h) and writes its responses, whole or streamed. Everything runs on the
// connection's strand; no thread ever waits on the client.
//
// Per request:  Idle --first byte--> Head --check_head--> Body --complete--> Processing --written--> Idle
// In Head and Body the session feeds the parser itself (read_request / parse_buffered), so that it
// sees the bytes the parser holds back (check_line_endings in http_parse.h).
//   Idle: keep-alive deadline (the first request: the head deadline, from accept);
//   Head: head deadline, from the first byte; Body: body deadline; Processing: none (a generation
//   may take long), but every write has the write deadline.
// While a request is processed the connection keeps reading (at most kReadAhead bytes), which
// keeps pipelined requests for later and notices a client that goes away:
//   - a read error (a reset) or a failed write: the client is gone, the handler is cancelled;
//   - end of stream: either a half-close (the client still waits for the answer, RFC 9112 9.6
//     allows it) or a full close. Before any response byte, an HTTP/1.1 client gets an interim
//     "100 Continue" (RFC 9110 15.2: clients must accept unexpected 1xx responses); a closed peer
//     answers it with a reset, which the connection's TCP state then shows (polled every 100 ms;
//     another 100 Continue every second finds a client that closed after reading the first).
//     A half-closed client just gets its answer; an HTTP/1.0 client (no 1xx) is taken as half-closed.
#pragma once

#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/beast/core/flat_buffer.hpp>

#include <atomic>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "server/http_head.h"
#include "server/http_parse.h"
#include "server/server_metrics.h"

namespace kestrel::cli {

using tcp = boost::asio::ip::tcp;

// A complete request, as the API sees it.
struct HttpRequest {
  Route route = Route::Health;
  std::string model_id;  // Route::Model, the Route::Kv* routes: the {id} part
  std::string body;
};

// A response (or, for a stream, its head: status and headers; the body follows as chunks).
struct HttpResponse {
  int status = 200;
  std::string content_type = "application/json";
  std::string body;
  std::vector<std::pair<std::string, std::string>> headers;
};

// The OpenAI error body of an error the HTTP layer raises, with its status (and Allow for a 405).
HttpResponse error_response(const HttpError& e);

// A request's work after dispatch (a generation): cancelled when its client goes away or the
// server stops at once. Runs on the connection's strand.
class RequestHandler {
 public:
  virtual ~RequestHandler() = default;
  virtual void cancel() = 0;
};

class HttpSession;
using Dispatch = std::function<void(const std::shared_ptr<HttpSession>&, HttpRequest)>;

// What every connection shares; owned by HttpServer.
struct SessionContext {
  HttpLimits limits;
  std::string api_key;
  Dispatch dispatch;
  ServerMetrics* metrics = nullptr;
  std::atomic<bool> stopping{false};
  std::atomic<int64_t> open{0};  // connections open (HttpSession objects alive)

  // The open connections, for a stop.
  void add(uint64_t id, std::weak_ptr<HttpSession> s);
  void remove(uint64_t id);
  std::vector<std::shared_ptr<HttpSession>> sessions();

 private:
  std::mutex mutex_;
  std::unordered_map<uint64_t, std::weak_ptr<HttpSession>> sessions_;
};

class HttpSession : public std::enable_shared_from_this<HttpSession> {
 public:
  // The socket's executor must be a strand (the session's handlers run on it).
  HttpSession(tcp::socket socket, SessionContext& ctx);
  ~HttpSession();
  HttpSession(const HttpSession&) = delete;
  HttpSession& operator=(const HttpSession&) = delete;

  void start();
  // The server stops: an idle or half-read connection closes now; one whose request is being
  // processed closes after its response. Thread-safe (posts to the strand).
  void stop();

  // For the API, on the strand, once per request: a whole response, or a stream's head, chunks and end.
  void respond(HttpResponse r);
  void start_stream(HttpResponse head);
  void write_chunk(std::string data);
  void end_stream();
  // The handler of the request being processed (cancelled if the client goes away).
  void attach(std::shared_ptr<RequestHandler> h) { handler_ = std::move(h); }
  // False once the connection is closed (writes are dropped).
  bool open() const { return phase_ != Phase::Closed; }

  boost::asio::any_io_executor executor() { return socket_.get_executor(); }

 private:
  enum class Phase { Idle, Head, Body, Processing, Closing, Closed };

  void arm(std::chrono::milliseconds d);
  void disarm();
  void on_deadline();
  void read_more();
  void on_read_some(const boost::system::error_code& ec, size_t n);
  void start_head();
  void read_request();
  void on_request_bytes(const boost::system::error_code& ec, size_t n);
  void parse_buffered();
  void on_head();
  void on_body();
  void on_parse_error(const boost::system::error_code& ec, bool in_body);
  void on_peer_eof();
  void probe_tick();
  void send_error_and_close(const HttpError& e);
  enum class BodyFraming { Length, Chunked, UntilClose };
  std::string head_text(const HttpResponse& r, BodyFraming framing);
  void queue_write(std::string s);
  void do_write();
  void finish_exchange();
  void graceful_close();
  void gone();
  void close();

  static constexpr size_t kReadAhead = 64 * 1024;  // bytes read ahead while a request is processed
  // Received bytes not yet consumed by the parser, at most. Body data is consumed as it arrives, so
  // only a line the parser is waiting to complete grows it: a chunk header with a huge extension,
  // or a trailer field (Beast's header limit does not cover those); past this the read fails with
  // buffer_overflow (431). Above kReadAhead plus read_more's 16 KiB step.
  static constexpr size_t kMaxUnparsed = 256 * 1024;

  tcp::socket socket_;
  SessionContext& ctx_;
  const uint64_t id_;
  boost::beast::flat_buffer buffer_;
  std::optional<RequestParser> parser_;
  ChunkPosition chunk_pos_;  // the body's chunk framing, while parser_ reads a chunked body
  boost::asio::steady_timer deadline_, write_timer_, probe_timer_;
  uint64_t deadline_gen_ = 0;
  Phase phase_ = Phase::Idle;
  bool reading_ = false;        // an async read is outstanding
  bool resume_on_cancel_ = false;  // the outstanding read was cancelled to parse buffered requests
  bool timed_out_ = false;      // the head or body deadline passed (answer 408)
  bool peer_eof_ = false;       // the client shut down its sending side (or closed)
  bool probing_ = false;
  uint64_t probe_count_ = 0;
  HttpRequest request_;          // the request being read (its route, once the head is in)
  bool head_request_ = false;   // HEAD: responses carry the head only (RFC 9110 9.3.2)
  bool http11_ = true;
  bool keep_alive_ = true;
  bool chunked_ = false;
  bool response_started_ = false, response_done_ = false;
  std::deque<std::string> out_;
  std::vector<std::string> in_flight_;  // the strings being written
  bool writing_ = false;
  std::shared_ptr<RequestHandler> handler_;
};

}  // namespace kestrel::cli
