#include "server/http_session.h"

#include <boost/asio/post.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/http/error.hpp>
#include <boost/beast/http/status.hpp>

#include <malloc.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstdio>

#include "server/openai_api.h"

namespace kestrel::cli {

namespace asio = boost::asio;
namespace http = boost::beast::http;
using error_code = boost::system::error_code;

namespace {
constexpr std::chrono::milliseconds kProbeEvery{100};
// A half-closed HTTP/1.1 client waiting for a non-streamed answer gets another interim 100 Continue
// this often (RFC 9110 15.2: any number of 1xx may precede the final response): a client that has
// read the first one and then closed leaves no unread data to reset with, so only a later write
// finds out it is gone (its reset puts the socket in TCP_CLOSE, seen by the next probe). Every 300
// ms: the request is aborted and its KV blocks freed within about 0.4 s of the client's close, for
// 25 bytes written three times a second to a client that is still there.
constexpr int kInterimEveryProbes = 3;
// How long a closing connection reads (and drops) what the client still sends, so that the close
// does not reset the connection before the client has read the response.
constexpr std::chrono::milliseconds kLinger{2000};
// Bodies above this size leave freed memory that glibc keeps; it is handed back after the request.
constexpr size_t kTrimAbove = size_t{1} << 20;

std::atomic<uint64_t> next_session_id{1};

bool iequals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (std::tolower(static_cast<unsigned char>(a[i])) != std::tolower(static_cast<unsigned char>(b[i]))) return false;
  return true;
}
}  // namespace

HttpResponse error_response(const HttpError& e) {
  HttpResponse r;
  r.status = e.status;
  r.body = dump(error_body(e.message, e.type, "", e.code));
  if (!e.allow.empty()) r.headers.emplace_back("Allow", e.allow);
  return r;
}

void SessionContext::add(uint64_t id, std::weak_ptr<HttpSession> s) {
  std::lock_guard lock(mutex_);
  sessions_.emplace(id, std::move(s));
}

void SessionContext::remove(uint64_t id) {
  std::lock_guard lock(mutex_);
  sessions_.erase(id);
}

std::vector<std::shared_ptr<HttpSession>> SessionContext::sessions() {
  std::lock_guard lock(mutex_);
  std::vector<std::shared_ptr<HttpSession>> out;
  for (auto& [id, w] : sessions_)
    if (auto s = w.lock()) out.push_back(std::move(s));
  return out;
}

HttpSession::HttpSession(tcp::socket socket, SessionContext& ctx)
    : socket_(std::move(socket)),
      ctx_(ctx),
      id_(next_session_id++),
      buffer_(kMaxUnparsed),
      deadline_(socket_.get_executor()),
      write_timer_(socket_.get_executor()),
      probe_timer_(socket_.get_executor()) {
  ++ctx_.open;
}

HttpSession::~HttpSession() {
  ctx_.remove(id_);
  --ctx_.open;
}

void HttpSession::start() {
  ctx_.add(id_, weak_from_this());
  error_code ec;
  socket_.set_option(tcp::no_delay(true), ec);  // each SSE chunk goes out at once
  asio::post(socket_.get_executor(), [self = shared_from_this()] {
    if (self->ctx_.stopping) return self->close();
    self->arm(self->ctx_.limits.head_timeout);  // a new connection's first request: from accept
    self->read_more();
  });
}

void HttpSession::stop() {
  asio::post(socket_.get_executor(), [self = shared_from_this()] {
    switch (self->phase_) {
      case Phase::Idle:
      case Phase::Head:
      case Phase::Body:
        self->close();
        break;
      case Phase::Processing:
        self->keep_alive_ = false;  // closes after the response
        break;
      case Phase::Closing:
      case Phase::Closed:
        break;
    }
  });
}

void HttpSession::arm(std::chrono::milliseconds d) {
  const uint64_t gen = ++deadline_gen_;
  deadline_.expires_after(d);
  deadline_.async_wait([self = shared_from_this(), gen](const error_code& ec) {
    if (!ec && gen == self->deadline_gen_) self->on_deadline();
  });
}

void HttpSession::disarm() {
  ++deadline_gen_;
  deadline_.cancel();
}

void HttpSession::on_deadline() {
  switch (phase_) {
    case Phase::Head:
    case Phase::Body: {
      timed_out_ = true;
      error_code ec;
      socket_.cancel(ec);  // on_head / on_body answer 408
      break;
    }
    case Phase::Idle:
    case Phase::Closing:
      close();
      break;
    case Phase::Processing:
    case Phase::Closed:
      break;
  }
}

void HttpSession::read_more() {
  reading_ = true;
  socket_.async_read_some(buffer_.prepare(16 * 1024),
                          [self = shared_from_this()](const error_code& ec, size_t n) { self->on_read_some(ec, n); });
}

void HttpSession::on_read_some(const error_code& ec, size_t n) {
  reading_ = false;
  const bool resume = resume_on_cancel_;
  resume_on_cancel_ = false;
  if (phase_ == Phase::Closed) return;
  if (phase_ == Phase::Closing) {  // dropping what the client still sends until it closes
    if (ec) return close();
    return read_more();  // not committed: dropped
  }
  if (!ec) buffer_.commit(n);
  if (ec == asio::error::operation_aborted && resume) {
    if (phase_ == Phase::Idle) start_head();
    return;
  }
  if (ec == asio::error::eof) {
    peer_eof_ = true;
    return on_peer_eof();
  }
  if (ec) return gone();
  if (phase_ == Phase::Idle) return start_head();
  if (phase_ == Phase::Processing && buffer_.size() < kReadAhead) read_more();
}

void HttpSession::on_peer_eof() {
  if (phase_ == Phase::Idle) {
    // Requests sent before the half-close are still answered.
    if (buffer_.size() > 0) return start_head();
    return close();
  }
  if (phase_ != Phase::Processing) return;
  if (http11_ && !response_started_) queue_write("HTTP/1.1 100 Continue\r\n\r\n");
  if (!probing_) {
    probing_ = true;
    probe_tick();
  }
}

void HttpSession::probe_tick() {
  if (phase_ != Phase::Processing) {
    probing_ = false;
    return;
  }
  tcp_info info{};
  socklen_t len = sizeof info;
  if (getsockopt(socket_.native_handle(), IPPROTO_TCP, TCP_INFO, &info, &len) != 0 || info.tcpi_state == TCP_CLOSE)
    return gone();
  if (++probe_count_ % kInterimEveryProbes == 0 && http11_ && !response_started_ && !writing_)
    queue_write("HTTP/1.1 100 Continue\r\n\r\n");
  probe_timer_.expires_after(kProbeEvery);
  probe_timer_.async_wait([self = shared_from_this()](const error_code& ec) {
    if (!ec) self->probe_tick();
  });
}

void HttpSession::start_head() {
  phase_ = Phase::Head;
  arm(ctx_.limits.head_timeout);
  parser_.emplace();
  configure_parser(*parser_, ctx_.limits);
  head_request_ = false;
  parse_buffered();  // a pipelined request may be buffered whole
}

void HttpSession::read_request() {
  const size_t room = std::min<size_t>(16 * 1024, buffer_.max_size() - buffer_.size());
  // Full: the parser waits for the end of a line longer than kMaxUnparsed.
  if (room == 0) return on_parse_error(http::error::buffer_overflow, phase_ == Phase::Body);
  reading_ = true;
  socket_.async_read_some(buffer_.prepare(room), [self = shared_from_this()](const error_code& ec, size_t n) {
    self->on_request_bytes(ec, n);
  });
}

void HttpSession::on_request_bytes(const error_code& ec, size_t n) {
  reading_ = false;
  if (phase_ == Phase::Closed) return;
  const bool in_body = phase_ == Phase::Body;
  if (ec == asio::error::eof) {
    // As Beast's read reports it: nothing of this request yet, or a request cut short.
    error_code end = http::error::end_of_stream;
    if (parser_->got_some()) parser_->put_eof(end);
    if (!end) end = http::error::partial_message;  // a request is never ended by the close
    peer_eof_ = true;
    return on_parse_error(end, in_body);
  }
  if (ec) return on_parse_error(ec, in_body);  // a deadline cancels the read: 408
  buffer_.commit(n);
  parse_buffered();
}

void HttpSession::parse_buffered() {
  for (;;) {
    const bool in_body = phase_ == Phase::Body;
    const auto data = buffer_.data();
    const std::string_view unparsed(static_cast<const char*>(data.data()), data.size());
    if (!in_body) {
      if (!parser_->got_some() && unparsed.substr(0, 2) == "\r\n") {
        buffer_.consume(2);  // RFC 9112 2.2: empty lines before the request-line are ignored
        continue;
      }
      if (!parser_->got_some() && unparsed == "\r") break;  // its LF is still to come
      if (auto e = check_line_endings(unparsed, false)) return send_error_and_close(*e);
    }
    if (unparsed.empty()) break;
    error_code ec;
    const size_t used = in_body ? put_body(*parser_, chunk_pos_, unparsed, ec) : parser_->put(data, ec);
    buffer_.consume(used);
    if (ec && ec != http::error::need_more) return on_parse_error(ec, in_body);
    if (!in_body && parser_->is_header_done()) return on_head();
    if (in_body && parser_->is_done()) return on_body();
    if (ec || used == 0) break;  // need_more
  }
  if (phase_ == Phase::Body && parser_->chunked()) {
    const auto data = buffer_.data();
    if (auto e = check_line_endings(std::string_view(static_cast<const char*>(data.data()), data.size()), true))
      return send_error_and_close(*e);
  }
  read_request();
}

void HttpSession::on_head() {
  const HeadFields fields = head_fields(*parser_);
  const auto& h = parser_->get();
  http11_ = h.version() >= 11;
  head_request_ = fields.method == "HEAD";  // errors to a HEAD request go without a body too
  const HeadDecision d = check_head(fields, ctx_.limits, ctx_.api_key);
  if (d.error) return send_error_and_close(*d.error);
  request_ = HttpRequest{};
  request_.route = d.route;
  request_.model_id = d.model_id;
  if (const auto it = h.find(http::field::expect); it != h.end()) {
    if (!iequals(std::string_view(it->value().data(), it->value().size()), "100-continue"))
      return send_error_and_close(HttpError{417, "only \"Expect: 100-continue\" is supported", "expectation_failed",
                                            "invalid_request_error", ""});
    if (http11_ && !parser_->is_done()) queue_write("HTTP/1.1 100 Continue\r\n\r\n");
  }
  limit_body(*parser_, ctx_.limits);
  chunk_pos_ = ChunkPosition{};
  track_chunks(*parser_, chunk_pos_);
  parser_->eager(true);  // each put parses all the body data it is given
  phase_ = Phase::Body;
  arm(ctx_.limits.body_timeout);
  if (parser_->is_done()) return on_body();  // no body
  parse_buffered();
}

void HttpSession::on_body() {
  disarm();
  phase_ = Phase::Processing;
  auto& m = parser_->get();
  keep_alive_ = m.keep_alive() && !ctx_.stopping;
  HttpRequest req = std::move(request_);
  req.body = std::move(m.body());
  parser_.reset();
  const bool large = req.body.size() > kTrimAbove;
  response_started_ = response_done_ = false;
  if (!peer_eof_) read_more();  // read ahead: pipelined requests, and the client leaving
  else on_peer_eof();
  ctx_.dispatch(shared_from_this(), std::move(req));
  if (large) malloc_trim(0);  // the body and its parse are freed by now
}

void HttpSession::on_parse_error(const error_code& ec, bool in_body) {
  if (timed_out_) {
    timed_out_ = false;
    const std::string what = in_body ? "request body" : "request head";
    const auto limit = in_body ? ctx_.limits.body_timeout : ctx_.limits.head_timeout;
    return send_error_and_close(HttpError{408,
                                          "the " + what + " did not arrive within " +
                                              std::to_string(limit.count() / 1000.0).substr(0, 4) + " s",
                                          "request_timeout", "invalid_request_error", ""});
  }
  const auto e = parse_error(ec, ctx_.limits, in_body || (parser_ && parser_->got_some()), parser_ && parser_->chunked());
  if (!e) return close();
  if (ec == asio::error::eof || ec == http::error::end_of_stream) peer_eof_ = true;
  send_error_and_close(*e);
}

void HttpSession::send_error_and_close(const HttpError& e) {
  disarm();
  phase_ = Phase::Processing;
  keep_alive_ = false;
  response_started_ = response_done_ = false;
  respond(error_response(e));
}

std::string HttpSession::head_text(const HttpResponse& r, BodyFraming framing) {
  const auto status = static_cast<http::status>(r.status);
  const auto reason = http::obsolete_reason(status);
  std::string s = "HTTP/1.1 " + std::to_string(r.status) + " " + std::string(reason.data(), reason.size()) + "\r\n";
  s += "Content-Type: " + r.content_type + "\r\n";
  for (const auto& [k, v] : r.headers) s += k + ": " + v + "\r\n";
  if (framing == BodyFraming::Chunked) s += "Transfer-Encoding: chunked\r\n";
  if (framing == BodyFraming::Length) s += "Content-Length: " + std::to_string(r.body.size()) + "\r\n";
  if (!keep_alive_) s += "Connection: close\r\n";
  else if (!http11_) s += "Connection: keep-alive\r\n";
  s += "\r\n";
  return s;
}

void HttpSession::respond(HttpResponse r) {
  if (phase_ != Phase::Processing || response_started_) return;
  if (ctx_.stopping) keep_alive_ = false;
  ctx_.metrics->on_response(r.status);
  response_started_ = response_done_ = true;
  std::string s = head_text(r, BodyFraming::Length);  // HEAD: the Content-Length of the body not sent
  if (!head_request_) s += r.body;
  queue_write(std::move(s));
}

void HttpSession::start_stream(HttpResponse head) {
  if (phase_ != Phase::Processing || response_started_) return;
  if (ctx_.stopping) keep_alive_ = false;
  ctx_.metrics->on_response(head.status);
  response_started_ = true;
  chunked_ = http11_;
  if (!chunked_) keep_alive_ = false;  // HTTP/1.0: the body ends with the connection
  queue_write(head_text(head, chunked_ ? BodyFraming::Chunked : BodyFraming::UntilClose));
}

void HttpSession::write_chunk(std::string data) {
  if (phase_ != Phase::Processing || !response_started_ || response_done_ || data.empty() || head_request_) return;
  if (!chunked_) return queue_write(std::move(data));
  char size[24];
  std::snprintf(size, sizeof size, "%zx\r\n", data.size());
  std::string s = size;
  s += data;
  s += "\r\n";
  queue_write(std::move(s));
}

void HttpSession::end_stream() {
  if (phase_ != Phase::Processing || !response_started_ || response_done_) return;
  response_done_ = true;
  if (chunked_ && !head_request_) queue_write("0\r\n\r\n");
  else if (!writing_) finish_exchange();
}

void HttpSession::queue_write(std::string s) {
  if (phase_ == Phase::Closed) return;
  out_.push_back(std::move(s));
  if (!writing_) do_write();
}

void HttpSession::do_write() {
  writing_ = true;
  in_flight_.assign(std::make_move_iterator(out_.begin()), std::make_move_iterator(out_.end()));
  out_.clear();
  std::vector<asio::const_buffer> bufs;
  bufs.reserve(in_flight_.size());
  for (const std::string& s : in_flight_) bufs.push_back(asio::buffer(s));
  write_timer_.expires_after(ctx_.limits.write_timeout);
  write_timer_.async_wait([self = shared_from_this()](const error_code& ec) {
    if (!ec && self->writing_) self->gone();  // the client stopped reading
  });
  asio::async_write(socket_, bufs, [self = shared_from_this()](const error_code& ec, size_t) {
    self->writing_ = false;
    self->write_timer_.cancel();
    self->in_flight_.clear();
    if (self->phase_ == Phase::Closed) return;
    if (ec) return self->gone();
    if (!self->out_.empty()) return self->do_write();
    if (self->phase_ == Phase::Processing && self->response_done_) self->finish_exchange();
  });
}

void HttpSession::finish_exchange() {
  handler_.reset();
  response_started_ = response_done_ = false;
  chunked_ = false;
  if (!keep_alive_ || ctx_.stopping || (peer_eof_ && buffer_.size() == 0)) return graceful_close();
  phase_ = Phase::Idle;
  arm(ctx_.limits.keep_alive_timeout);
  if (buffer_.size() > 0) {
    // A pipelined request waits in the buffer: parse it now, after the read ahead is cancelled.
    if (!reading_) return start_head();
    resume_on_cancel_ = true;
    error_code ec;
    socket_.cancel(ec);
    return;
  }
  if (peer_eof_) return graceful_close();
  if (!reading_) read_more();  // else the read ahead is already waiting for the next request
}

void HttpSession::graceful_close() {
  phase_ = Phase::Closing;
  error_code ec;
  socket_.shutdown(tcp::socket::shutdown_send, ec);
  if (ec || peer_eof_) return close();
  arm(kLinger);
  if (!reading_) read_more();  // on_read_some drops what arrives
}

void HttpSession::gone() {
  if (phase_ == Phase::Closed) return;
  if (handler_) {
    if (!response_started_) ctx_.metrics->on_response(499);  // nginx's "client closed the request"
    auto h = std::move(handler_);
    h->cancel();
  }
  close();
}

void HttpSession::close() {
  if (phase_ == Phase::Closed) return;
  if (handler_) {
    auto h = std::move(handler_);
    h->cancel();
  }
  phase_ = Phase::Closed;
  disarm();
  write_timer_.cancel();
  probe_timer_.cancel();
  out_.clear();
  error_code ec;
  socket_.shutdown(tcp::socket::shutdown_both, ec);
  socket_.close(ec);
}

}  // namespace kestrel::cli
