// The one place where chat messages become prompt text, for `kestrel batch` and `kestrel serve`.
//
// Today it formats with ChatTemplate (tokenizer/chat_template.h: the ChatML, Llama 3 and Llama 2
// families recognised from the template text). The real Jinja engine (src/template/jinja.h) swaps in
// here alone: parse format.template_source once (e.g. a shared_ptr<jinja::Template> built in
// PromptFormat::for_model), render it with {messages, add_generation_prompt, bos_token, eos_token},
// and turn jinja::TemplateError into RequestError("messages", its message) so the server answers
// 400 with the template's message.
#pragma once

#include <string>

#include "openai_request.h"

namespace kestrel::cli {

// messages: a validated array of {"role", "content": string} objects (OpenAiRequest::messages_json).
// With add_generation_prompt the text ends with the header of the assistant's turn. Special tokens
// appear as text: encode with parse_special. Throws RequestError (param "messages") when the
// template cannot format the conversation.
std::string render_chat(const PromptFormat& format, const Json& messages, bool add_generation_prompt);

}  // namespace kestrel::cli
