// The one place where chat messages become prompt text, for `kestrel batch` and `kestrel serve`:
// the model's own Jinja chat template (src/template, rendered as transformers' apply_chat_template
// does), or, for a model without one, ChatTemplate's format (ChatML when the vocabulary has
// <|im_start|>, else plain "role: content" lines).
#pragma once

#include <string>

#include "openai_request.h"

namespace kestrel::cli {

// messages: a validated array of {"role", "content": string, ...} objects
// (OpenAiRequest::messages_json); tools: the template's `tools` (null: None); template_kwargs: an
// object of more template variables, overriding the others (null: none). A model without a
// Jinja template gets role and content only. With add_generation_prompt the text ends with the header of the assistant's turn. Special tokens
// appear as text: encode with parse_special. Throws RequestError (param "messages") with the
// template's message when it does not parse, fails, or calls raise_exception (the server answers
// 400 with it).
std::string render_chat(const PromptFormat& format, const Json& messages, bool add_generation_prompt,
                        const Json& tools = Json(), const Json& template_kwargs = Json());

}  // namespace kestrel::cli
