// Disaggregated prefill's transport on the consumer side: the pull of a producer's held K/V over
// HTTP (GET /v1/kv_transfer/{remote_request_id}, answered by the producer's EngineLoop::pull_kv),
// with Boost.Beast, the library the server already uses.
#pragma once

#include <string>
#include <vector>

#include "engine/engine.h"

namespace kestrel::cli {

// Pulls request `remote_request_id`'s K/V from the producer at host:port within timeout_s seconds
// (connect, request and answer together); *tokens gets the token ids they were computed from.
// api_key: sent as "Authorization: Bearer <api_key>" (RFC 6750) unless empty.
// Errors: kestrel::Error saying what failed: the connection (refused, timed out), a non-200 answer
// (its status and message, e.g. 401 for a missing or wrong key), or a malformed record
// (decode_kv_blocks).
KvImport pull_kv_blocks(const std::string& host, int port, const std::string& remote_request_id, double timeout_s,
                        const std::string& api_key, std::vector<int32_t>* tokens);

}  // namespace kestrel::cli
