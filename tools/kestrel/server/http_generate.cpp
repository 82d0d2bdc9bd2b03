#include "server/http_generate.h"

#include <boost/asio/post.hpp>

#include <malloc.h>

#include <atomic>
#include <ctime>

#include "chat_prompt.h"
#include "server/kv_transfer.h"
#include "server/openai_api.h"
#include "server/work_pool.h"

namespace kestrel::cli {

namespace {

HttpResponse error_json(int status, const std::string& message, const std::string& param = "",
                        const std::string& code = "", const std::string& type = "invalid_request_error") {
  HttpResponse r;
  r.status = status;
  r.body = dump(error_body(message, type, param, code));
  return r;
}

// The error body of a request that ended with finish_reason "error": an invalid request when its own
// fields caused it (its filters left no token to sample), else the server's.
Json generation_error(const RequestOutput& o) {
  return o.error_from_request ? error_body(o.error) : error_body("generation failed: " + o.error, "server_error");
}

// Bodies above this size leave freed memory that glibc keeps; it is handed back once prepared.
constexpr size_t kTrimAbove = size_t{1} << 20;

// The most logprob entries a request may ask for: choices x (echoed prompt tokens + max_tokens) x
// (logprobs + 1), each entry some 60-80 bytes of JSON, so about 100 MB of response at most. Scoring
// a 32K-token prompt with logprobs 5 (lm-eval's loglikelihood), or a chat of the whole context with
// top_logprobs 20, stays well below it; n = 128 echoes of a prompt with logprobs 20 do not.
constexpr uint64_t kMaxLogprobEntries = uint64_t{1} << 20;

// One prompt of the request, as the engine sees it and as the response repeats it.
struct PromptInfo {
  int64_t n_prompt = 0;
  std::string echo_text;            // completions with echo: the prompt text
  std::vector<int32_t> prompt_ids;  // echo with logprobs, prompt_logprobs: the prompt's tokens, listed in them
  // Echo with logprobs, prompt_logprobs: the prompt's logprobs are computed once, by the prompt's first
  // choice (the others skip them), and every choice repeats the same ones. scored: that choice's first
  // output (which carries them) has arrived; echo_logprobs and echo_offset (characters the echo covers),
  // and prompt_logprobs (vLLM's list), are then set.
  bool scored = false;
  Json echo_logprobs;
  int64_t echo_offset = 0;
  Json prompt_logprobs;
};

// The engine computes the prompt's logprobs once with the top alternatives of whichever field asks for
// more (echo's logprobs, prompt_logprobs); each lists its own number.
std::vector<LogprobSummary> with_top(std::span<const LogprobSummary> logprobs, int32_t n_top) {
  std::vector<LogprobSummary> out(logprobs.begin(), logprobs.end());
  for (LogprobSummary& l : out)
    if (l.top.size() > static_cast<size_t>(n_top)) l.top.resize(static_cast<size_t>(n_top));
  return out;
}

// What a request's preparation (off the event loop) ends with: an error to answer, or the engine requests to
// submit.
struct Prepared {
  std::optional<HttpResponse> error;
  std::vector<Request> requests;
};

// One HTTP request's generation: its choices as they arrive and what is needed to answer.
class Generation : public RequestHandler, public std::enable_shared_from_this<Generation> {
 public:
  Generation(ApiState& api, const std::shared_ptr<HttpSession>& session) : api_(api), session_(session) {
    ++api_.open_generations;
  }
  ~Generation() override { --api_.open_generations; }
  Generation(const Generation&) = delete;
  Generation& operator=(const Generation&) = delete;

  // Validates and tokenizes (on a WorkPool thread: touches no connection state), filling the generation in;
  // or returns the error to answer.
  Prepared prepare(const std::string& body, RequestApi which);
  // On the connection's strand: answers prepare's error or submits its requests.
  void start(Prepared p);
  // The preparation's cancel flag (WorkPool::run).
  std::atomic<bool>* cancel_flag() { return &cancelled_; }
  void cancel() override {
    if (cancelled_.exchange(true)) return;
    if (channel_) api_.loop.abort(channel_);  // queued after the submit: aborts whatever was admitted
  }

 private:
  struct Choice {
    std::string text;
    LoggedTokens logged;                          // non-streamed: every logged token
    bool echo_sent = false;                       // streamed echo with logprobs: the echo chunk is out
    std::vector<ChoiceOutput> held;               // streamed: outputs waiting for the prompt's logprobs
    int64_t text_offset = 0;                      // completions logprobs: characters before the next token
    bool finished = false;
    std::string finish_reason, error;
    bool error_from_request = false;              // RequestOutput::error_from_request: a 400, not a 500
    Json stop_reason;                             // vLLM's: the stop string or stop token id that ended it, or null
    int64_t n_output = 0;
    double cumulative_logprob = 0;                // best_of: the sum of the chosen tokens' logprobs
    std::vector<BeamHypothesis> beams;            // beam search: the prompt's returned beams
    KvTransferParams kv_held;                     // do_remote_decode: what a consumer pulls
  };

  Prepared prepare_checked(const std::string& body, RequestApi which);
  // kv_transfer_params (kv_transfer_config.h): a producer's request is marked to hold its K/V; a
  // consumer's pulls them from the producer into every request (the pull blocks this WorkPool
  // thread up to kv_pull_timeout). Returns the error to answer, if any.
  std::optional<HttpResponse> apply_kv_transfer(const RequestJson& j, const OpenAiRequest& r, std::vector<Request>& bases);
  std::optional<HttpResponse> check_logprob_volume(const OpenAiRequest& r, const std::vector<Request>& bases) const;
  std::optional<HttpResponse> check_prompt_bytes(const OpenAiRequest& r) const;
  void submit(HttpSession& s, std::vector<Request> requests);
  void on_notify();
  bool note_prompt_logprobs(const ChoiceOutput& o);
  void complete(HttpSession& s, std::vector<ChoiceOutput>& outputs);
  void stream(HttpSession& s, std::vector<ChoiceOutput>& outputs);
  std::string chunks_for(ChoiceOutput& o);
  std::string beam_chunks(ChoiceOutput& o);
  std::optional<HttpResponse> failed() const;
  std::vector<FinalChoice> returned_choices();
  const PromptInfo& prompt_of(size_t choice) const { return prompts_[choice / static_cast<size_t>(n_)]; }
  // Choices the response lists: n per prompt (beam search: the prompt's beams; best_of: the best n).
  size_t n_listed() const { return prompts_.size() * static_cast<size_t>(n_return_); }
  void finish(Choice& c, const RequestOutput& o) {
    c.finished = true;
    c.finish_reason = o.finish_reason;
    c.error = o.error;
    c.error_from_request = o.error_from_request;
    c.stop_reason = stop_reason_json(o, reported_stop_ids_);
    c.n_output = o.metrics.n_output_tokens;
    if (no_generation_) {
      c.n_output = 0;
      if (c.finish_reason == "stop") c.finish_reason = "length";  // the stop id was not reported
      c.stop_reason = nullptr;
    }
    ++n_finished_;
  }
  Json usage() const {
    int64_t n_prompt = 0, n_completion = 0;
    for (const PromptInfo& p : prompts_) n_prompt += p.n_prompt;
    for (const Choice& c : choices_) n_completion += c.n_output;
    return usage_json(n_prompt, n_completion);
  }
  void respond(HttpSession& s, HttpResponse r) {
    done_ = true;
    s.respond(std::move(r));
  }

  ApiState& api_;
  std::weak_ptr<HttpSession> session_;
  std::shared_ptr<RequestChannel> channel_;
  ResponseHeader header_;
  std::vector<int32_t> reported_stop_ids_;  // stop_token_ids whose id stop_reason reports (reported_stop_ids)
  std::vector<PromptInfo> prompts_;
  int32_t n_ = 1;  // engine requests per prompt: n, best_of (ranked), or 1 (beam search)
  int32_t n_return_ = 1;  // choices per prompt in the response (n)
  bool beam_ = false;          // use_beam_search: one engine request per prompt, its beams the choices
  bool rank_best_of_ = false;  // best_of > n: the n of best_of with the highest cumulative logprob
  bool want_logprobs_ = false;
  int32_t echo_top_ = -1;         // echo with logprobs (completions): the alternatives per echoed token, else -1
  int32_t prompt_top_ = -1;       // prompt_logprobs, else -1
  bool echo_scored_ = false;      // the prompt's logprobs are computed (echo with logprobs, prompt_logprobs)
  bool no_generation_ = false;    // completions with max_tokens 0: the one token generated is not reported
  bool include_usage_ = false;
  bool streamed_ = false;
  std::vector<Choice> choices_;
  size_t n_finished_ = 0;
  bool started_ = false;  // streamed: the head and the first chunks are written
  bool done_ = false;     // the whole answer is written
  std::atomic<bool> cancelled_{false};  // also read by prepare, off the strand
  bool kv_producer_ = false;  // do_remote_decode: the answer carries kv_transfer_params
};

Prepared Generation::prepare(const std::string& body, RequestApi which) {
  try {
    return prepare_checked(body, which);
  } catch (const std::exception& e) {  // not expected (bad_alloc): the client still gets an answer
    return Prepared{error_json(500, std::string("internal error: ") + e.what(), "", "", "server_error"), {}};
  }
}

// A prompt whose text alone is longer than max_model_len tokens can cover is refused before it is tokenized
// (tokenizing megabytes takes seconds): a token stands for at most ApiState::max_token_bytes bytes of the
// text it is encoded from, so such text has more than max_model_len tokens whatever the tokenizer does, and
// BOS or EOS only add tokens. Completions: each text prompt (token-id prompts are counted as they are); chat:
// the rendered prompt, the text that is tokenized (a template may add to the messages or trim them, so their
// own size proves nothing).
std::optional<HttpResponse> Generation::check_prompt_bytes(const OpenAiRequest& r) const {
  const auto per_token = static_cast<uint64_t>(api_.max_token_bytes);
  const auto max_bytes = static_cast<uint64_t>(api_.max_model_len) * per_token;
  auto refuse = [&](uint64_t n_bytes, const std::string& which_prompt, const std::string& param) {
    return error_json(
        400,
        which_prompt + " is " + std::to_string(n_bytes) + " bytes long, more than the context " +
            "(max_model_len) of " + std::to_string(api_.max_model_len) +
            " tokens can hold: a token of this model stands for at most " + std::to_string(per_token) +
            " bytes, so it has more than " + std::to_string(api_.max_model_len) + " tokens",
        param, "context_length_exceeded");
  };
  if (r.is_chat) {
    const std::string& text = *r.chat_prompt;
    if (text.size() > max_bytes)
      return refuse(text.size(), "the chat prompt (messages in the chat template)", "messages");
    return std::nullopt;
  }
  for (size_t p = 0; p < r.prompts.size(); ++p) {
    const PromptInput& in = r.prompts[p];
    if (!in.ids && in.text.size() > max_bytes)
      return refuse(in.text.size(), r.prompts.size() > 1 ? "prompt " + std::to_string(p) : "the prompt",
                    "prompt");
  }
  return std::nullopt;
}

// Logprobs make a response grow with n x tokens x logprobs, not with the request: a few KB may ask for
// hundreds of MB. Checked once the prompts are tokenized (their lengths known) and fit the context, so
// every factor is at most max_model_len, n or the logprobs bound of the parser, and the product fits
// 64 bits. max_tokens unset counts as the rest of the context.
std::optional<HttpResponse> Generation::check_logprob_volume(const OpenAiRequest& r,
                                                           const std::vector<Request>& bases) const {
  if (r.logprobs < 0 && r.prompt_logprobs < 0) return std::nullopt;
  uint64_t tokens = 0, prompt_tokens = 0;
  for (const Request& b : bases) {
    const auto n_prompt = static_cast<int64_t>(b.prompt.size());
    const int64_t max_tokens = r.max_tokens >= 0 ? r.max_tokens : api_.max_model_len - n_prompt;
    tokens += static_cast<uint64_t>((r.echo ? n_prompt : 0) + max_tokens);
    prompt_tokens += static_cast<uint64_t>(n_prompt);
  }
  const uint64_t entries = r.logprobs < 0 ? 0 : tokens * static_cast<uint64_t>(r.n) * (static_cast<uint64_t>(r.logprobs) + 1);
  if (r.prompt_logprobs >= 0) {
    // Completions repeat them in each of a prompt's n choices; chat lists them once.
    const uint64_t copies = r.is_chat ? 1 : static_cast<uint64_t>(r.n);
    const uint64_t prompt_entries = prompt_tokens * copies * (static_cast<uint64_t>(r.prompt_logprobs) + 1);
    if (prompt_entries + entries > kMaxLogprobEntries)
      return error_json(400,
                        "the request asks for " + std::to_string(prompt_entries + entries) +
                            " logprob entries, more than the " + std::to_string(kMaxLogprobEntries) +
                            " one request may: prompt_logprobs lists (prompt_logprobs + 1) (" +
                            std::to_string(r.prompt_logprobs + 1) + ") entries for each of the " +
                            std::to_string(prompt_tokens) + " prompt tokens" +
                            (r.is_chat ? "" : " in each of n (" + std::to_string(r.n) + ") choices") +
                            (entries > 0 ? ", logprobs " + std::to_string(entries) + " more" : "") +
                            "; lower prompt_logprobs or n, or shorten the prompt",
                        "prompt_logprobs");
  }
  if (entries <= kMaxLogprobEntries) return std::nullopt;
  const std::string lp = r.is_chat ? "top_logprobs" : "logprobs";
  return error_json(400,
                    "the request asks for " + std::to_string(entries) + " logprob entries, more than the " +
                        std::to_string(kMaxLogprobEntries) + " one request may: n (" + std::to_string(r.n) +
                        ") x " + (r.echo ? "(prompt tokens echoed + max_tokens)" : "max_tokens") + " (" +
                        std::to_string(tokens) + " over all prompts) x (" + lp + " + 1) (" +
                        std::to_string(r.logprobs + 1) + "); lower n, max_tokens or " + lp,
                    lp);
}

Prepared Generation::prepare_checked(const std::string& body, RequestApi which) {
  Prepared out;
  if (cancelled_) return out;  // the client is gone: nothing to do
  auto fail = [&](HttpResponse r) {
    out.error = std::move(r);
    return std::move(out);
  };
  RequestJson j;
  try {
    j = parse_request_body(body);
  } catch (const RequestError& e) {
    return fail(error_json(400, e.what(), e.param()));
  }
  if (!j.is_object())
    return fail(error_json(400, std::string("the request body must be a JSON object, got ") + j.type_name()));
  OpenAiRequest r;
  std::vector<Request> bases;
  std::vector<bool> truncated;  // truncate_prompt_tokens cut prompt p
  try {
    r = parse_openai_request(j, which);
    if (!r.model.empty() && r.model != api_.served_model_name)
      return fail(error_json(
          404,
          "The model `" + r.model + "` does not exist; this server serves `" + api_.served_model_name + "`",
          "model", "model_not_found"));
    // Rendered once: the size check below and the tokenizer read the same text.
    if (r.is_chat)
      r.chat_prompt = render_chat_prompt(r, api_.format);
    // A prompt to truncate may be longer than the context (the body size still bounds the work).
    if (r.truncate_prompt_tokens == 0)
      if (auto e = check_prompt_bytes(r)) return fail(std::move(*e));
    const size_t n_prompts = r.is_chat ? 1 : r.prompts.size();
    for (size_t p = 0; p < n_prompts; ++p) {
      if (cancelled_) return out;
      bool cut = false;
      bases.push_back(to_engine_request(r, api_.format, 0, p, &cut));
      truncated.push_back(cut);
    }
  } catch (const RequestError& e) {
    return fail(error_json(400, e.what(), e.param()));
  } catch (const Error& e) {
    return fail(error_json(400, e.what()));
  }
  const std::string prompt_param = r.is_chat ? "messages" : "prompt";
  const int64_t len = api_.max_model_len;
  for (size_t p = 0; p < bases.size(); ++p) {
    // The context holds prompt and output: a prompt that fills it is refused, never truncated.
    const auto n_prompt = static_cast<int64_t>(bases[p].prompt.size());
    const std::string which_prompt = bases.size() > 1 ? "prompt " + std::to_string(p) : "the prompt";
    if (n_prompt >= len)
      return fail(error_json(400,
                             which_prompt + " has " + std::to_string(n_prompt) +
                                 " tokens but the context (max_model_len) is " + std::to_string(len) +
                                 " tokens, which must also hold at least one output token",
                             prompt_param, "context_length_exceeded"));
    // Written as a difference: max_tokens may be as large as 2^63 - 1.
    if (r.max_tokens > 0 && r.max_tokens > len - n_prompt)
      return fail(error_json(400,
                             "max_tokens = " + std::to_string(r.max_tokens) + " plus the " +
                                 std::to_string(n_prompt) + " tokens of " + which_prompt +
                                 " exceed the context of " + std::to_string(len) +
                                 " tokens (max_tokens may be at most " + std::to_string(len - n_prompt) + ")",
                             "max_tokens", "context_length_exceeded"));
    // With no max_tokens the context bounds the output: min_tokens beyond it could never be met.
    if (r.max_tokens < 0 && r.min_tokens > len - n_prompt)
      return fail(error_json(400,
                             "min_tokens = " + std::to_string(r.min_tokens) + " plus the " + std::to_string(n_prompt) +
                                 " tokens of " + which_prompt + " exceed the context of " + std::to_string(len) +
                                 " tokens (min_tokens may be at most " + std::to_string(len - n_prompt) + ")",
                             "min_tokens", "context_length_exceeded"));
    PromptInfo info;
    info.n_prompt = n_prompt;
    // A truncated prompt is echoed as the model saw it: its kept tokens, special tokens included.
    if (r.echo)
      info.echo_text = truncated[p] ? api_.format.tokenizer->decode(bases[p].prompt, /*skip_special=*/false)
                                    : prompt_text(r, *api_.format.tokenizer, p);
    if ((r.echo && r.logprobs >= 0) || r.prompt_logprobs >= 0) info.prompt_ids = bases[p].prompt;
    prompts_.push_back(std::move(info));
  }
  // n choices per prompt: n engine requests on the same prompt; with a seed, choice j of every prompt draws
  // from seed + j (as the same prompt sent alone would). The engine prefills the prompt once: choices 1..n-1
  // fork choice 0's KV blocks when its prompt is computed and sample from its last logits row. Echo with
  // logprobs: only choice 0 computes the prompt's logprobs (every prompt position's logits row) and every
  // choice echoes them.
  // Beam search: one engine request per prompt, whose beams share the prompt's blocks and are the
  // choices. best_of > n: best_of choices (each with its chosen tokens' logprobs), the best n returned.
  if (auto e = check_logprob_volume(r, bases)) return fail(std::move(*e));
  if (auto e = apply_kv_transfer(j, r, bases)) return fail(std::move(*e));
  if (cancelled_) return out;
  beam_ = r.use_beam_search;
  rank_best_of_ = !beam_ && r.best_of > r.n;
  n_return_ = r.n;
  n_ = beam_ ? 1 : rank_best_of_ ? r.best_of : r.n;
  for (size_t p = 0; p < bases.size(); ++p)
    for (int32_t i = 0; i < n_; ++i) {
      Request q = bases[p];
      q.sampling.seed = r.seed ? *r.seed + static_cast<uint64_t>(i) : api_.random_seed();
      if (rank_best_of_) q.logprobs = std::max(q.logprobs, 0);
      if (i > 0) q.prompt_logprobs = -1;
      out.requests.push_back(std::move(q));
    }
  header_ = ResponseHeader{new_response_id(r.is_chat ? "chatcmpl-" : "cmpl-"), std::time(nullptr),
                           api_.served_model_name, which == RequestApi::Chat};
  reported_stop_ids_ = reported_stop_ids(r, api_.format);
  want_logprobs_ = r.logprobs >= 0;
  echo_top_ = r.echo ? r.logprobs : -1;
  prompt_top_ = r.prompt_logprobs;
  echo_scored_ = echo_top_ >= 0 || prompt_top_ >= 0;
  no_generation_ = r.max_tokens == 0;
  include_usage_ = r.stream && r.include_usage;
  streamed_ = r.stream;
  choices_.resize(out.requests.size());
  return out;
}

std::optional<HttpResponse> Generation::apply_kv_transfer(const RequestJson& j, const OpenAiRequest& r,
                                                         std::vector<Request>& bases) {
  std::optional<KvTransferParams> p;
  try {
    p = parse_kv_transfer_params(j);
  } catch (const RequestError& e) {
    return error_json(400, e.what(), e.param());
  }
  if (!p || (!p->do_remote_decode && !p->do_remote_prefill)) return std::nullopt;
  const char* role = p->do_remote_decode ? "do_remote_decode" : "do_remote_prefill";
  const std::string param = std::string("kv_transfer_params.") + role;
  const auto& kv = api_.kv_transfer;
  if (!kv || (p->do_remote_decode ? !kv->produces() : !kv->consumes()))
    return error_json(400,
                      std::string(role) + " needs a server started with --kv-transfer-config kv_role " +
                          (p->do_remote_decode ? "kv_producer" : "kv_consumer") + " (or kv_both)",
                      param);
  if (bases.size() != 1 || r.n != 1 || r.use_beam_search || r.best_of > 1 || r.echo)
    return error_json(400, std::string(role) + " takes one prompt, n 1, no best_of, beam search or echo", param);
  if (p->do_remote_decode) {
    if (r.stream) return error_json(400, "do_remote_decode takes stream false (the answer carries kv_transfer_params)", param);
    bases[0].do_remote_decode = true;
    kv_producer_ = true;
    return std::nullopt;
  }
  std::vector<int32_t> tokens;
  try {
    auto im = std::make_shared<KvImport>(api_.kv_puller->pull(*p, &tokens));
    const std::vector<int32_t>& prompt = bases[0].prompt;
    if (tokens.size() != static_cast<size_t>(im->n_tokens) || tokens.size() > prompt.size() ||
        !std::equal(tokens.begin(), tokens.end(), prompt.begin()))
      return error_json(400, "kv_transfer_params: the producer's K/V are of another prompt (its " +
                                 std::to_string(tokens.size()) + " tokens are not this prompt's first ones)",
                        "kv_transfer_params.remote_request_id");
    bases[0].kv_import = std::move(im);
  } catch (const Error& e) {
    return error_json(502, e.what(), "kv_transfer_params", "kv_transfer_failed", "server_error");
  }
  return std::nullopt;
}

void Generation::start(Prepared p) {
  auto session = session_.lock();
  if (!session || !session->open() || cancelled_) return;
  if (p.error) return respond(*session, std::move(*p.error));
  submit(*session, std::move(p.requests));
}

void Generation::submit(HttpSession& s, std::vector<Request> requests) {
  // The engine thread calls this once there is something to take; the work runs on the strand.
  auto notify = [weak = weak_from_this(), ex = s.executor()] {
    boost::asio::post(ex, [weak] {
      if (auto g = weak.lock()) g->on_notify();
    });
  };
  channel_ = api_.loop.submit(std::move(requests), std::move(notify));
}

// Echo with logprobs: the first output of a prompt's choice 0 brings the prompt's logprobs (or, when it
// failed before its first token, none: the echo then has null logprobs). Returns whether the prompt of o is
// scored now.
bool Generation::note_prompt_logprobs(const ChoiceOutput& o) {
  const auto index = static_cast<size_t>(o.index);
  PromptInfo& p = prompts_[index / static_cast<size_t>(n_)];
  if (!echo_scored_ || p.scored) return true;
  if (index % static_cast<size_t>(n_) != 0) return false;
  p.scored = true;
  const auto& logprobs = o.output.prompt_logprobs;
  api_.metrics.on_prompt_logprobs(static_cast<int64_t>(logprobs.size()));
  if (!p.echo_text.empty() && echo_top_ >= 0) {
    std::vector<LogprobSummary> trimmed;
    if (prompt_top_ > echo_top_) trimmed = with_top(logprobs, echo_top_);
    p.echo_logprobs = echo_logprobs(*api_.format.tokenizer, p.prompt_ids,
                                    prompt_top_ > echo_top_ ? std::span<const LogprobSummary>(trimmed) : logprobs,
                                    p.echo_text, &p.echo_offset);
  }
  if (prompt_top_ >= 0) p.prompt_logprobs = prompt_logprobs_json(*api_.format.tokenizer, p.prompt_ids, logprobs, prompt_top_);
  return true;
}

void Generation::on_notify() {
  auto session = session_.lock();
  if (!session || !session->open() || cancelled_ || done_) return;
  const RequestChannel::State state = channel_->state();
  std::vector<ChoiceOutput> outputs;
  channel_->take_outputs(&outputs);  // arms the next notification
  if (state == RequestChannel::State::Pending) return;
  if (state == RequestChannel::State::Rejected) return respond(*session, error_json(400, channel_->error()));
  if (state == RequestChannel::State::Unavailable)
    return respond(*session, error_json(503, channel_->error(), "", "unavailable", "server_error"));
  if (streamed_) return stream(*session, outputs);
  complete(*session, outputs);
}

void Generation::complete(HttpSession& s, std::vector<ChoiceOutput>& outputs) {
  for (ChoiceOutput& o : outputs) {
    Choice& c = choices_[static_cast<size_t>(o.index)];
    note_prompt_logprobs(o);
    if (!no_generation_) c.text += o.output.text_delta;
    if (want_logprobs_ && !no_generation_) {
      LoggedTokens t = logged_tokens(o.output);
      c.logged.ids.insert(c.logged.ids.end(), t.ids.begin(), t.ids.end());
      c.logged.logprobs.insert(c.logged.logprobs.end(), t.logprobs.begin(), t.logprobs.end());
    }
    if (rank_best_of_ && !no_generation_)
      for (const LogprobSummary& l : o.output.logprobs) c.cumulative_logprob += l.chosen.logprob;
    if (o.output.finished) {
      finish(c, o.output);
      c.beams = std::move(o.output.beams);
      if (kv_producer_ && !o.output.kv_held_blocks.empty()) {
        c.kv_held.do_remote_prefill = true;
        c.kv_held.remote_host = api_.kv_transfer->kv_ip;
        c.kv_held.remote_port = api_.port;
        c.kv_held.remote_engine_id =
            api_.kv_transfer->engine_id.empty() ? "kestrel-" + std::to_string(api_.port) : api_.kv_transfer->engine_id;
        c.kv_held.remote_request_id = api_.kv_transfer_id(o.output.id);
        c.kv_held.remote_block_ids = std::move(o.output.kv_held_blocks);
        c.kv_held.num_computed_tokens = o.output.kv_held_tokens;
      }
    }
  }
  if (n_finished_ < choices_.size()) return;
  if (auto e = failed()) return respond(s, std::move(*e));
  std::vector<FinalChoice> finals = returned_choices();
  HttpResponse r;
  Json response = full_response(header_, finals, usage());
  // vLLM's chat answer carries the prompt's logprobs once, beside the choices.
  if (header_.chat && prompt_top_ >= 0) response["prompt_logprobs"] = prompts_[0].prompt_logprobs;
  // vLLM's producer answer: the consumer's kv_transfer_params (null when nothing is held).
  if (kv_producer_)
    response["kv_transfer_params"] = choices_[0].kv_held.do_remote_prefill ? kv_transfer_params_json(choices_[0].kv_held) : Json();
  r.body = dump(response);
  // A large answer's JSON (logprobs: a tree of small objects, many times the text's size) leaves freed
  // memory that glibc keeps; it is handed back once the tree is gone. The text itself, this large, is
  // its own mapping, unmapped when written.
  const bool large = r.body.size() > kTrimAbove;
  std::vector<FinalChoice>().swap(finals);
  respond(s, std::move(r));
  if (large) malloc_trim(0);
}

std::optional<HttpResponse> Generation::failed() const {
  for (const Choice& c : choices_) {
    if (c.finish_reason == "error" && c.error_from_request)
      return error_json(400, c.error);
    if (c.finish_reason == "error")
      return error_json(500, "generation failed: " + c.error, "", "", "server_error");
    if (c.finish_reason == "abort")
      return error_json(503, "the server is shutting down", "", "unavailable", "server_error");
  }
  return std::nullopt;
}

// The choices of a finished non-streamed response, index order.
std::vector<FinalChoice> Generation::returned_choices() {
  std::vector<FinalChoice> finals;
  if (beam_) {
    for (size_t p = 0; p < choices_.size(); ++p)
      for (size_t k = 0; k < choices_[p].beams.size(); ++k) {
        const BeamHypothesis& h = choices_[p].beams[k];
        FinalChoice f;
        f.index = static_cast<int32_t>(p * static_cast<size_t>(n_return_) + k);
        f.text = prompts_[p].echo_text + h.text;
        f.finish_reason = h.stopped ? "stop" : "length";
        f.cumulative_logprob = h.sum_logprobs;
        finals.push_back(std::move(f));
      }
    return finals;
  }
  // best_of: each prompt's choices ranked by cumulative logprob (stable: earlier choices first on a tie).
  std::vector<size_t> order(choices_.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  const auto per = static_cast<size_t>(n_);
  if (rank_best_of_)
    for (size_t p = 0; p < prompts_.size(); ++p)
      std::stable_sort(order.begin() + static_cast<ptrdiff_t>(p * per), order.begin() + static_cast<ptrdiff_t>((p + 1) * per),
                       [&](size_t a, size_t b) { return choices_[a].cumulative_logprob > choices_[b].cumulative_logprob; });
  for (size_t j = 0; j < order.size(); ++j) {
    if (j % per >= static_cast<size_t>(n_return_)) continue;
    const size_t i = order[j];
    Choice& c = choices_[i];
    const PromptInfo& p = prompt_of(i);
    FinalChoice f;
    f.index = static_cast<int32_t>(i);
    f.text = p.echo_text + c.text;
    if (want_logprobs_ && header_.chat) {
      f.logprobs = chat_logprobs(*api_.format.tokenizer, c.logged);
    } else if (want_logprobs_) {
      if (!p.echo_text.empty()) {
        f.logprobs = p.echo_logprobs;
        c.text_offset = p.echo_offset;
      }
      append_completion_logprobs(f.logprobs, completion_logprobs(*api_.format.tokenizer, c.logged, &c.text_offset));
    }
    if (!header_.chat && prompt_top_ >= 0) f.prompt_logprobs = p.prompt_logprobs;
    f.finish_reason = c.finish_reason;
    f.stop_reason = c.stop_reason;
    if (rank_best_of_) {
      f.index = static_cast<int32_t>(j / per * static_cast<size_t>(n_return_) + j % per);
      f.cumulative_logprob = c.cumulative_logprob;
    }
    finals.push_back(std::move(f));
  }
  return finals;
}

// Beam search, streamed: the prompt's beams when its search ends, each as one chunk of text (the
// echo went out first) with its finish reason and cumulative logprob.
std::string Generation::beam_chunks(ChoiceOutput& co) {
  Choice& c = choices_[static_cast<size_t>(co.index)];
  const RequestOutput& o = co.output;
  if (!o.finished) return "";
  finish(c, o);
  if (o.finish_reason == "error") return sse_event(generation_error(o));
  std::string out;
  for (size_t k = 0; k < o.beams.size(); ++k) {
    const BeamHypothesis& h = o.beams[k];
    ChunkChoice chunk;
    chunk.index = static_cast<int32_t>(static_cast<size_t>(co.index) * static_cast<size_t>(n_return_) + k);
    chunk.cumulative_logprob = h.sum_logprobs;
    chunk.text = h.text;
    if (header_.chat) {
      out += sse_event(stream_chunk(header_, chunk, include_usage_));
      chunk.text.reset();
      chunk.cumulative_logprob.reset();
    }
    chunk.finish_reason = h.stopped ? "stop" : "length";
    out += sse_event(stream_chunk(header_, chunk, include_usage_));
  }
  if (o.finish_reason == "abort")
    for (int32_t k = 0; k < n_return_; ++k) {  // shutdown: every listed choice ends
      ChunkChoice last;
      last.index = co.index * n_return_ + k;
      last.finish_reason = "abort";
      out += sse_event(stream_chunk(header_, last, include_usage_));
    }
  return out;
}

std::string Generation::chunks_for(ChoiceOutput& co) {
  Choice& c = choices_[static_cast<size_t>(co.index)];
  const PromptInfo& p = prompt_of(static_cast<size_t>(co.index));
  const RequestOutput& o = co.output;
  std::string out;
  if (o.finished && o.finish_reason == "error") {
    finish(c, o);
    return sse_event(generation_error(o));
  }
  if (!p.echo_text.empty() && want_logprobs_ && !c.echo_sent) {
    // Echo with logprobs: the prompt goes out with its logprobs, which come with the first token.
    c.echo_sent = true;
    ChunkChoice echo;
    echo.index = co.index;
    echo.text = p.echo_text;
    echo.logprobs = p.echo_logprobs;
    c.text_offset = p.echo_offset;
    out += sse_event(stream_chunk(header_, echo, include_usage_));
  }
  ChunkChoice chunk;
  chunk.index = co.index;
  if (no_generation_) {  // only the end: the echo went out before
    if (!o.finished) return out;
    finish(c, o);
    chunk.text = "";
    chunk.finish_reason = c.finish_reason;
    chunk.stop_reason = c.stop_reason;
    return out + sse_event(stream_chunk(header_, chunk, include_usage_));
  }
  if (want_logprobs_) {
    const LoggedTokens t = logged_tokens(o);
    if (!t.ids.empty())
      chunk.logprobs = header_.chat ? chat_logprobs(*api_.format.tokenizer, t)
                                    : completion_logprobs(*api_.format.tokenizer, t, &c.text_offset);
  }
  const bool has_news = !o.text_delta.empty() || !chunk.logprobs.is_null();
  if (o.finished) finish(c, o);
  if (header_.chat) {
    if (has_news) {
      chunk.text = o.text_delta;
      out += sse_event(stream_chunk(header_, chunk, include_usage_));
    }
    if (o.finished) {
      ChunkChoice last;
      last.index = co.index;
      last.finish_reason = o.finish_reason;
      last.stop_reason = c.stop_reason;
      out += sse_event(stream_chunk(header_, last, include_usage_));
    }
  } else if (has_news || o.finished) {
    chunk.text = o.text_delta;
    if (o.finished) {
      chunk.finish_reason = o.finish_reason;
      chunk.stop_reason = c.stop_reason;
    }
    out += sse_event(stream_chunk(header_, chunk, include_usage_));
  }
  return out;
}

void Generation::stream(HttpSession& s, std::vector<ChoiceOutput>& outputs) {
  std::string buf;
  if (!started_) {
    started_ = true;
    HttpResponse head;
    head.content_type = "text/event-stream";
    head.headers = {{"Cache-Control", "no-cache"}, {"X-Accel-Buffering", "no"}};
    s.start_stream(std::move(head));
    for (size_t i = 0; i < n_listed(); ++i) {
      ChunkChoice first;
      first.index = static_cast<int32_t>(i);
      const PromptInfo& p = prompts_[i / static_cast<size_t>(n_return_)];
      if (header_.chat) {
        first.role = true;
        first.text = "";
      } else if (!p.echo_text.empty() && !want_logprobs_) {  // with logprobs: see chunks_for
        first.text = p.echo_text;
      } else {
        continue;
      }
      buf += sse_event(stream_chunk(header_, first, include_usage_));
    }
  }
  for (ChoiceOutput& o : outputs) {
    if (beam_) {
      buf += beam_chunks(o);
      continue;
    }
    const size_t first = static_cast<size_t>(o.index) / static_cast<size_t>(n_) * static_cast<size_t>(n_);
    const bool was_scored = prompts_[first / static_cast<size_t>(n_)].scored;
    if (!note_prompt_logprobs(o)) {  // the echo of this choice waits for the prompt's logprobs
      choices_[static_cast<size_t>(o.index)].held.push_back(std::move(o));
      continue;
    }
    buf += chunks_for(o);
    // The prompt's logprobs just came: the choices that waited for them go on.
    if (echo_scored_ && !was_scored)
      for (size_t i = first + 1; i < first + static_cast<size_t>(n_); ++i) {
        std::vector<ChoiceOutput> held;
        held.swap(choices_[i].held);
        for (ChoiceOutput& h : held) buf += chunks_for(h);
      }
  }
  const bool all_finished = n_finished_ == choices_.size();
  if (all_finished) {
    if (include_usage_) buf += sse_event(usage_chunk(header_, usage()));
    buf += kSseDone;
  }
  s.write_chunk(std::move(buf));
  if (all_finished) {
    done_ = true;
    s.end_stream();
  }
}

}  // namespace

void start_generation(ApiState& api, const std::shared_ptr<HttpSession>& session, std::string body,
                      RequestApi which) {
  auto g = std::make_shared<Generation>(api, session);
  session->attach(g);  // a client that leaves while the request is prepared skips the work
  WorkPool::of(session->executor())
      .run(
          WorkLane::Generation, session->executor(), g->cancel_flag(),
          [g, body = std::move(body), which]() mutable {
            Prepared p = g->prepare(body, which);
            if (body.size() > kTrimAbove) {
              std::string().swap(body);
              malloc_trim(0);
            }
            return p;
          },
          [g](Prepared p) { g->start(std::move(p)); });
}

}  // namespace kestrel::cli
