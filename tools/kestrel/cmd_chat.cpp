// kestrel chat: a conversation with the model's chat template. Interactive on a terminal; with
// piped input every line is one user message; with -p one message and exit. The prompt is rendered
// as `kestrel batch` and `kestrel serve` render chat messages (render_chat: the model's own Jinja
// template, else ChatTemplate's format), so the same conversation gives the same tokens everywhere.
#include <unistd.h>

#include <cstdio>
#include <iostream>

#include "chat_prompt.h"
#include "common.h"
#include "core/error.h"
#include "openai_request.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/stream_decoder.h"

namespace kestrel::cli {

namespace {
struct ChatArgs {
  std::string model;
  std::string prompt;
  std::string system;
  int64_t n_predict = -1;
  bool stats = false;
  SamplingFlags sampling;
  KestrelConfig config;
};

// Answers the conversation's last user message, streaming the reply to stdout. The engine's
// prefix cache holds the KV of the turns before (their full blocks), so a turn computes little
// more than its new tokens.
std::string answer(Engine& engine, const Tokenizer& tok, const PromptFormat& format,
                   const std::vector<ChatMessage>& messages, const Request& settings, bool stats) {
  Json conversation = Json::array();
  for (const ChatMessage& m : messages) conversation.push_back({{"role", m.role}, {"content", m.content}});
  std::string prompt;
  try {
    prompt = render_chat(format, conversation, /*add_generation_prompt=*/true);
  } catch (const RequestError& e) {  // the template's own error (raise_exception, a bad template)
    throw Error(e.what());
  }
  Request req = settings;
  // A template that writes the BOS text itself (Gemma, Llama 2 and 3) must not get a second one.
  req.prompt = tok.encode(prompt, /*add_special=*/!format.starts_with_bos(prompt), /*parse_special=*/true);
  StreamDecoder stream(tok);
  std::vector<int32_t> reply;
  const SingleResult res = run_single(engine, std::move(req), [&](const RequestOutput& o) {
    for (int32_t id : o.new_token_ids) {
      if (tok.is_eog(id)) continue;
      reply.push_back(id);
      const std::string piece = stream.push(id);
      std::fwrite(piece.data(), 1, piece.size(), stdout);
    }
    std::fflush(stdout);
  });
  const std::string tail = stream.flush();
  std::fwrite(tail.data(), 1, tail.size(), stdout);
  std::fputc('\n', stdout);
  std::fflush(stdout);
  if (stats)
    std::fprintf(stderr, "[prompt %lld new tokens, %.1f tok/s; %lld generated, %.1f tok/s]\n",
                 static_cast<long long>(res.metrics.n_prompt_tokens - res.metrics.n_cached_prompt_tokens),
                 res.prefill_tok_per_s(), static_cast<long long>(res.metrics.n_output_tokens), res.decode_tok_per_s());
  return tok.decode(reply);
}

void run_chat(const ChatArgs& a) {
  if (a.n_predict < -1 || a.n_predict == 0)
    throw Error("-n must be >= 1, or -1 for no limit, got " + std::to_string(a.n_predict));
  Request settings;
  settings.sampling = a.sampling.params();
  settings.max_tokens = a.n_predict;
  LoadedModel lm = load_model(a.model, a.config, /*quiet=*/!a.stats);
  const Tokenizer& tok = require_tokenizer(lm, "chat");
  const PromptFormat format = PromptFormat::for_model(*lm.model, tok);
  settings.stop_ids = format.stop_ids;
  if (format.end_of_turn_id) settings.stop_ids.push_back(*format.end_of_turn_id);
  std::unique_ptr<Engine> engine = make_engine(lm, a.config);
  std::vector<ChatMessage> messages;
  if (!a.system.empty()) messages.push_back({"system", a.system});

  if (!a.prompt.empty()) {
    messages.push_back({"user", a.prompt});
    answer(*engine, tok, format, messages, settings, a.stats);
    return;
  }
  const bool tty = ::isatty(STDIN_FILENO) != 0;
  if (tty)
    std::fprintf(stderr, "kestrel chat (%s). Ctrl-D or /exit to quit, /reset to start over.\n",
                 format.jinja_template ? "the model's chat template"
                                       : (std::string(format.chat_template.kind_name()) + " format").c_str());
  std::string line;
  for (;;) {
    if (tty) std::fputs("> ", stderr);
    if (!std::getline(std::cin, line)) break;
    if (line == "/exit" || line == "/quit") break;
    if (line == "/reset") {
      messages.resize(a.system.empty() ? 0 : 1);
      continue;
    }
    if (line.empty()) continue;
    messages.push_back({"user", line});
    try {
      messages.push_back({"assistant", answer(*engine, tok, format, messages, settings, a.stats)});
    } catch (const Error& e) {
      if (!tty) throw;  // piped input: report once (main) and exit non-zero
      // Interactive: the turn that does not fit is dropped and the conversation goes on.
      std::fprintf(stderr, "kestrel: error: %s (type /reset to start a new conversation)\n", e.what());
      messages.pop_back();
    }
  }
}
}  // namespace

void register_chat(CLI::App& app) {
  auto a = std::make_shared<ChatArgs>();
  CLI::App* sub = app.add_subcommand("chat", "Chat with the model (interactive, or one message with -p)");
  sub->add_option("-m,--model", a->model, kModelHelp);
  sub->add_option("-p,--prompt", a->prompt, "One user message: answer it and exit")
      ->check([](const std::string& s) { return s.empty() ? std::string("an empty message") : std::string(); });
  sub->add_option("--system", a->system, "System message");
  sub->add_option("-n,--n-predict", a->n_predict, "Tokens per answer at most (-1: until the turn ends)")
      ->capture_default_str();
  sub->add_flag("--stats", a->stats, "Print load and speed figures to stderr");
  a->sampling.add_to(*sub);
  a->config.add_flags(*sub, EngineMode::Single);
  a->config.add_prefill_chunk_flag(*sub);
  sub->callback([a] { run_chat(*a); });
}

}  // namespace kestrel::cli
