#include "tokenizer/chat_template.h"

namespace kestrel {

namespace {
bool contains(const std::string& s, const char* needle) { return s.find(needle) != std::string::npos; }

// Without leading and trailing whitespace (Python's str.strip() on ASCII whitespace).
std::string trim(const std::string& s) {
  const char* ws = " \t\n\r\f\v";
  const size_t b = s.find_first_not_of(ws);
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(ws) - b + 1);
}

// SmolLM2-style templates write the default system turn as one string literal:
// '<|im_start|>system\n<text><|im_end|>\n'. Take <text> when the literal is plain text.
std::string chatml_default_system(const std::string& src) {
  const std::string open = "<|im_start|>system\n";
  const size_t at = src.find(open);
  if (at == std::string::npos || at == 0 || (src[at - 1] != '\'' && src[at - 1] != '"')) return "";
  const size_t begin = at + open.size();
  const size_t end = src.find("<|im_end|>", begin);
  if (end == std::string::npos) return "";
  std::string text = src.substr(begin, end - begin);
  for (char c : text)
    if (c == '\'' || c == '"' || c == '{' || c == '}' || c == '+') return "";
  return text;
}
}  // namespace

ChatTemplate ChatTemplate::detect(const std::string& source, bool has_im_start, bool has_start_of_turn) {
  ChatTemplate t;
  if (contains(source, "<|im_start|>") || (source.empty() && has_im_start)) {
    t.kind_ = Kind::ChatML;
    t.default_system_ = chatml_default_system(source);
  } else if (contains(source, "<|start_header_id|>")) {
    t.kind_ = Kind::Llama3;
  } else if (contains(source, "[INST]")) {
    t.kind_ = Kind::Llama2;
  } else if (contains(source, "<start_of_turn>") || (source.empty() && has_start_of_turn)) {
    t.kind_ = Kind::Gemma;
  }
  return t;
}

const char* ChatTemplate::kind_name() const {
  switch (kind_) {
    case Kind::ChatML: return "chatml";
    case Kind::Llama3: return "llama3";
    case Kind::Llama2: return "llama2";
    case Kind::Gemma: return "gemma";
    default: return "plain";
  }
}

std::string ChatTemplate::end_of_turn() const {
  switch (kind_) {
    case Kind::ChatML: return "<|im_end|>";
    case Kind::Llama3: return "<|eot_id|>";
    case Kind::Llama2: return "</s>";
    case Kind::Gemma: return "<end_of_turn>";
    default: return "";
  }
}

std::string ChatTemplate::apply(const std::vector<ChatMessage>& messages,
                                bool add_generation_prompt) const {
  std::string out;
  const bool has_system = !messages.empty() && messages.front().role == "system";
  switch (kind_) {
    case Kind::ChatML:
      if (!has_system && !default_system_.empty())
        out += "<|im_start|>system\n" + default_system_ + "<|im_end|>\n";
      for (const auto& m : messages) out += "<|im_start|>" + m.role + "\n" + m.content + "<|im_end|>\n";
      if (add_generation_prompt) out += "<|im_start|>assistant\n";
      break;
    case Kind::Llama3:
      out += "<|begin_of_text|>";
      for (const auto& m : messages)
        out += "<|start_header_id|>" + m.role + "<|end_header_id|>\n\n" + m.content + "<|eot_id|>";
      if (add_generation_prompt) out += "<|start_header_id|>assistant<|end_header_id|>\n\n";
      break;
    case Kind::Llama2: {
      // <s>[INST] <<SYS>>\nsys\n<</SYS>>\n\nuser [/INST] answer </s><s>[INST] user [/INST]
      std::string system;
      for (const auto& m : messages) {
        if (m.role == "system") {
          system = m.content;
        } else if (m.role == "user") {
          out += "<s>[INST] ";
          if (!system.empty()) out += "<<SYS>>\n" + system + "\n<</SYS>>\n\n";
          system.clear();
          out += m.content + " [/INST]";
        } else {
          out += " " + m.content + " </s>";
        }
      }
      break;
    }
    case Kind::Gemma: {
      // The system text has no turn of its own: it opens the first turn, then a blank line. Texts
      // are trimmed, as Gemma's templates do.
      std::string opening;
      bool first = true;
      for (const auto& m : messages) {
        if (m.role == "system" && first && opening.empty()) {
          opening = trim(m.content) + "\n\n";
          continue;
        }
        out += "<start_of_turn>" + (m.role == "assistant" ? std::string("model") : m.role) + "\n";
        if (first) out += opening;
        first = false;
        out += trim(m.content) + "<end_of_turn>\n";
      }
      if (add_generation_prompt) out += "<start_of_turn>model\n";
      break;
    }
    case Kind::Plain:
      for (const auto& m : messages) out += m.role + ": " + m.content + "\n";
      if (add_generation_prompt) out += "assistant:";
      break;
  }
  return out;
}

}  // namespace kestrel
