#include "chat_render.h"

#include <vector>

namespace kestrel::cli {

std::string render_chat(const PromptFormat& format, const Json& messages, bool add_generation_prompt) {
  std::vector<ChatMessage> conversation;
  conversation.reserve(messages.size());
  for (const Json& m : messages) conversation.push_back({m.at("role").get<std::string>(), m.at("content").get<std::string>()});
  try {
    return format.chat_template.apply(conversation, add_generation_prompt);
  } catch (const Error& e) {
    throw RequestError("messages", std::string("chat template: ") + e.what());
  }
}

}  // namespace kestrel::cli
