// --kv-transfer-config and kv_transfer_params (vLLM's KVTransferConfig fields and its NIXL
// connector's request parameters), and the K/V record a producer answers a pull with.
#include <gtest/gtest.h>

#include "kv_transfer_config.h"
#include "test_util.h"

using namespace kestrel;
using namespace kestrel::cli;

TEST(KvTransferConfig, ParsesRolesAndTimeouts) {
  KvTransferConfig c = parse_kv_transfer_config(R"({"kv_role": "kv_producer", "abort_request_timeout": 2.5})");
  EXPECT_EQ(c.kv_role, KvRole::Producer);
  EXPECT_TRUE(c.produces());
  EXPECT_FALSE(c.consumes());
  EXPECT_DOUBLE_EQ(c.abort_request_timeout, 2.5);
  c = parse_kv_transfer_config(
      R"({"kv_connector": "KestrelConnector", "kv_role": "kv_consumer", "kv_connector_extra_config": {"kv_pull_timeout": 7}})");
  EXPECT_EQ(c.kv_role, KvRole::Consumer);
  EXPECT_DOUBLE_EQ(c.kv_pull_timeout, 7);
  EXPECT_DOUBLE_EQ(c.abort_request_timeout, 480);
  c = parse_kv_transfer_config(R"({"kv_role": "kv_both", "kv_ip": "10.0.0.2", "engine_id": "p0"})");
  EXPECT_TRUE(c.produces() && c.consumes());
  EXPECT_EQ(c.kv_ip, "10.0.0.2");
  EXPECT_EQ(c.engine_id, "p0");
  EXPECT_EQ(c.remote_api_key, "");
  c = parse_kv_transfer_config(R"({"kv_role": "kv_consumer", "kv_connector_extra_config": {"remote_api_key": "k1"}})");
  EXPECT_EQ(c.remote_api_key, "k1");
  EXPECT_EQ(c.kv_transport, KvTransport::Auto);
  for (const auto& [name, want] : {std::pair{"auto", KvTransport::Auto}, std::pair{"host", KvTransport::Host},
                                   std::pair{"cuda_ipc", KvTransport::CudaIpc}}) {
    c = parse_kv_transfer_config(std::string(R"({"kv_role": "kv_consumer", "kv_connector_extra_config": {"kv_transport": ")") +
                                 name + "\"}}");
    EXPECT_EQ(c.kv_transport, want) << name;
  }
}

TEST(KvTransferConfig, BadConfigsNameTheField) {
  const auto err = [](const char* json) { return test::error_of([&] { parse_kv_transfer_config(json); }); };
  EXPECT_NE(err("[1]").find("not a JSON object"), std::string::npos);
  EXPECT_NE(err("{}").find("kv_role is required"), std::string::npos);
  EXPECT_NE(err(R"({"kv_role": "prefill"})").find("kv_role must be"), std::string::npos);
  EXPECT_NE(err(R"({"kv_role": "kv_producer", "kv_connector": "NixlConnector"})").find("kv_connector"),
            std::string::npos);
  EXPECT_NE(err(R"({"kv_role": "kv_producer", "abort_request_timeout": 0})").find("abort_request_timeout must be"),
            std::string::npos);
  EXPECT_NE(err(R"({"kv_role": "kv_producer", "kv_rank": 0})").find("unknown field kv_rank"), std::string::npos);
  EXPECT_NE(err(R"({"kv_role": "kv_consumer", "kv_connector_extra_config": {"kv_transport": "nccl"}})")
                .find("kv_connector_extra_config.kv_transport must be \"auto\", \"host\" or \"cuda_ipc\""),
            std::string::npos);
  EXPECT_NE(err(R"({"kv_role": "kv_consumer", "kv_connector_extra_config": {"kv_transport": 1}})")
                .find("kv_connector_extra_config.kv_transport must be a string"),
            std::string::npos);
  EXPECT_NE(err(R"({"kv_role": "kv_producer", "kv_connector_extra_config": {"x": 1}})")
                .find("kv_connector_extra_config.x"),
            std::string::npos);
  EXPECT_NE(err(R"({"kv_role": "kv_consumer", "kv_connector_extra_config": {"remote_api_key": 5}})")
                .find("kv_connector_extra_config.remote_api_key must be a string"),
            std::string::npos);
  // Only in kv_connector_extra_config, like the connector's other settings.
  EXPECT_NE(err(R"({"kv_role": "kv_consumer", "remote_api_key": "k"})").find("unknown field remote_api_key"),
            std::string::npos);
}

TEST(KvTransferParams, ParsesAndChecksRequestFields) {
  EXPECT_FALSE(parse_kv_transfer_params(RequestJson::parse(R"({"prompt": "a"})")));
  auto p = parse_kv_transfer_params(RequestJson::parse(
      R"({"kv_transfer_params": {"do_remote_prefill": true, "remote_host": "h", "remote_port": 81,
          "remote_request_id": 7, "remote_block_ids": [3, 4], "num_computed_tokens": 20}})"));
  ASSERT_TRUE(p);
  EXPECT_TRUE(p->do_remote_prefill);
  EXPECT_EQ(p->remote_request_id, "7");
  EXPECT_EQ(p->remote_port, 81);
  EXPECT_EQ(p->remote_block_ids, (std::vector<int32_t>{3, 4}));
  EXPECT_EQ(p->num_computed_tokens, 20);
  const Json back = kv_transfer_params_json(*p);
  EXPECT_EQ(back["remote_host"], "h");
  EXPECT_EQ(back["remote_block_ids"].size(), 2u);
  const auto param_of = [](const std::string& json) {
    try {
      parse_kv_transfer_params(RequestJson::parse(json));
    } catch (const RequestError& e) {
      return e.param();
    }
    return std::string();
  };
  EXPECT_EQ(param_of(R"({"kv_transfer_params": 3})"), "kv_transfer_params");
  EXPECT_EQ(param_of(R"({"kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": true}})"),
            "kv_transfer_params");
  EXPECT_EQ(param_of(R"({"kv_transfer_params": {"do_remote_prefill": true, "remote_port": 1, "remote_request_id": "1"}})"),
            "kv_transfer_params.remote_host");
  EXPECT_EQ(param_of(R"({"kv_transfer_params": {"remote_port": 70000}})"), "kv_transfer_params.remote_port");
  EXPECT_EQ(param_of(R"({"kv_transfer_params": {"remote_block_ids": [-1]}})"), "kv_transfer_params.remote_block_ids");
  // The id and the host go into the pull's request line and Host header: nothing but the
  // characters of a request id (RFC 3986 unreserved) or of a host name or IP address.
  const std::string pull = R"({"kv_transfer_params": {"do_remote_prefill": true, "remote_port": 1, )";
  for (const char* id : {R"("x\r\nX-Injected: 1")", R"("../../health")", R"("..")", R"("a/b")", R"("a b")", R"("a?b")"})
    EXPECT_EQ(param_of(pull + R"("remote_host": "h", "remote_request_id": )" + id + "}}"),
              "kv_transfer_params.remote_request_id")
        << id;
  EXPECT_EQ(param_of(pull + R"("remote_host": "h", "remote_request_id": ")" + std::string(129, 'a') + "\"}}"),
            "kv_transfer_params.remote_request_id");
  for (const char* host : {R"("h\r\nX: 1")", R"("a b")", R"("user@h")", R"("h/x")"})
    EXPECT_EQ(param_of(pull + R"("remote_request_id": "1", "remote_host": )" + host + "}}"),
              "kv_transfer_params.remote_host")
        << host;
  for (const char* ok : {R"("remote_host": "::1", "remote_request_id": "cmpl-1.a_b~c")",
                         R"("remote_host": "prefill-0.example.com", "remote_request_id": "17-0f")"})
    EXPECT_EQ(param_of(pull + ok + "}}"), "") << ok;
}

TEST(KvTransferRecord, RoundTripsAndRefusesTruncation) {
  KvImport kv;
  kv.format.block_size = 4;
  kv.format.kv_dtype = KvDtype::INT8;
  kv.format.bytes_per_token = 3;
  kv.format.n_layer = 2;
  kv.format.n_head_kv = 1;
  kv.format.head_dim = 1;
  kv.n_tokens = 5;
  for (int i = 0; i < 24; ++i) kv.bytes.push_back(static_cast<std::byte>(i * 37 % 256));
  kv.bytes[3] = std::byte{'\n'};  // binary bytes may hold the header's separator
  const std::vector<int32_t> tokens{1, 2, 3, 4, 5};
  const std::string body = encode_kv_blocks(kv, tokens);
  std::vector<int32_t> got_tokens;
  const KvImport got = decode_kv_blocks(body, &got_tokens);
  EXPECT_EQ(got_tokens, tokens);
  EXPECT_EQ(got.n_tokens, 5);
  EXPECT_EQ(got.bytes, kv.bytes);
  EXPECT_EQ(got.format.kv_dtype, KvDtype::INT8);
  EXPECT_EQ(got.format.bytes_per_block(), 12);
  EXPECT_NE(test::error_of([&] { decode_kv_blocks(std::string_view(body).substr(0, body.size() - 1), nullptr); })
                .find("announces 24 bytes"),
            std::string::npos);
  EXPECT_NE(test::error_of([&] { decode_kv_blocks("no header", nullptr); }).find("no header line"), std::string::npos);
}

// The CUDA IPC answer carries the handles as bytes (any value, NUL and '\n' included), the block
// ids (-1 for a block before a sliding window) and the hold; a malformed one is an error.
TEST(KvTransferRecord, CudaIpcAnswerRoundTripsItsHandlesAndBlocks) {
  KvImport kv;
  kv.format.block_size = 16;
  kv.format.kv_dtype = KvDtype::FP8;
  kv.format.bytes_per_token = 10;
  kv.format.n_layer = 1;
  kv.format.n_head_kv = 1;
  kv.format.head_dim = 4;
  kv.n_tokens = 33;
  KvIpcMemory m;
  m.device_uuid = "GPU-01234567-89ab-cdef-0123-456789abcdef";
  for (int t = 0; t < 4; ++t) {
    std::string h(64, '\0');
    for (int i = 0; i < 64; ++i) h[static_cast<size_t>(i)] = static_cast<char>((t * 64 + i) * 7 % 256);
    m.handles.push_back(h);
  }
  m.block_bytes = {64, 64, 16, 16};
  m.n_blocks = 900;
  kv.ipc = m;
  kv.ipc_blocks = {-1, 7, 8};
  const std::vector<int32_t> tokens(33, 5);
  const std::string body = encode_kv_ipc(kv, tokens, 12.5);
  std::vector<int32_t> got_tokens;
  double hold = 0;
  const KvImport got = decode_kv_ipc(body, &got_tokens, &hold);
  EXPECT_EQ(got_tokens, tokens);
  EXPECT_EQ(got.n_tokens, 33);
  EXPECT_EQ(got.format.kv_dtype, KvDtype::FP8);
  EXPECT_DOUBLE_EQ(hold, 12.5);
  ASSERT_TRUE(got.ipc.has_value());
  EXPECT_EQ(got.ipc->device_uuid, m.device_uuid);
  EXPECT_EQ(got.ipc->handles, m.handles);
  EXPECT_EQ(got.ipc->block_bytes, m.block_bytes);
  EXPECT_EQ(got.ipc->n_blocks, 900);
  EXPECT_EQ(got.ipc_blocks, kv.ipc_blocks);
  EXPECT_TRUE(got.bytes.empty());

  const auto err = [](const std::string& b) {
    double h = 0;
    return test::error_of([&] { decode_kv_ipc(b, nullptr, &h); });
  };
  EXPECT_NE(err("[]").find("not a JSON object"), std::string::npos);
  std::string bad = body;
  bad.replace(bad.find("\"handles\":[\"") + 12, 1, "Z");
  EXPECT_NE(err(bad).find("not lowercase hex"), std::string::npos);
  bad = body;
  bad.replace(bad.find("\"block_bytes\":[64,"), 18, "\"block_bytes\":[");
  EXPECT_NE(err(bad).find("4 CUDA IPC handles for 3 tensors"), std::string::npos);
  EXPECT_NE(err(encode_kv_blocks(KvImport{}, {})).find("malformed"), std::string::npos);
}
