"""Chat on the default model (SmolLM2-135M-Instruct, its ChatML template): skipped without it."""

from sse import joined_text, stream_events

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def test_paris(chat_server):
    client = chat_server.openai()
    r = client.chat.completions.create(model=chat_server.name, messages=FRANCE, max_tokens=64, temperature=0)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"  # the end of the assistant's turn
    assert "<|im_end|>" not in r.choices[0].message.content


def test_multi_turn_with_system_message(chat_server):
    client = chat_server.openai()
    messages = [{"role": "system", "content": "You are a geography teacher."}, *FRANCE,
                {"role": "assistant", "content": "The capital of France is Paris."},
                {"role": "user", "content": "And of Italy?"}]
    r = client.chat.completions.create(model=chat_server.name, messages=messages, max_tokens=48, temperature=0)
    assert "Rome" in r.choices[0].message.content


def test_stream_equals_non_stream_and_never_splits_characters(chat_server):
    messages = [{"role": "user", "content": "Write two sentences in French about a café in Zürich, with emojis."}]
    body = {"messages": messages, "max_tokens": 80, "temperature": 0.8, "seed": 11}
    full = chat_server.post("/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
    events, done = stream_events(chat_server.url + "/v1/chat/completions", dict(body, stream=True))
    assert done
    assert joined_text(events, True) == [full]
    assert any(ord(ch) > 127 for ch in full), full
    # A character split between two deltas would show up as U+FFFD in one of them.
    if "\ufffd" not in full:
        for e in events:
            for c in e["choices"]:
                assert "\ufffd" not in (c["delta"].get("content") or "")


def test_stop_string_in_chat(chat_server):
    r = chat_server.post("/v1/chat/completions", {"messages": FRANCE, "max_tokens": 64, "temperature": 0}).json()
    text = r["choices"][0]["message"]["content"]
    at = text.find("Paris")
    assert at > 0
    r = chat_server.post("/v1/chat/completions",
                         {"messages": FRANCE, "max_tokens": 64, "temperature": 0, "stop": ["aris"]}).json()
    assert r["choices"][0]["message"]["content"] == text[: at + 1]
    events, _ = stream_events(chat_server.url + "/v1/chat/completions",
                              {"messages": FRANCE, "max_tokens": 64, "temperature": 0, "stop": "aris", "stream": True})
    assert joined_text(events, True) == [text[: at + 1]]


def test_developer_and_tool_roles_render_through_the_chatml_template(chat_server):
    """SmolLM2's template writes any role as <|im_start|>role (vLLM passes roles as given); both were
    refused with a 400. The rendered prompt is the template's text, as /tokenize shows it."""
    messages = [{"role": "developer", "content": "Be brief."}, *FRANCE,
                {"role": "assistant", "content": None,
                 "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "Paris"}]
    text = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
            "<|im_start|>developer\nBe brief.<|im_end|>\n"
            "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
            "<|im_start|>assistant\n<|im_end|>\n"
            "<|im_start|>tool\nParis<|im_end|>\n"
            "<|im_start|>assistant\n")
    rendered = chat_server.post("/tokenize", {"messages": messages, "add_special_tokens": False})
    assert rendered.status_code == 200, rendered.text
    assert rendered.json()["tokens"] == chat_server.post("/tokenize", {"prompt": text,
                                                                       "add_special_tokens": False}).json()["tokens"]
    by_messages = chat_server.post("/tokenize", {"messages": messages})  # with the BOS a chat request gets
    r = chat_server.post("/v1/chat/completions", {"messages": messages, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == by_messages.json()["count"]
