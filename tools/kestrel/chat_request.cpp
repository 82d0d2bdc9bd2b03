#include "chat_request.h"

#include <string>

namespace kestrel::cli {

namespace {
using json = RequestJson;

[[noreturn]] void bad(const std::string& field, const std::string& rule, const json& v) {
  throw RequestError(field, field + " " + rule + ", got " + shown(v));
}

// The member's value, or null when absent (OpenAI clients send null for "not set").
const json& member(const json& obj, const char* name) {
  static const json kNull;
  const auto it = obj.find(name);
  return it == obj.end() ? kNull : *it;
}

const std::string& string_member(const std::string& field, const json& obj, const char* name) {
  const json& v = member(obj, name);
  if (v.is_null()) throw RequestError(field + "." + name, field + "." + name + " is missing");
  if (!v.is_string()) bad(field + "." + name, "must be a string", v);
  return v.get_ref<const std::string&>();
}

// OpenAI content: a string, or an array of {"type": "text", "text": ...} parts, joined with "\n"
// as vLLM joins them for a template that takes string content.
std::string content_text(const std::string& field, const json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (!v.is_array()) bad(field, "must be a string or an array of text parts", v);
  std::string text;
  for (size_t i = 0; i < v.size(); ++i) {
    const json& part = v[i];
    const std::string name = field + "[" + std::to_string(i) + "]";
    if (!part.is_object() || part.value("type", json()) != "text" || !part.contains("text") ||
        !part["text"].is_string())
      bad(name, "must be {\"type\": \"text\", \"text\": \"...\"}", part);
    if (i > 0) text += '\n';
    text += part["text"].get<std::string>();
  }
  return text;
}

// The value of a tool call's arguments text; {} when the text is not JSON (vLLM's choice: a
// conversation replayed with a model's malformed call still renders). The text is held to a request
// body's limits (JsonLimits: depth, as the template walks the value recursively; keys and values).
Json arguments_value(const std::string& field, const std::string& text) {
  std::optional<Json> value = parse_ordered_json(text, field, field);
  return value ? std::move(*value) : Json::object();
}

// An assistant message's tool_calls as the template sees them (see parse_chat_messages).
Json tool_calls_of(const std::string& field, const json& v) {
  if (!v.is_array()) bad(field, "must be an array of {id, type, function} objects", v);
  Json calls = Json::array();
  for (size_t i = 0; i < v.size(); ++i) {
    const json& c = v[i];
    const std::string name = field + "[" + std::to_string(i) + "]";
    if (!c.is_object()) bad(name, "must be an object {id, type: \"function\", function: {name, arguments}}", c);
    const std::string& id = string_member(name, c, "id");
    if (const json& type = member(c, "type"); !type.is_null() && type != "function")
      bad(name + ".type", "must be \"function\"", type);
    const json& fn = member(c, "function");
    if (!fn.is_object()) {
      if (fn.is_null()) throw RequestError(name + ".function", name + ".function is missing");
      bad(name + ".function", "must be an object {name, arguments}", fn);
    }
    const std::string& fn_name = string_member(name + ".function", fn, "name");
    // Chat templates write the arguments with `| tojson`: they expect the value, not its JSON text.
    const json& args = member(fn, "arguments");
    Json value = Json::object();
    if (args.is_string()) {
      value = arguments_value(name + ".function.arguments", args.get_ref<const std::string&>());
    } else if (args.is_object() || args.is_array()) {
      value = args;
    } else if (!args.is_null()) {
      bad(name + ".function.arguments", "must be a string of JSON", args);
    }
    calls.push_back(Json{{"id", id}, {"type", "function"}, {"function", {{"name", fn_name}, {"arguments", value}}}});
  }
  return calls;
}

bool is_role(const json& role) {
  for (const char* r : {"system", "developer", "user", "assistant", "tool"})
    if (role == r) return true;
  return false;
}

// A tool: {"type": "function", "function": {"name", "description"?, "parameters"?, "strict"?}}.
void check_tool(const std::string& field, const json& t) {
  if (!t.is_object()) bad(field, "must be {\"type\": \"function\", \"function\": {\"name\", ...}}", t);
  if (const json& type = member(t, "type"); !type.is_null() && type != "function")
    bad(field + ".type", "must be \"function\"", type);
  const json& fn = member(t, "function");
  if (fn.is_null()) throw RequestError(field + ".function", field + ".function is missing");
  if (!fn.is_object()) bad(field + ".function", "must be an object {name, description, parameters}", fn);
  if (string_member(field + ".function", fn, "name").empty())
    bad(field + ".function.name", "must not be empty", fn["name"]);
  if (const json& d = member(fn, "description"); !d.is_null() && !d.is_string())
    bad(field + ".function.description", "must be a string", d);
  if (const json& p = member(fn, "parameters"); !p.is_null() && !p.is_object())
    bad(field + ".function.parameters", "must be a JSON Schema object", p);
}
}  // namespace

void parse_chat_messages(const json& v, OpenAiRequest& r) {
  if (!v.is_array() || v.empty()) bad("messages", "must be a non-empty array of {role, content} objects", v);
  r.messages_json = Json::array();
  for (size_t i = 0; i < v.size(); ++i) {
    const json& m = v[i];
    const std::string name = "messages[" + std::to_string(i) + "]";
    if (!m.is_object()) bad(name, "must be an object with role and content", m);
    if (!m.contains("role")) throw RequestError(name + ".role", name + ".role is missing");
    const json& role_json = m["role"];
    if (!is_role(role_json))
      bad(name + ".role", "must be \"system\", \"developer\", \"user\", \"assistant\" or \"tool\"", role_json);
    const std::string role = role_json.get<std::string>();

    // tool_calls of other roles and tool_call_id of other roles than tool are left out, as vLLM does.
    Json calls;
    if (const json& tc = member(m, "tool_calls"); role == "assistant" && !tc.is_null())
      calls = tool_calls_of(name + ".tool_calls", tc);
    const json& content_json = member(m, "content");
    std::string content;
    if (!content_json.is_null()) {
      content = content_text(name + ".content", content_json);
    } else if (calls.empty()) {
      throw RequestError(name + ".content", name + ".content is missing (it may be null only in an assistant "
                                                   "message with tool_calls)");
    }

    Json out{{"role", role}, {"content", content}};
    if (const json& n = member(m, "name"); !n.is_null()) {
      if (!n.is_string()) bad(name + ".name", "must be a string", n);
      out["name"] = n.get<std::string>();
    }
    if (!calls.empty()) out["tool_calls"] = std::move(calls);
    if (const json& id = member(m, "tool_call_id"); role == "tool" && !id.is_null()) {
      if (!id.is_string()) bad(name + ".tool_call_id", "must be a string", id);
      out["tool_call_id"] = id.get<std::string>();
    }
    r.messages.push_back({role, content});
    r.messages_json.push_back(std::move(out));
  }
}

void parse_chat_tools(const json& j, OpenAiRequest& r) {
  const json& tools = member(j, "tools");
  if (!tools.is_null()) {
    if (!tools.is_array()) bad("tools", "must be an array of {\"type\": \"function\", \"function\": {...}} objects", tools);
    for (size_t i = 0; i < tools.size(); ++i) check_tool("tools[" + std::to_string(i) + "]", tools[i]);
  }
  const json& choice = member(j, "tool_choice");
  const bool have_tools = tools.is_array() && !tools.empty();
  // Served: "none", and "required" with an empty tools list (OpenAI and vLLM read it as "none").
  if ((choice.is_null() && !have_tools) || choice == "none" || (choice == "required" && !have_tools && !tools.is_null())) {
    if (!tools.is_null()) r.tools = tools;
    return;
  }
  const char* const kUseNone =
      "; use tool_choice \"none\" (the tools are then rendered into the prompt and the answer is text)";
  if (choice.is_null())
    throw RequestError("tool_choice", std::string("tool_choice \"auto\" (the default when tools are given) is not "
                                                  "supported: this server does not parse tool calls from the model's "
                                                  "output") + kUseNone);
  const char* const kChoices = "must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}";
  if (!choice.is_object() && choice != "auto" && choice != "required") bad("tool_choice", kChoices, choice);
  if (tools.is_null()) throw RequestError("tool_choice", "tool_choice " + shown(choice) + " needs tools; none were given");
  if (choice == "auto")
    throw RequestError("tool_choice", std::string("tool_choice \"auto\" is not supported: this server does not parse "
                                                  "tool calls from the model's output") + kUseNone);
  if (choice == "required")
    throw RequestError("tool_choice", std::string("tool_choice \"required\" is not supported: this server does not "
                                                  "return tool calls (tool_calls) from the model's output") +
                                          kUseNone);
  const json& fn = member(choice, "function");
  if (member(choice, "type") != "function" || !fn.is_object() || !member(fn, "name").is_string())
    bad("tool_choice", kChoices, choice);
  bool found = false;
  for (const json& t : tools) found = found || t["function"]["name"] == fn["name"];
  if (!found) bad("tool_choice", "names a function that is not in tools", choice);
  throw RequestError("tool_choice", std::string("tool_choice naming a function is not supported: this server does "
                                                "not return tool calls (tool_calls) from the model's output") +
                                        kUseNone);
}

}  // namespace kestrel::cli
