"""The model's own Jinja chat template: rendered for chat requests; its errors are 400s with its message."""

import subprocess

from conftest import kestrel_binary
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


def test_cli_chat_renders_the_same_template(templated_server):
    """`kestrel chat` renders through the model's template too: the same greedy answer as the server,
    and the template's raise_exception as its error (the old three-family formatter had neither)."""
    cmd = [str(kestrel_binary()), "chat", "-m", str(templated_server.model), "--temperature", "0", "-n", "6"]
    out = subprocess.run(cmd + ["-p", "Hi"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    r = templated_server.post("/v1/chat/completions",
                              {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200, r.text
    # The server's text keeps the first token's leading space (as vLLM's does); chat, writing to a
    # terminal, drops it as SentencePiece decoding of a lone sequence does.
    assert out.stdout.strip() == r.json()["choices"][0]["message"]["content"].strip()
    assert len(out.stdout.strip()) > 0
    refused = subprocess.run(cmd + ["--system", "Be brief.", "-p", "Hi"], capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0
    assert "This model does not take a system message" in refused.stderr
