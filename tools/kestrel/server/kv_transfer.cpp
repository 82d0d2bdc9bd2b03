#include "server/kv_transfer.h"

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include <chrono>

#include "core/error.h"
#include "kv_transfer_config.h"

namespace kestrel::cli {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;

KvImport pull_kv_blocks(const std::string& host, int port, const std::string& remote_request_id, double timeout_s,
                        const std::string& api_key, std::vector<int32_t>* tokens) {
  const std::string where = "KV transfer from " + host + ":" + std::to_string(port);
  asio::io_context ioc;
  asio::ip::tcp::resolver resolver(ioc);
  beast::tcp_stream stream(ioc);
  http::request<http::empty_body> req{http::verb::get, "/v1/kv_transfer/" + remote_request_id, 11};
  req.set(http::field::host, host + ":" + std::to_string(port));
  if (!api_key.empty()) req.set(http::field::authorization, "Bearer " + api_key);
  beast::flat_buffer buffer;
  http::response_parser<http::string_body> parser;
  parser.body_limit(boost::none);  // the record's size is the prompt's K/V
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
  const auto& res = parser.get();
  if (res.result_int() != 200)
    throw Error(where + " failed: HTTP " + std::to_string(res.result_int()) + ": " + res.body().substr(0, 500));
  return decode_kv_blocks(res.body(), tokens);
}

}  // namespace kestrel::cli
