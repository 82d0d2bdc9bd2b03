// Chat prompt formatting for the CLI's chat command.
//
// This is not a Jinja engine (that comes with the HTTP server): it recognises the common template
// families from the model's tokenizer.chat_template text and formats messages the way those
// templates do. ChatML (<|im_start|>role\n...<|im_end|>\n, used by SmolLM2 and Qwen2), Llama 3
// (<|start_header_id|>role<|end_header_id|>\n\n...<|eot_id|>), Llama 2 ([INST] ... [/INST]) and
// Gemma (<start_of_turn>role\n...<end_of_turn>\n, the assistant's role called "model", the system
// text opening the first user turn).
#pragma once

#include <string>
#include <vector>

namespace kestrel {

struct ChatMessage {
  std::string role;     // "system", "user" or "assistant"
  std::string content;
};

class ChatTemplate {
 public:
  enum class Kind { ChatML, Llama3, Llama2, Gemma, Plain };

  // Picks the family from the template source. An empty source (a GGUF without
  // tokenizer.chat_template) picks by the vocabulary, which the caller describes: ChatML when it
  // has <|im_start|>, else Gemma when it has <start_of_turn>, else Plain. A ChatML template that
  // inserts a default system message when the conversation has none (as SmolLM2's does) keeps
  // that message.
  static ChatTemplate detect(const std::string& source, bool has_im_start, bool has_start_of_turn = false);

  // The prompt text for the conversation; with add_generation_prompt it ends with the header of
  // the assistant's turn. Special tokens appear as text: encode with parse_special.
  std::string apply(const std::vector<ChatMessage>& messages, bool add_generation_prompt) const;

  Kind kind() const { return kind_; }
  const char* kind_name() const;
  const std::string& default_system() const { return default_system_; }
  // Text that ends an assistant turn in this format (used as a stop string), or "".
  std::string end_of_turn() const;

 private:
  Kind kind_ = Kind::Plain;
  std::string default_system_;
};

}  // namespace kestrel
