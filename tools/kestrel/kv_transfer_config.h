// Disaggregated prefill on the server side, the JSON parts (vLLM's names): the --kv-transfer-config
// flag (KVTransferConfig), a request's kv_transfer_params, and the header of the K/V block record a
// producer answers a consumer's pull with. Pure functions; the transport is server/kv_transfer.h.
//
// The flow (vLLM's disaggregated serving, pull model as its NIXL connector):
//   1. a prefill request with max_tokens 1 and kv_transfer_params {"do_remote_decode": true} to a
//      producer: it prefills, answers, and holds the request's K/V blocks; its answer carries
//      kv_transfer_params {do_remote_prefill, remote_host, remote_port, remote_engine_id,
//      remote_request_id, remote_block_ids, num_computed_tokens};
//   2. the same request with those kv_transfer_params to a consumer: it pulls the blocks
//      (GET /v1/kv_transfer/<remote_request_id> on the producer, which then frees them; or, on one
//      GPU, GET .../cuda_ipc for their CUDA IPC handles, copies them device to device and sends
//      DELETE /v1/kv_transfer/<remote_request_id>), computes the last prompt token and decodes.
// A producer frees blocks no consumer pulled after abort_request_timeout seconds.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "engine/engine.h"
#include "openai_request.h"

namespace kestrel::cli {

enum class KvRole { Producer, Consumer, Both };
// How a consumer's pull moves the blocks (kv_connector_extra_config.kv_transport): Host, the
// bytes in the pull's HTTP answer; CudaIpc, device to device when producer and consumer run on
// one GPU (the answer carries CUDA IPC handles and block ids); Auto, CUDA IPC where the consumer
// runs on CUDA and the producer answers with handles of the consumer's GPU, else Host.
enum class KvTransport { Auto, Host, CudaIpc };

struct KvTransferConfig {
  KvRole kv_role = KvRole::Both;
  std::string kv_connector = "KestrelConnector";
  std::string engine_id;                // remote_engine_id in answers; "" = "kestrel-<port>"
  std::string kv_ip = "127.0.0.1";      // the host consumers pull from (remote_host)
  double abort_request_timeout = 480;   // seconds a producer holds unpulled blocks (vLLM's default)
  double kv_pull_timeout = 60;          // seconds a consumer's pull may take
  // A consumer's pulls send "Authorization: Bearer <remote_api_key>" when it is not empty: the
  // producer's --api-key (kv_connector_extra_config.remote_api_key; `serve` fills in its own
  // --api-key when the field is absent, one key for a whole deployment as with vLLM's proxy).
  std::string remote_api_key;
  KvTransport kv_transport = KvTransport::Auto;
  bool produces() const { return kv_role != KvRole::Consumer; }
  bool consumes() const { return kv_role != KvRole::Producer; }
};

// Parses --kv-transfer-config's JSON object: kv_role ("kv_producer", "kv_consumer", "kv_both";
// required), kv_connector ("KestrelConnector"), engine_id, kv_ip, and in kv_connector_extra_config
// or at the top: abort_request_timeout, kv_pull_timeout (seconds, > 0); in kv_connector_extra_config
// only: remote_api_key (a string), kv_transport ("auto", "host", "cuda_ipc"). Errors: kestrel::Error naming
// the field, for a wrong type or value or an unknown field.
KvTransferConfig parse_kv_transfer_config(std::string_view json);

// A request's kv_transfer_params.
struct KvTransferParams {
  bool do_remote_decode = false;   // producer: prefill and hold the K/V
  bool do_remote_prefill = false;  // consumer: pull the K/V from remote_*
  std::string remote_host;
  int32_t remote_port = 0;
  std::string remote_engine_id;
  std::string remote_request_id;
  std::vector<int32_t> remote_block_ids;
  int64_t num_computed_tokens = 0;
};
// Absent or null: nullopt. Errors: RequestError naming "kv_transfer_params.<field>"; both
// do_remote_* set, or do_remote_prefill without remote_host, remote_port or remote_request_id.
std::optional<KvTransferParams> parse_kv_transfer_params(const RequestJson& request);
Json kv_transfer_params_json(const KvTransferParams& p);

// The pull's answer body: one line of JSON (the producer's KvTransferFormat, n_tokens and the
// token ids whose K/V follow), '\n', then the blocks' bytes (KvImport::bytes).
std::string encode_kv_blocks(const KvImport& kv, const std::vector<int32_t>& tokens);
// Errors: kestrel::Error for a malformed header or a byte count that does not match it.
KvImport decode_kv_blocks(std::string_view body, std::vector<int32_t>* tokens);

// The CUDA IPC pull's answer (GET /v1/kv_transfer/<id>/cuda_ipc): one JSON object, the header's
// fields and kv_transport "cuda_ipc", device_uuid, handles (hex, 64 bytes each), block_bytes (per
// tensor), n_pool_blocks, blocks (the held block ids, -1 for none) and hold_seconds (how long the
// producer holds them from now unless released sooner). kv.ipc must be set.
std::string encode_kv_ipc(const KvImport& kv, const std::vector<int32_t>& tokens, double hold_seconds);
// Errors: kestrel::Error for a malformed answer. *hold_seconds gets the producer's hold.
KvImport decode_kv_ipc(std::string_view body, std::vector<int32_t>* tokens, double* hold_seconds);

}  // namespace kestrel::cli
