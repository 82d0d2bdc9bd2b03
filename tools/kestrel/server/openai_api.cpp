#include "server/openai_api.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "tokenizer/utf8.h"

namespace kestrel::cli {

namespace {
Json null_or(const std::string& s) { return s.empty() ? Json(nullptr) : Json(s); }

// Characters (code points) the bytes add to a text: continuation bytes do not start one, so a
// character split over two tokens is counted once.
int64_t n_chars(std::string_view bytes) {
  int64_t n = 0;
  for (char c : bytes) n += (static_cast<unsigned char>(c) & 0xC0) != 0x80;
  return n;
}

Json byte_list(std::string_view bytes) {
  Json b = Json::array();
  for (char c : bytes) b.push_back(static_cast<int>(static_cast<unsigned char>(c)));
  return b;
}

// A logprob as JSON: -inf (a token a mask or a bias rules out) as -9999.0, as vLLM writes it;
// JSON has no infinity (the library would write null, which OpenAI's schema does not allow).
float logprob_value(float x) { return std::isinf(x) && x < 0 ? -9999.0f : x; }

Json chat_entry(const Tokenizer& tok, const TokenLogprob& t) {
  const std::string piece = tok.token_to_piece(t.token);
  return Json{{"token", utf8_sanitize(piece)}, {"logprob", logprob_value(t.logprob)}, {"bytes", byte_list(piece)}};
}
}  // namespace

Json error_body(const std::string& message, const std::string& type, const std::string& param,
                const std::string& code) {
  return Json{{"error", {{"message", message}, {"type", type}, {"param", null_or(param)}, {"code", null_or(code)}}}};
}

std::string new_response_id(const char* prefix) {
  thread_local std::mt19937_64 rng(std::random_device{}());
  static const char* const kHex = "0123456789abcdef";
  std::string id = prefix;
  for (int i = 0; i < 24; ++i) id += kHex[rng() & 15];
  return id;
}

LoggedTokens logged_tokens(const RequestOutput& o) {
  LoggedTokens t;
  // Tokens without a logprob: the request did not ask for them.
  const size_t n = std::min(o.new_token_ids.size(), o.logprobs.size());
  t.ids.assign(o.new_token_ids.begin(), o.new_token_ids.begin() + static_cast<ptrdiff_t>(n));
  t.logprobs.assign(o.logprobs.begin(), o.logprobs.begin() + static_cast<ptrdiff_t>(n));
  return t;
}

namespace {
// OpenAI's legacy format: the top alternatives and the chosen token, by their text.
Json top_by_text(const Tokenizer& tok, const LogprobSummary& s) {
  Json alts = Json::object();
  for (const TokenLogprob& a : s.top) alts[utf8_sanitize(tok.token_to_piece(a.token))] = logprob_value(a.logprob);
  const std::string chosen = utf8_sanitize(tok.token_to_piece(s.chosen.token));
  if (!alts.contains(chosen)) alts[chosen] = logprob_value(s.chosen.logprob);
  return alts;
}
}  // namespace

Json completion_logprobs(const Tokenizer& tok, const LoggedTokens& t, int64_t* text_offset) {
  Json tokens = Json::array(), token_logprobs = Json::array(), top = Json::array(), offsets = Json::array();
  for (size_t i = 0; i < t.ids.size(); ++i) {
    const LogprobSummary& s = t.logprobs[i];
    const std::string piece = tok.token_to_piece(t.ids[i]);
    tokens.push_back(utf8_sanitize(piece));
    token_logprobs.push_back(logprob_value(s.chosen.logprob));
    top.push_back(top_by_text(tok, s));
    offsets.push_back(*text_offset);
    if (!tok.is_special(t.ids[i])) *text_offset += n_chars(piece);
  }
  return Json{{"tokens", tokens}, {"token_logprobs", token_logprobs}, {"top_logprobs", top}, {"text_offset", offsets}};
}

namespace {
// A token's text where a sequence's decoding meets it: at the start (at_start), SentencePiece
// drops the leading space the tokenizer put before the first word, which the text never had.
std::string decoded_piece(const Tokenizer& tok, int32_t id, bool at_start) {
  if (!at_start) return tok.token_to_piece(id);
  std::string bytes;
  tok.append_piece(id, /*skip_special=*/false, &at_start, &bytes);
  return bytes;
}

// top_by_text for a prompt position: the alternatives as decoded there (decoded_piece); of two
// alternatives with the same text (" Once" and "Once" at the start) the likelier is kept.
Json top_by_decoded_text(const Tokenizer& tok, const LogprobSummary& s, bool at_start) {
  Json alts = Json::object();
  for (const TokenLogprob& a : s.top) {
    const std::string text = utf8_sanitize(decoded_piece(tok, a.token, at_start));
    const float lp = logprob_value(a.logprob);
    if (!alts.contains(text) || alts[text].get<float>() < lp) alts[text] = lp;
  }
  const std::string chosen = utf8_sanitize(decoded_piece(tok, s.chosen.token, at_start));
  if (!alts.contains(chosen)) alts[chosen] = logprob_value(s.chosen.logprob);
  return alts;
}
}  // namespace

Json echo_logprobs(const Tokenizer& tok, std::span<const int32_t> prompt, std::span<const LogprobSummary> prompt_logprobs,
                   std::string_view echo_text, int64_t* text_offset) {
  Json tokens = Json::array(), token_logprobs = Json::array(), top = Json::array(), offsets = Json::array();
  // Walks echo_text with the bytes each token decodes to (Tokenizer::append_piece, special tokens
  // as their text and the SentencePiece leading-space rule), so offsets follow the text returned.
  size_t pos = 0;  // bytes of echo_text covered
  bool at_start = true;
  std::string bytes;
  for (size_t i = 0; i < prompt.size(); ++i) {
    // Listed as decoded here, so the first word's token is "Once", the text it covers, not " Once".
    tokens.push_back(utf8_sanitize(decoded_piece(tok, prompt[i], at_start)));
    const bool scored = i > 0 && i - 1 < prompt_logprobs.size();
    token_logprobs.push_back(scored ? Json(logprob_value(prompt_logprobs[i - 1].chosen.logprob)) : Json(nullptr));
    top.push_back(scored ? top_by_decoded_text(tok, prompt_logprobs[i - 1], at_start) : Json(nullptr));
    offsets.push_back(*text_offset);
    bytes.clear();
    tok.append_piece(prompt[i], /*skip_special=*/false, &at_start, &bytes);
    const std::string_view rest = echo_text.substr(pos);
    size_t take = 0;
    if (rest.substr(0, bytes.size()) == bytes)
      take = bytes.size();
    else if (!bytes.empty() && bytes[0] == ' ' &&
             rest.substr(0, bytes.size() - 1) == std::string_view(bytes).substr(1))
      take = bytes.size() - 1;  // SentencePiece's dummy-prefix space, which each stretch of text gets
    else if (!tok.is_special(prompt[i]))  // text the tokenizer normalised: keep pace with it
      take = std::min(bytes.size(), rest.size());
    *text_offset += n_chars(echo_text.substr(pos, take));
    pos += take;
  }
  return Json{{"tokens", tokens}, {"token_logprobs", token_logprobs}, {"top_logprobs", top}, {"text_offset", offsets}};
}

Json prompt_logprobs_json(const Tokenizer& tok, std::span<const int32_t> prompt,
                          std::span<const LogprobSummary> prompt_logprobs, int32_t n_top) {
  Json out = Json::array();
  auto entry = [&](int32_t token, float logprob, int64_t rank) {
    return Json{{"logprob", logprob_value(logprob)}, {"rank", rank},
                {"decoded_token", utf8_sanitize(tok.token_to_piece(token))}};
  };
  for (size_t i = 0; i < prompt.size(); ++i) {
    if (i == 0 || i - 1 >= prompt_logprobs.size()) {
      out.push_back(nullptr);
      continue;
    }
    const LogprobSummary& s = prompt_logprobs[i - 1];
    Json position = Json::object();
    position[std::to_string(s.chosen.token)] = entry(s.chosen.token, s.chosen.logprob, s.chosen_rank);
    const size_t n = std::min(s.top.size(), static_cast<size_t>(std::max(n_top, 0)));
    for (size_t k = 0; k < n; ++k) {
      const std::string key = std::to_string(s.top[k].token);
      if (!position.contains(key)) position[key] = entry(s.top[k].token, s.top[k].logprob, static_cast<int64_t>(k) + 1);
    }
    out.push_back(std::move(position));
  }
  return out;
}

void append_completion_logprobs(Json& into, const Json& more) {
  if (into.is_null()) {
    into = more;
    return;
  }
  for (const char* key : {"tokens", "token_logprobs", "top_logprobs", "text_offset"})
    for (const Json& v : more.at(key)) into[key].push_back(v);
}

Json chat_logprobs(const Tokenizer& tok, const LoggedTokens& t) {
  Json content = Json::array();
  for (size_t i = 0; i < t.ids.size(); ++i) {
    const LogprobSummary& s = t.logprobs[i];
    Json entry = chat_entry(tok, s.chosen);
    Json top = Json::array();
    for (const TokenLogprob& a : s.top) top.push_back(chat_entry(tok, a));
    entry["top_logprobs"] = std::move(top);
    content.push_back(std::move(entry));
  }
  return Json{{"content", content}};
}

Json usage_json(int64_t prompt_tokens, int64_t completion_tokens) {
  return Json{{"prompt_tokens", prompt_tokens},
              {"completion_tokens", completion_tokens},
              {"total_tokens", prompt_tokens + completion_tokens}};
}

Json stream_chunk(const ResponseHeader& h, const ChunkChoice& c, bool with_usage_null) {
  Json choice;
  choice["index"] = c.index;
  if (h.chat) {
    Json delta = Json::object();
    if (c.role) delta["role"] = "assistant";
    if (c.text) delta["content"] = *c.text;
    choice["delta"] = std::move(delta);
  } else {
    choice["text"] = c.text.value_or("");
  }
  choice["logprobs"] = c.logprobs;
  choice["finish_reason"] = c.finish_reason ? Json(*c.finish_reason) : Json(nullptr);
  if (c.finish_reason) choice["stop_reason"] = c.stop_reason;
  if (c.cumulative_logprob) choice["cumulative_logprob"] = *c.cumulative_logprob;
  Json j{{"id", h.id},
         {"object", h.chat ? "chat.completion.chunk" : "text_completion"},
         {"created", h.created},
         {"model", h.model},
         {"choices", Json::array({std::move(choice)})}};
  if (with_usage_null) j["usage"] = nullptr;
  return j;
}

Json usage_chunk(const ResponseHeader& h, const Json& usage) {
  return Json{{"id", h.id},
              {"object", h.chat ? "chat.completion.chunk" : "text_completion"},
              {"created", h.created},
              {"model", h.model},
              {"choices", Json::array()},
              {"usage", usage}};
}

Json full_response(const ResponseHeader& h, const std::vector<FinalChoice>& choices, const Json& usage) {
  Json list = Json::array();
  for (const FinalChoice& c : choices) {
    Json choice;
    choice["index"] = c.index;
    if (h.chat)
      choice["message"] = Json{{"role", "assistant"}, {"content", c.text}};
    else
      choice["text"] = c.text;
    choice["logprobs"] = c.logprobs;
    choice["finish_reason"] = c.finish_reason;
    choice["stop_reason"] = c.stop_reason;
    if (c.cumulative_logprob) choice["cumulative_logprob"] = *c.cumulative_logprob;
    if (!c.prompt_logprobs.is_null()) choice["prompt_logprobs"] = c.prompt_logprobs;
    list.push_back(std::move(choice));
  }
  return Json{{"id", h.id},
              {"object", h.chat ? "chat.completion" : "text_completion"},
              {"created", h.created},
              {"model", h.model},
              {"choices", std::move(list)},
              {"usage", usage}};
}

std::string dump(const Json& j) { return j.dump(-1, ' ', false, Json::error_handler_t::replace); }

std::string sse_event(const Json& j) { return "data: " + dump(j) + "\n\n"; }

}  // namespace kestrel::cli
