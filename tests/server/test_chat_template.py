"""The model's own Jinja chat template: rendered for chat requests; its errors are 400s with its message."""

from sse import stream_events


def test_template_renders_the_conversation(templated_server):
    r = templated_server.post("/v1/chat/completions",
                              {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
    # The rendered prompt "<s>user: Hi\nassistant:" as a completion prompt: the template wrote the
    # BOS itself, so the chat request has exactly as many prompt tokens (no second BOS).
    c = templated_server.post("/v1/completions", {"prompt": "user: Hi\nassistant:", "max_tokens": 4, "temperature": 0})
    assert c.status_code == 200, c.text
    assert r.json()["usage"]["prompt_tokens"] == c.json()["usage"]["prompt_tokens"]
    assert r.json()["choices"][0]["message"]["content"] == c.json()["choices"][0]["text"]


def test_template_error_is_a_400_with_its_message(templated_server):
    body = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], "max_tokens": 4}
    r = templated_server.post("/v1/chat/completions", body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "messages"
    assert "This model does not take a system message" in err["message"]
    r = templated_server.post("/v1/chat/completions", dict(body, stream=True))
    assert r.status_code == 400 and "system message" in r.json()["error"]["message"]
    # Still serving.
    events, done = stream_events(templated_server.url + "/v1/chat/completions",
                                 {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True})
    assert done
