// Chat prompts from a model's own Jinja chat template, rendered the way Hugging Face transformers
// renders them (apply_chat_template): the template sees `messages`, `tools` and `documents`
// (None when not given), `add_generation_prompt`, the special tokens (`bos_token`, `eos_token`)
// and any extra variables, with raise_exception() and strftime_now() available.
#pragma once

#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "template/jinja.h"

namespace kestrel {

struct ChatTemplateInputs {
  // [{role, content, ...}] as the OpenAI request gives them (content may be a string or a list of
  // parts; tool_calls, name, ... pass through). ordered_json keeps key order, which tojson shows.
  nlohmann::ordered_json messages = nlohmann::ordered_json::array();
  bool add_generation_prompt = false;
  std::string bos_token;
  std::string eos_token;
  nlohmann::ordered_json tools;      // null: no tools (the template sees None)
  nlohmann::ordered_json documents;  // null: none
  // More variables (enable_thinking, date_string, other special tokens, ...); they override the
  // ones above. Must be an object.
  nlohmann::ordered_json extra = nlohmann::ordered_json::object();
  jinja::RenderOptions options;  // limits and strftime_now's clock
};

// Errors: jinja::TemplateError (syntax errors with line and column, runtime errors, the message
// of raise_exception, limits), kestrel::Error when `extra` is not an object.
std::string render_chat_template(const jinja::Template& tmpl, const ChatTemplateInputs& inputs);
std::string render_chat_template(std::string_view source, const ChatTemplateInputs& inputs);

// The template to use from tokenizer_config.json's "chat_template" value: a string, or a list of
// {name, template} where `name` (when given), else "tool_use" when has_tools and present, else
// "default" is taken (transformers' choice). Errors: kestrel::Error naming what is missing.
std::string select_chat_template(const nlohmann::json& chat_template, bool has_tools, std::string_view name = {});

}  // namespace kestrel
