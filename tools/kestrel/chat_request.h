// The chat fields of an OpenAI request (/v1/chat/completions, and `kestrel batch` lines with
// messages): the messages as the chat template sees them, and tools / tool_choice. Both follow
// vLLM's OpenAI server: the roles system, developer, user, assistant and tool pass to the template
// as given; without a tool-call parser only tool_choice "none" is served.
#pragma once

#include "openai_request.h"

namespace kestrel::cli {

// `messages`: a non-empty array of {role, content, ...} objects. Fills r.messages and
// r.messages_json. Per message, as the template sees it:
//   role        "system", "developer", "user", "assistant" or "tool", as given
//   content     a string; an array of {"type": "text", "text"} parts is joined with "\n"; null (or
//               absent) only in an assistant message with tool_calls, seen as ""
//   name        passed through when given (a string)
//   tool_calls  assistant only: [{id, type: "function", function: {name, arguments}}] where
//               arguments, a JSON string in the request, is the parsed value (an object for the
//               template's `arguments | tojson`); a string that is not JSON becomes {} (vLLM does
//               the same); an empty list is dropped
//   tool_call_id  tool only, passed through when given (a string)
// Throws RequestError naming the field ("messages[2].tool_calls[0].function.name").
void parse_chat_messages(const RequestJson& v, OpenAiRequest& r);

// `tools` and `tool_choice` of request j. tool_choice "none" (the default without tools): the
// tools, when given, go to the template as `tools` (r.tools) and the answer is plain text.
// "auto" (the default with tools), "required" and a named function need the model's tool calls
// parsed from its output or forced by constrained decoding, which this server does not do: a
// RequestError (param "tool_choice"), as vLLM answers without --tool-call-parser. Each tool must
// be {"type": "function", "function": {"name": non-empty string, "description"?: string,
// "parameters"?: object}}.
void parse_chat_tools(const RequestJson& j, OpenAiRequest& r);

}  // namespace kestrel::cli
