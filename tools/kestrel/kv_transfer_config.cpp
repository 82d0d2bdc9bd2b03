#include "kv_transfer_config.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/error.h"

namespace kestrel::cli {

namespace {

double positive_seconds(const RequestJson& v, const std::string& field) {
  if (!v.is_number() || !(v.get<double>() > 0) || !std::isfinite(v.get<double>()))
    throw Error("--kv-transfer-config: " + field + " must be a positive number of seconds, got " + v.dump());
  return v.get<double>();
}

std::string string_field(const RequestJson& v, const std::string& field) {
  if (!v.is_string()) throw Error("--kv-transfer-config: " + field + " must be a string, got " + v.dump());
  return v.get<std::string>();
}

}  // namespace

KvTransferConfig parse_kv_transfer_config(std::string_view json) {
  const RequestJson j = RequestJson::parse(json, nullptr, false);
  if (j.is_discarded() || !j.is_object()) throw Error("--kv-transfer-config: not a JSON object: " + std::string(json));
  KvTransferConfig c;
  bool role_given = false;
  const auto timing = [&](const std::string& key, const RequestJson& v, const std::string& field) {
    if (key == "abort_request_timeout") c.abort_request_timeout = positive_seconds(v, field);
    else if (key == "kv_pull_timeout") c.kv_pull_timeout = positive_seconds(v, field);
    else return false;
    return true;
  };
  for (const auto& [key, v] : j.items()) {
    if (key == "kv_role") {
      const std::string role = string_field(v, key);
      if (role == "kv_producer") c.kv_role = KvRole::Producer;
      else if (role == "kv_consumer") c.kv_role = KvRole::Consumer;
      else if (role == "kv_both") c.kv_role = KvRole::Both;
      else throw Error("--kv-transfer-config: kv_role must be \"kv_producer\", \"kv_consumer\" or \"kv_both\", got \"" + role + "\"");
      role_given = true;
    } else if (key == "kv_connector") {
      c.kv_connector = string_field(v, key);
      if (c.kv_connector != "KestrelConnector")
        throw Error("--kv-transfer-config: kv_connector \"" + c.kv_connector + "\" is not available; kestrel has \"KestrelConnector\" (pull over HTTP)");
    } else if (key == "engine_id") {
      c.engine_id = string_field(v, key);
    } else if (key == "kv_ip") {
      c.kv_ip = string_field(v, key);
      if (c.kv_ip.empty()) throw Error("--kv-transfer-config: kv_ip must not be empty");
    } else if (key == "kv_connector_extra_config") {
      if (!v.is_object()) throw Error("--kv-transfer-config: kv_connector_extra_config must be an object");
      for (const auto& [k2, v2] : v.items()) {
        if (k2 == "remote_api_key") {
          c.remote_api_key = string_field(v2, "kv_connector_extra_config." + k2);
        } else if (k2 == "kv_transport") {
          const std::string t = string_field(v2, "kv_connector_extra_config." + k2);
          if (t == "auto") c.kv_transport = KvTransport::Auto;
          else if (t == "host") c.kv_transport = KvTransport::Host;
          else if (t == "cuda_ipc") c.kv_transport = KvTransport::CudaIpc;
          else
            throw Error("--kv-transfer-config: kv_connector_extra_config.kv_transport must be \"auto\", \"host\" or "
                        "\"cuda_ipc\", got \"" + t + "\"");
        } else if (!timing(k2, v2, "kv_connector_extra_config." + k2)) {
          throw Error("--kv-transfer-config: unknown field kv_connector_extra_config." + k2);
        }
      }
    } else if (!timing(key, v, key)) {
      throw Error("--kv-transfer-config: unknown field " + key);
    }
  }
  if (!role_given) throw Error("--kv-transfer-config: kv_role is required (\"kv_producer\", \"kv_consumer\" or \"kv_both\")");
  return c;
}

std::optional<KvTransferParams> parse_kv_transfer_params(const RequestJson& request) {
  const auto it = request.find("kv_transfer_params");
  if (it == request.end() || it->is_null()) return std::nullopt;
  const RequestJson& j = *it;
  if (!j.is_object()) throw RequestError("kv_transfer_params", "kv_transfer_params must be an object");
  KvTransferParams p;
  const auto param = [](const char* f) { return std::string("kv_transfer_params.") + f; };
  const auto get_bool = [&](const char* f, bool& out) {
    const auto v = j.find(f);
    if (v == j.end() || v->is_null()) return;
    if (!v->is_boolean()) throw RequestError(param(f), param(f) + " must be a boolean");
    out = v->get<bool>();
  };
  const auto get_string = [&](const char* f, std::string& out) {
    const auto v = j.find(f);
    if (v == j.end() || v->is_null()) return;
    if (v->is_number_integer()) out = std::to_string(v->get<int64_t>());  // vLLM's request ids may be numbers
    else if (!v->is_string()) throw RequestError(param(f), param(f) + " must be a string");
    else out = v->get<std::string>();
  };
  get_bool("do_remote_decode", p.do_remote_decode);
  get_bool("do_remote_prefill", p.do_remote_prefill);
  get_string("remote_host", p.remote_host);
  get_string("remote_engine_id", p.remote_engine_id);
  get_string("remote_request_id", p.remote_request_id);
  if (const auto v = j.find("remote_port"); v != j.end() && !v->is_null()) {
    if (!v->is_number_integer() || v->get<int64_t>() < 1 || v->get<int64_t>() > 65535)
      throw RequestError(param("remote_port"), param("remote_port") + " must be an integer in [1, 65535]");
    p.remote_port = static_cast<int32_t>(v->get<int64_t>());
  }
  if (const auto v = j.find("remote_block_ids"); v != j.end() && !v->is_null()) {
    if (!v->is_array()) throw RequestError(param("remote_block_ids"), param("remote_block_ids") + " must be a list of integers");
    for (const auto& b : *v) {
      if (!b.is_number_integer() || b.get<int64_t>() < 0 || b.get<int64_t>() > std::numeric_limits<int32_t>::max())
        throw RequestError(param("remote_block_ids"), param("remote_block_ids") + " must be a list of block ids");
      p.remote_block_ids.push_back(static_cast<int32_t>(b.get<int64_t>()));
    }
  }
  if (const auto v = j.find("num_computed_tokens"); v != j.end() && !v->is_null()) {
    if (!v->is_number_integer() || v->get<int64_t>() < 0)
      throw RequestError(param("num_computed_tokens"), param("num_computed_tokens") + " must be a non-negative integer");
    p.num_computed_tokens = v->get<int64_t>();
  }
  if (p.do_remote_decode && p.do_remote_prefill)
    throw RequestError("kv_transfer_params", "kv_transfer_params: do_remote_decode and do_remote_prefill exclude each other");
  // Both go into the pull's request line and Host header: only the characters a host name, an IP
  // address or a producer's request id (RFC 3986 unreserved) has, so that no client text can add
  // header lines, requests or path segments to what the consumer sends.
  const auto check_chars = [&](const char* f, const std::string& v, size_t max_len, std::string_view extra) {
    const bool ok = v.size() <= max_len && std::all_of(v.begin(), v.end(), [&](char c) {
                      return std::isalnum(static_cast<unsigned char>(c)) != 0 || extra.find(c) != std::string_view::npos;
                    });
    if (!ok || (!v.empty() && v.find_first_not_of('.') == std::string::npos))
      throw RequestError(param(f), param(f) + " must be at most " + std::to_string(max_len) +
                                       " characters of letters, digits and " + std::string(extra));
  };
  check_chars("remote_host", p.remote_host, 253, ".-:");
  check_chars("remote_request_id", p.remote_request_id, 128, "._~-");
  if (p.do_remote_prefill) {
    if (p.remote_host.empty()) throw RequestError(param("remote_host"), param("remote_host") + " is required with do_remote_prefill");
    if (p.remote_port == 0) throw RequestError(param("remote_port"), param("remote_port") + " is required with do_remote_prefill");
    if (p.remote_request_id.empty())
      throw RequestError(param("remote_request_id"), param("remote_request_id") + " is required with do_remote_prefill");
  }
  return p;
}

Json kv_transfer_params_json(const KvTransferParams& p) {
  Json j = Json::object();
  j["do_remote_decode"] = p.do_remote_decode;
  j["do_remote_prefill"] = p.do_remote_prefill;
  j["remote_engine_id"] = p.remote_engine_id;
  j["remote_block_ids"] = p.remote_block_ids;
  j["remote_host"] = p.remote_host;
  j["remote_port"] = p.remote_port;
  j["remote_request_id"] = p.remote_request_id;
  j["num_computed_tokens"] = p.num_computed_tokens;
  return j;
}

namespace {

Json format_json(const KvImport& kv, const std::vector<int32_t>& tokens) {
  const KvTransferFormat& f = kv.format;
  return Json{{"block_size", f.block_size},
            {"kv_dtype", std::string(kv_dtype_name(f.kv_dtype))},
            {"bytes_per_token", f.bytes_per_token},
            {"n_layer", f.n_layer},
            {"n_head_kv", f.n_head_kv},
            {"head_dim", f.head_dim},
            {"tensor_parallel_size", f.tensor_parallel_size},
            {"n_tokens", kv.n_tokens},
            {"tokens", tokens}};
}

// The header's format fields, n_tokens and tokens into kv and *tokens (nlohmann exceptions for
// missing or mistyped fields).
void read_format(const RequestJson& h, KvImport& kv, std::vector<int32_t>* tokens) {
  KvTransferFormat& f = kv.format;
  f.block_size = h.at("block_size").get<int32_t>();
  f.kv_dtype = parse_kv_dtype(h.at("kv_dtype").get<std::string>(), "KV transfer kv_dtype");
  f.bytes_per_token = h.at("bytes_per_token").get<int64_t>();
  f.n_layer = h.at("n_layer").get<int64_t>();
  f.n_head_kv = h.at("n_head_kv").get<int64_t>();
  f.head_dim = h.at("head_dim").get<int64_t>();
  f.tensor_parallel_size = h.at("tensor_parallel_size").get<int32_t>();
  kv.n_tokens = h.at("n_tokens").get<int64_t>();
  if (tokens != nullptr) *tokens = h.at("tokens").get<std::vector<int32_t>>();
}

std::string to_hex(const std::string& bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  for (const char c : bytes) {
    out += kDigits[static_cast<unsigned char>(c) >> 4];
    out += kDigits[static_cast<unsigned char>(c) & 15];
  }
  return out;
}

std::string from_hex(const std::string& hex) {
  const auto digit = [&](char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    throw Error("KV transfer: a CUDA IPC handle is not lowercase hex: \"" + hex.substr(0, 200) + "\"");
  };
  if (hex.size() % 2 != 0) throw Error("KV transfer: a CUDA IPC handle has an odd number of hex digits");
  std::string out;
  for (size_t i = 0; i < hex.size(); i += 2) out += static_cast<char>(digit(hex[i]) * 16 + digit(hex[i + 1]));
  return out;
}

}  // namespace

std::string encode_kv_blocks(const KvImport& kv, const std::vector<int32_t>& tokens) {
  Json h = format_json(kv, tokens);
  h["n_bytes"] = kv.bytes.size();
  std::string out = h.dump();
  out += '\n';
  out.append(reinterpret_cast<const char*>(kv.bytes.data()), kv.bytes.size());
  return out;
}

KvImport decode_kv_blocks(std::string_view body, std::vector<int32_t>* tokens) {
  const size_t nl = body.find('\n');
  if (nl == std::string_view::npos) throw Error("KV transfer: the producer's answer has no header line");
  const RequestJson h = RequestJson::parse(body.substr(0, nl), nullptr, false);
  if (h.is_discarded() || !h.is_object()) throw Error("KV transfer: the producer's header is not a JSON object");
  KvImport kv;
  try {
    read_format(h, kv, tokens);
    const auto n_bytes = h.at("n_bytes").get<uint64_t>();
    if (n_bytes != body.size() - nl - 1)
      throw Error("KV transfer: the header announces " + std::to_string(n_bytes) + " bytes of K/V, " +
                  std::to_string(body.size() - nl - 1) + " arrived");
  } catch (const RequestJson::exception& e) {
    throw Error(std::string("KV transfer: malformed header: ") + e.what());
  }
  const std::string_view bytes = body.substr(nl + 1);
  kv.bytes.resize(bytes.size());
  std::memcpy(kv.bytes.data(), bytes.data(), bytes.size());
  return kv;
}

std::string encode_kv_ipc(const KvImport& kv, const std::vector<int32_t>& tokens, double hold_seconds) {
  Json h = format_json(kv, tokens);
  const KvIpcMemory& m = *kv.ipc;
  Json handles = Json::array();
  for (const std::string& b : m.handles) handles.push_back(to_hex(b));
  h["kv_transport"] = "cuda_ipc";
  h["device_uuid"] = m.device_uuid;
  h["handles"] = std::move(handles);
  h["block_bytes"] = m.block_bytes;
  h["n_pool_blocks"] = m.n_blocks;
  h["blocks"] = kv.ipc_blocks;
  h["hold_seconds"] = hold_seconds;
  return h.dump();
}

KvImport decode_kv_ipc(std::string_view body, std::vector<int32_t>* tokens, double* hold_seconds) {
  const RequestJson h = RequestJson::parse(body, nullptr, false);
  if (h.is_discarded() || !h.is_object()) throw Error("KV transfer: the producer's CUDA IPC answer is not a JSON object");
  KvImport kv;
  try {
    read_format(h, kv, tokens);
    if (h.at("kv_transport").get<std::string>() != "cuda_ipc")
      throw Error("KV transfer: the producer's answer is not a CUDA IPC one");
    KvIpcMemory m;
    m.device_uuid = h.at("device_uuid").get<std::string>();
    for (const auto& x : h.at("handles")) m.handles.push_back(from_hex(x.get<std::string>()));
    m.block_bytes = h.at("block_bytes").get<std::vector<int64_t>>();
    m.n_blocks = h.at("n_pool_blocks").get<int32_t>();
    kv.ipc_blocks = h.at("blocks").get<std::vector<int32_t>>();
    *hold_seconds = h.at("hold_seconds").get<double>();
    if (m.handles.size() != m.block_bytes.size())
      throw Error("KV transfer: " + std::to_string(m.handles.size()) + " CUDA IPC handles for " +
                  std::to_string(m.block_bytes.size()) + " tensors");
    kv.ipc = std::move(m);
  } catch (const RequestJson::exception& e) {
    throw Error(std::string("KV transfer: malformed CUDA IPC answer: ") + e.what());
  }
  return kv;
}

}  // namespace kestrel::cli
