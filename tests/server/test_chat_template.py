"""The model's own Jinja chat template: rendered for chat requests; its errors are 400s with its message."""

import subprocess

import pytest

from conftest import kestrel_binary, stories_model
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


def test_chat_template_kwargs_reach_the_template(templated_server):
    """vLLM's chat_template_kwargs: variables for the template, overriding its inputs (here
    add_generation_prompt, so the prompt lacks "assistant:"); anything but an object is a 400."""
    msgs = [{"role": "user", "content": "Hi"}]
    plain = templated_server.post("/v1/chat/completions", {"messages": msgs, "max_tokens": 1})
    assert plain.status_code == 200, plain.text
    kw = templated_server.post("/v1/chat/completions", {"messages": msgs, "max_tokens": 1,
                                                        "chat_template_kwargs": {"add_generation_prompt": False}})
    assert kw.status_code == 200, kw.text
    c = templated_server.post("/v1/completions", {"prompt": "user: Hi\n", "max_tokens": 1})
    assert kw.json()["usage"]["prompt_tokens"] == c.json()["usage"]["prompt_tokens"]
    assert kw.json()["usage"]["prompt_tokens"] < plain.json()["usage"]["prompt_tokens"]
    bad = templated_server.post("/v1/chat/completions", {"messages": msgs, "chat_template_kwargs": ["x"]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"
    # /tokenize renders messages with them too (vLLM's tokenize takes chat_template_kwargs).
    tk = templated_server.post("/tokenize", {"messages": msgs, "chat_template_kwargs": {"add_generation_prompt": False}})
    assert tk.status_code == 200, tk.text
    assert tk.json()["count"] == kw.json()["usage"]["prompt_tokens"]
    full = templated_server.post("/tokenize", {"messages": msgs})
    assert full.json()["count"] == plain.json()["usage"]["prompt_tokens"]
    # vLLM's add_generation_prompt field of a chat request does the same.
    field = templated_server.post("/v1/chat/completions", {"messages": msgs, "max_tokens": 1,
                                                           "add_generation_prompt": False})
    assert field.status_code == 200, field.text
    assert field.json()["usage"]["prompt_tokens"] == kw.json()["usage"]["prompt_tokens"]
    bad = templated_server.post("/v1/chat/completions", {"messages": msgs, "add_generation_prompt": "no"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "add_generation_prompt"


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


def test_template_that_does_not_parse_fails_at_start_up(tmp_path):
    # It used to start and then answer every chat request with a 400 that blamed `messages`.
    pytest.importorskip("gguf")
    import gguf
    import numpy as np
    src = gguf.GGUFReader(str(stories_model()))
    dst = tmp_path / "bad_template.gguf"
    w = gguf.GGUFWriter(str(dst), src.fields["general.architecture"].contents())
    for name, f in src.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "tokenizer.chat_template"):
            continue
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_key_value(name, f.contents(), f.types[0], sub_type=f.types[-1])
        else:
            w.add_key_value(name, f.contents(), f.types[0])
    w.add_string("tokenizer.chat_template", "{{ messages | no_such_filter }}")
    for t in src.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    p = subprocess.run([str(kestrel_binary()), "serve", "-m", str(dst), "--port", "0"], capture_output=True,
                       text=True, timeout=30)
    assert p.returncode != 0
    assert "chat template" in p.stderr and "no_such_filter" in p.stderr, p.stderr
