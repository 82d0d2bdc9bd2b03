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
