// /v1/completions and /v1/chat/completions: the body is validated and tokenized at once (errors
// answered right away), the choices go to the engine loop, and the response is written as the
// outputs arrive (the channel's notification posts to the connection's strand): one JSON object at
// the end, or server-sent events as they come. A client that goes away cancels the generation
// (its engine requests are aborted).
//
// Completions with a batched prompt (a list of strings or of token-id lists) make n engine requests
// per prompt; choice index = prompt_index * n + j (OpenAI's order), each choice echoes and logs its
// own prompt, usage sums the prompts.
#pragma once

#include <memory>
#include <string>

#include "server/http_api.h"

namespace kestrel::cli {

void start_generation(ApiState& api, const std::shared_ptr<HttpSession>& session, const std::string& body,
                      RequestApi which);

}  // namespace kestrel::cli
