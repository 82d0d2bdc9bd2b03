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
  EngineFlags engine;
};

// Answers the conversation's last user message, streaming the reply to stdout.
std::string answer(Session& session, const Tokenizer& tok, const PromptFormat& format,
                   const std::vector<ChatMessage>& messages, const GenerateOptions& go, bool stats) {
  Json conversation = Json::array();
  for (const ChatMessage& m : messages) conversation.push_back({{"role", m.role}, {"content", m.content}});
  std::string prompt;
  try {
    prompt = render_chat(format, conversation, /*add_generation_prompt=*/true);
  } catch (const RequestError& e) {  // the template's own error (raise_exception, a bad template)
    throw Error(e.what());
  }
  const std::vector<int32_t> ids = tok.encode(prompt, /*add_special=*/true, /*parse_special=*/true);
  // Reuse the KV of the longest common prefix with what the session already holds.
  const auto& have = session.tokens();
  size_t common = 0;
  while (common < have.size() && common < ids.size() && have[common] == ids[common]) ++common;
  if (common == ids.size() && common > 0) --common;  // keep one token to produce logits from
  session.truncate(static_cast<int64_t>(common));
  StreamDecoder stream(tok);
  std::vector<int32_t> reply;
  const GenerateStats st = session.generate(
      std::span<const int32_t>(ids).subspan(common), go, [&](int32_t id) {
        if (tok.is_eog(id)) return true;
        reply.push_back(id);
        const std::string piece = stream.push(id);
        std::fwrite(piece.data(), 1, piece.size(), stdout);
        std::fflush(stdout);
        return true;
      });
  const std::string tail = stream.flush();
  std::fwrite(tail.data(), 1, tail.size(), stdout);
  std::fputc('\n', stdout);
  std::fflush(stdout);
  if (stats)
    std::fprintf(stderr, "[prompt %lld new tokens, %.1f tok/s; %lld generated, %.1f tok/s]\n",
                 static_cast<long long>(st.n_prompt), st.prefill_tok_per_s(),
                 static_cast<long long>(st.n_generated), st.decode_tok_per_s());
  return tok.decode(reply);
}

void run_chat(const ChatArgs& a) {
  if (a.n_predict < -1) throw Error("-n must be >= 0, or -1 for no limit, got " + std::to_string(a.n_predict));
  GenerateOptions go;
  go.sampling = a.sampling.params();
  go.max_tokens = a.n_predict;
  const SessionOptions so = a.engine.session_options();
  LoadedModel lm = load_model(a.model, /*quiet=*/!a.stats);
  const Tokenizer& tok = *lm.tokenizer;
  const PromptFormat format = PromptFormat::for_model(*lm.model, tok);
  go.stop_ids = format.stop_ids;
  if (format.end_of_turn_id) go.stop_ids.push_back(*format.end_of_turn_id);
  Session session(*lm.model, so, a.engine.session_runner(*lm.model, so));
  std::vector<ChatMessage> messages;
  if (!a.system.empty()) messages.push_back({"system", a.system});

  if (!a.prompt.empty()) {
    messages.push_back({"user", a.prompt});
    answer(session, tok, format, messages, go, a.stats);
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
      session.reset();
      continue;
    }
    if (line.empty()) continue;
    messages.push_back({"user", line});
    try {
      messages.push_back({"assistant", answer(session, tok, format, messages, go, a.stats)});
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
  a->engine.add_to(*sub);
  a->engine.add_prefill_chunk(*sub);
  sub->callback([a] { run_chat(*a); });
}

}  // namespace kestrel::cli
