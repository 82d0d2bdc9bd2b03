#include "chat_prompt.h"

#include <vector>

#include "template/chat_render.h"

namespace kestrel::cli {

std::string render_chat(const PromptFormat& format, const Json& messages, bool add_generation_prompt,
                        const Json& tools, const Json& template_kwargs) {
  if (!format.template_error.empty())
    throw RequestError("messages", "the model's chat template does not parse: " + format.template_error);
  if (format.jinja_template) {
    ChatTemplateInputs in;
    in.messages = messages;
    in.tools = tools;
    in.add_generation_prompt = add_generation_prompt;
    in.bos_token = format.bos_token;
    in.eos_token = format.eos_token;
    if (template_kwargs.is_object()) in.extra = template_kwargs;
    try {
      return render_chat_template(*format.jinja_template, in);
    } catch (const Error& e) {  // jinja::TemplateError: raise_exception's message, a runtime error, a limit
      throw RequestError("messages", std::string("chat template: ") + e.what());
    }
  }
  std::vector<ChatMessage> conversation;
  conversation.reserve(messages.size());
  for (const Json& m : messages) conversation.push_back({m.at("role").get<std::string>(), m.at("content").get<std::string>()});
  return format.chat_template.apply(conversation, add_generation_prompt);
}

}  // namespace kestrel::cli
