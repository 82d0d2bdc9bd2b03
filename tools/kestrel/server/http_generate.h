// /v1/completions and /v1/chat/completions: the body is parsed, validated, templated and tokenized
// on a WorkPool thread (work_pool.h), off the event loop; errors are answered from there, and the
// choices go to the engine loop. The response is written as the outputs arrive (the channel's
// notification posts to the connection's strand): one JSON object at the end, or server-sent events
// as they come. A client that goes away cancels the generation (its engine requests are aborted,
// or its preparation skipped).
//
// A text prompt longer than max_model_len tokens can cover (ApiState::max_token_bytes bytes per
// token) is refused before it is tokenized, with the same 400 context_length_exceeded as a prompt
// whose tokens do not fit.
//
// Completions with a batched prompt (a list of strings or of token-id lists) make n engine requests
// per prompt; choice index = prompt_index * n + j (OpenAI's order), each choice echoes its own
// prompt, usage sums the prompts. Echo with logprobs and prompt_logprobs: the prompt's logprobs are
// computed by its choice 0 only, and all n choices repeat them (chat: prompt_logprobs once, beside
// the choices, as vLLM answers). max_tokens 0 (completions): each choice is its echo, or empty,
// with finish_reason "length" and no completion tokens; the token the engine generates is dropped.
#pragma once

#include <memory>
#include <string>

#include "server/http_api.h"

namespace kestrel::cli {

void start_generation(ApiState& api, const std::shared_ptr<HttpSession>& session, std::string body,
                      RequestApi which);

}  // namespace kestrel::cli
