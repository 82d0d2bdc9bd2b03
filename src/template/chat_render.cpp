#include "template/chat_render.h"

#include "core/error.h"

namespace kestrel {

std::string render_chat_template(const jinja::Template& tmpl, const ChatTemplateInputs& inputs) {
  if (!inputs.extra.is_object()) throw Error("chat template variables must be a JSON object");
  nlohmann::ordered_json context = nlohmann::ordered_json::object();
  context["messages"] = inputs.messages;
  context["tools"] = inputs.tools;
  context["documents"] = inputs.documents;
  context["add_generation_prompt"] = inputs.add_generation_prompt;
  context["bos_token"] = inputs.bos_token;
  context["eos_token"] = inputs.eos_token;
  for (auto it = inputs.extra.begin(); it != inputs.extra.end(); ++it) context[it.key()] = it.value();
  return tmpl.render(context, inputs.options);
}

std::string render_chat_template(std::string_view source, const ChatTemplateInputs& inputs) {
  return render_chat_template(jinja::Template::parse(source), inputs);
}

std::string select_chat_template(const nlohmann::json& chat_template, bool has_tools, std::string_view name) {
  if (chat_template.is_string()) return chat_template.get<std::string>();
  if (!chat_template.is_array()) {
    throw Error("chat_template must be a string or a list of {name, template}, got " + std::string(chat_template.type_name()));
  }
  auto find = [&](std::string_view want) -> const nlohmann::json* {
    for (const nlohmann::json& e : chat_template) {
      if (e.is_object() && e.contains("name") && e["name"].is_string() && e["name"].get<std::string>() == want) {
        if (!e.contains("template") || !e["template"].is_string()) {
          throw Error("chat_template entry '" + std::string(want) + "' has no string 'template'");
        }
        return &e["template"];
      }
    }
    return nullptr;
  };
  if (!name.empty()) {
    if (const nlohmann::json* t = find(name)) return t->get<std::string>();
    throw Error("the model has no chat template named '" + std::string(name) + "'");
  }
  if (has_tools) {
    if (const nlohmann::json* t = find("tool_use")) return t->get<std::string>();
  }
  if (const nlohmann::json* t = find("default")) return t->get<std::string>();
  throw Error("the model has several chat templates and none is named 'default'");
}

}  // namespace kestrel
