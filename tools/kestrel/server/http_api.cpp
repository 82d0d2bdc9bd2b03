#include "server/http_api.h"

#include <malloc.h>

#include <algorithm>
#include <charconv>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <ctime>

#include <xxhash.h>

#include "chat_prompt.h"
#include "server/http_generate.h"
#include "server/openai_api.h"
#include "server/work_pool.h"

namespace kestrel::cli {

namespace {

HttpResponse json_response(const Json& j) {
  HttpResponse r;
  r.body = dump(j);
  return r;
}

HttpResponse error_json(int status, const std::string& message, const std::string& param = "",
                        const std::string& code = "") {
  HttpResponse r;
  r.status = status;
  r.body = dump(error_body(message, "invalid_request_error", param, code));
  return r;
}

Json models_json(const ApiState& api) {
  Json model{{"id", api.served_model_name},
             {"object", "model"},
             {"created", api.started},
             {"owned_by", "kestrel"},
             {"max_model_len", api.max_model_len}};
  return Json{{"object", "list"}, {"data", Json::array({model})}};
}

// A JSON object body, or an error response.
std::optional<HttpResponse> parse_object(const std::string& body, RequestJson* out) {
  try {
    *out = parse_request_body(body);
  } catch (const RequestError& e) {
    return error_json(400, e.what(), e.param());
  }
  if (!out->is_object())
    return error_json(400, std::string("the request body must be a JSON object, got ") + out->type_name());
  return std::nullopt;
}

// A boolean field, or def when absent; throws RequestError for another type.
bool bool_field(const RequestJson& j, const char* name, bool def) {
  const auto it = j.find(name);
  if (it == j.end() || it->is_null()) return def;
  if (!it->is_boolean()) throw RequestError(name, std::string(name) + " must be true or false, got " + shown(*it));
  return it->get<bool>();
}

// An optional "model" field that names another model: 404 (as the generation routes answer).
std::optional<HttpResponse> check_model(const ApiState& api, const RequestJson& j) {
  const auto it = j.find("model");
  if (it == j.end() || it->is_null()) return std::nullopt;
  if (!it->is_string()) return error_json(400, "model must be a string, got " + shown(*it), "model");
  if (const auto& m = it->get_ref<const std::string&>(); !m.empty() && m != api.served_model_name)
    return error_json(404, "The model `" + m + "` does not exist; this server serves `" + api.served_model_name + "`",
                      "model", "model_not_found");
  return std::nullopt;
}

// POST /tokenize (vLLM): {"prompt": str, "add_special_tokens": bool = true} or {"messages": [...],
// "add_generation_prompt": bool = true, "add_special_tokens": bool, "chat_template_kwargs": {...}}
// -> {"count", "max_model_len",
// "tokens", "token_strs": null}. Messages get the server's chat prompt: without add_special_tokens,
// BOS as chat requests get it (none when the template writes it). There is no size bound (vLLM has
// none): this runs on the pool's own tokenizer threads, and stops (EncodeCancelled) once *cancel is
// set.
HttpResponse tokenize(ApiState& api, const std::string& body, const std::atomic<bool>* cancel) {
  RequestJson j;
  if (auto e = parse_object(body, &j)) return *e;
  if (auto e = check_model(api, j)) return *e;
  const Tokenizer& tok = *api.format.tokenizer;
  std::vector<int32_t> ids;
  try {
    const bool has_prompt = j.contains("prompt"), has_messages = j.contains("messages");
    if (has_prompt && has_messages) throw RequestError("messages", "give either prompt (a string) or messages, not both");
    if (!has_prompt && !has_messages) throw RequestError("prompt", "give prompt (a string) or messages");
    if (has_prompt) {
      const RequestJson& p = j["prompt"];
      if (!p.is_string()) throw RequestError("prompt", "prompt must be a string, got " + shown(p));
      ids = tok.encode(p.get_ref<const std::string&>(), bool_field(j, "add_special_tokens", true), true, cancel);
    } else {
      RequestJson chat{{"messages", j["messages"]}};
      if (j.contains("chat_template_kwargs")) chat["chat_template_kwargs"] = j["chat_template_kwargs"];
      const OpenAiRequest r = parse_openai_request(chat, RequestApi::Chat);
      const std::string text = render_chat(api.format, r.messages_json, bool_field(j, "add_generation_prompt", true),
                                           r.tools, r.chat_template_kwargs);
      ids = tok.encode(text, bool_field(j, "add_special_tokens", !api.format.starts_with_bos(text)), true, cancel);
    }
  } catch (const RequestError& e) {
    return error_json(400, e.what(), e.param());
  } catch (const Error& e) {
    return error_json(400, e.what());
  }
  return json_response(Json{{"count", ids.size()},
                            {"max_model_len", api.max_model_len},
                            {"tokens", ids},
                            {"token_strs", nullptr}});
}

// POST /detokenize (vLLM): {"tokens": [id, ...]} -> {"prompt": text}, special tokens included.
HttpResponse detokenize(ApiState& api, const std::string& body) {
  RequestJson j;
  if (auto e = parse_object(body, &j)) return *e;
  if (auto e = check_model(api, j)) return *e;
  const Tokenizer& tok = *api.format.tokenizer;
  std::vector<int32_t> ids;
  try {
    const auto it = j.find("tokens");
    if (it == j.end() || !it->is_array()) throw RequestError("tokens", "tokens must be a list of token ids");
    for (size_t i = 0; i < it->size(); ++i) {
      const RequestJson& v = (*it)[i];
      const std::string name = "tokens[" + std::to_string(i) + "]";
      if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= tok.n_vocab())
        throw RequestError(name, name + " = " + shown(v) + " is not a token id of the vocabulary (0 to " +
                                     std::to_string(tok.n_vocab() - 1) + ")");
      ids.push_back(static_cast<int32_t>(v.get<int64_t>()));
    }
  } catch (const RequestError& e) {
    return error_json(400, e.what(), e.param());
  }
  return json_response(Json{{"prompt", tok.decode(ids, /*skip_special=*/false)}});
}

// GET /tokenizer_info (vLLM): what a remote-tokenizer client needs to know.
HttpResponse tokenizer_info(const ApiState& api) {
  const Tokenizer& tok = *api.format.tokenizer;
  auto token_text = [&](int32_t id) { return id >= 0 ? Json(tok.token(id).text) : Json(nullptr); };
  return json_response(Json{
      {"tokenizer_class", tok.kind() == TokenizerKind::SPM ? "SentencePieceBPE" : "ByteLevelBPE"},
      {"bos_token", token_text(tok.bos_id())},
      {"eos_token", token_text(tok.eos_id())},
      {"pad_token", token_text(tok.pad_id())},
      {"chat_template", api.format.template_source.empty() ? Json(nullptr) : Json(api.format.template_source)},
      {"model_max_length", api.max_model_len},
      {"vocab_size", tok.n_vocab()},
  });
}

// Bodies above this size leave freed memory that glibc keeps; it is handed back once answered.
constexpr size_t kTrimAbove = size_t{1} << 20;

// A request whose answer is computed on a WorkPool tokenizer thread (tokenizing megabytes takes
// seconds): the connection keeps its place (pipelined requests wait), and a client that leaves (or a
// server that stops) cancels it, before it starts or while it tokenizes.
struct OffloadedRequest : RequestHandler {
  std::atomic<bool> cancelled{false};
  void cancel() override { cancelled = true; }
};

template <class Answer>
void answer_off_loop(const std::shared_ptr<HttpSession>& session, std::string body, Answer answer) {
  auto pending = std::make_shared<OffloadedRequest>();
  session->attach(pending);
  WorkPool::of(session->executor())
      .run(
          WorkLane::Tokenizer, session->executor(), &pending->cancelled,
          [pending, body = std::move(body), answer = std::move(answer)]() mutable {
            HttpResponse r;
            if (pending->cancelled) return r;
            try {
              r = answer(body, &pending->cancelled);
            } catch (const EncodeCancelled&) {  // nobody waits for the answer (done drops it)
              r = HttpResponse{};
            } catch (const std::exception& e) {  // not expected (bad_alloc): still an answer
              r.status = 500;
              r.body = dump(error_body(std::string("internal error: ") + e.what(), "server_error"));
            }
            if (body.size() > kTrimAbove) {
              std::string().swap(body);
              malloc_trim(0);
            }
            return r;
          },
          [weak = std::weak_ptr<HttpSession>(session), pending](HttpResponse r) {
            if (auto s = weak.lock(); s && !pending->cancelled) s->respond(std::move(r));
          });
}

size_t longest_token(const Tokenizer& tok) {
  size_t n = 4;
  for (int32_t id = 0; id < tok.n_vocab(); ++id)
    n = std::max({n, tok.token(id).text.size(), tok.token_to_piece(id).size()});
  return n;
}

// The {id} of a /v1/kv_transfer/ route as an engine request id, or nullopt after answering the error
// (404: not a producer, or not an id).
std::optional<RequestId> kv_request_id(ApiState& api, const std::shared_ptr<HttpSession>& session,
                                       const std::string& id_text) {
  if (!api.kv_transfer || !api.kv_transfer->produces()) {
    session->respond(error_json(404, "this server is not a KV producer (--kv-transfer-config kv_role)",
                                "remote_request_id", "kv_transfer_unavailable"));
    return std::nullopt;
  }
  const std::optional<RequestId> id = api.kv_transfer_request_id(id_text);
  if (!id) {
    session->respond(error_json(404, "no held K/V for request \"" + id_text + "\"", "remote_request_id",
                                "kv_transfer_not_found"));
    return std::nullopt;
  }
  return id;
}

// GET /v1/kv_transfer/{id}: the held K/V of producer request id, answered from the engine thread
// (EngineLoop::pull_kv); the blocks are freed once read. GET /v1/kv_transfer/{id}/cuda_ipc
// (cuda_ipc): their CUDA IPC handles and block ids as JSON (encode_kv_ipc); the blocks stay held
// until DELETE /v1/kv_transfer/{id} or the hold timeout; 409 when this backend has no IPC (the
// blocks stay held: a pull through host memory may follow).
void answer_kv_pull(ApiState& api, const std::shared_ptr<HttpSession>& session, const std::string& id_text,
                    bool cuda_ipc) {
  const std::optional<RequestId> id = kv_request_id(api, session, id_text);
  if (!id) return;
  auto pending = std::make_shared<OffloadedRequest>();
  session->attach(pending);
  api.loop.pull_kv(*id, cuda_ipc, [weak = std::weak_ptr<HttpSession>(session), ex = session->executor(), pending,
                                   cuda_ipc](std::string body, std::string error, int status) mutable {
    boost::asio::post(ex, [weak, pending, body = std::move(body), error = std::move(error), status, cuda_ipc]() mutable {
      auto s = weak.lock();
      if (!s || pending->cancelled) return;
      if (!error.empty())
        return s->respond(error_json(status, error, "remote_request_id",
                                     status == 409 ? "kv_transport_unavailable" : "kv_transfer_not_found"));
      HttpResponse r;
      r.content_type = cuda_ipc ? "application/json" : "application/octet-stream";
      r.body = std::move(body);
      s->respond(std::move(r));
    });
  });
}

// DELETE /v1/kv_transfer/{id}: the consumer has copied the held K/V (CUDA IPC); they are freed.
// 200 {"released": true}, or 404 when nothing was held under id.
void answer_kv_release(ApiState& api, const std::shared_ptr<HttpSession>& session, const std::string& id_text) {
  const std::optional<RequestId> id = kv_request_id(api, session, id_text);
  if (!id) return;
  auto pending = std::make_shared<OffloadedRequest>();
  session->attach(pending);
  api.loop.release_kv(*id, [weak = std::weak_ptr<HttpSession>(session), ex = session->executor(), pending,
                            id_text](bool held) {
    boost::asio::post(ex, [weak, pending, held, id_text] {
      auto s = weak.lock();
      if (!s || pending->cancelled) return;
      if (!held)
        return s->respond(error_json(404, "no held K/V for request \"" + id_text + "\"", "remote_request_id",
                                     "kv_transfer_not_found"));
      s->respond(json_response(Json{{"released", true}}));
    });
  });
}

}  // namespace

ApiState::ApiState(std::string name, const PromptFormat& f, int64_t len, EngineLoop& l, ServerMetrics& m)
    : served_model_name(std::move(name)),
      format(f),
      max_model_len(len),
      max_token_bytes(longest_token(*f.tokenizer)),
      loop(l),
      metrics(m),
      started(std::time(nullptr)),
      seeds_(std::random_device{}()) {
  std::random_device rd;
  for (size_t i = 0; i < kv_id_key_.size(); i += 4) {
    const uint32_t v = rd();
    std::memcpy(kv_id_key_.data() + i, &v, 4);
  }
}

namespace {
std::string kv_id_tag(RequestId id, const std::array<unsigned char, 192>& key) {
  const XXH128_hash_t h = XXH3_128bits_withSecret(&id, sizeof(id), key.data(), key.size());
  char hex[33];
  std::snprintf(hex, sizeof(hex), "%016llx%016llx", static_cast<unsigned long long>(h.high64),
                static_cast<unsigned long long>(h.low64));
  return hex;
}
}  // namespace

std::string ApiState::kv_transfer_id(RequestId id) const { return std::to_string(id) + "-" + kv_id_tag(id, kv_id_key_); }

std::optional<RequestId> ApiState::kv_transfer_request_id(std::string_view text) const {
  const size_t dash = text.find('-');
  if (dash == std::string_view::npos) return std::nullopt;
  RequestId id = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + dash, id);
  if (ec != std::errc() || end != text.data() + dash) return std::nullopt;
  if (!same_secret(text.substr(dash + 1), kv_id_tag(id, kv_id_key_))) return std::nullopt;
  return id;
}

uint64_t ApiState::random_seed() {
  std::lock_guard lock(seed_mutex_);
  return seeds_();
}

void handle_request(ApiState& api, const std::shared_ptr<HttpSession>& session, HttpRequest req) {
  try {
    switch (req.route) {
      case Route::Completions:
        return start_generation(api, session, std::move(req.body), RequestApi::Completions);
      case Route::ChatCompletions:
        return start_generation(api, session, std::move(req.body), RequestApi::Chat);
      case Route::Models:
        return session->respond(json_response(models_json(api)));
      case Route::Model:
        if (req.model_id != api.served_model_name)
          return session->respond(error_json(404, "The model `" + req.model_id + "` does not exist.", "model",
                                             "model_not_found"));
        return session->respond(json_response(models_json(api)["data"][0]));
      case Route::Health: {
        const bool ok = api.loop.snapshot().alive && api.loop.accepting();
        HttpResponse r;
        r.status = ok ? 200 : 503;
        r.body = ok ? "{\"status\":\"ok\"}" : "{\"status\":\"unavailable\"}";
        return session->respond(std::move(r));
      }
      case Route::Metrics: {
        HttpResponse r;
        r.content_type = "text/plain; version=0.0.4; charset=utf-8";
        r.body = api.metrics.render(api.loop.snapshot());
        return session->respond(std::move(r));
      }
      case Route::Tokenize:
        return answer_off_loop(session, std::move(req.body),
                               [&api](const std::string& b, const std::atomic<bool>* c) { return tokenize(api, b, c); });
      case Route::Detokenize:
        return answer_off_loop(session, std::move(req.body),
                               [&api](const std::string& b, const std::atomic<bool>*) { return detokenize(api, b); });
      case Route::TokenizerInfo:
        return session->respond(tokenizer_info(api));
      case Route::KvTransfer:
        return answer_kv_pull(api, session, req.model_id, false);
      case Route::KvTransferIpc:
        return answer_kv_pull(api, session, req.model_id, true);
      case Route::KvRelease:
        return answer_kv_release(api, session, req.model_id);
    }
  } catch (const std::exception& e) {
    // Not expected: every handler answers bad input itself. The connection still gets an answer.
    HttpResponse r;
    r.status = 500;
    r.body = dump(error_body(std::string("internal error: ") + e.what(), "server_error"));
    session->respond(std::move(r));
  }
}

}  // namespace kestrel::cli
