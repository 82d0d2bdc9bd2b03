"""vLLM's tokenizer routes (/tokenize, /detokenize, /tokenizer_info), as remote-tokenizer clients
(lm-evaluation-harness) read them."""

import requests

PROMPT = "Once upon a time"


def post(server, path, body):
    return requests.post(server.url + path, json=body, timeout=30)


def test_tokenize_counts_what_a_completion_counts(server):
    r = post(server, "/tokenize", {"prompt": PROMPT})
    assert r.status_code == 200, r.text
    t = r.json()
    assert set(t) == {"count", "max_model_len", "tokens", "token_strs"}
    assert t["count"] == len(t["tokens"]) > 1 and t["max_model_len"] == 2048 and t["token_strs"] is None
    c = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1}).json()
    assert c["usage"]["prompt_tokens"] == t["count"]
    # The ids as a prompt give the same greedy answer as the text.
    a = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}).json()
    b = post(server, "/v1/completions", {"prompt": t["tokens"], "max_tokens": 8, "temperature": 0}).json()
    assert a["choices"][0]["text"] == b["choices"][0]["text"]


def test_tokenize_special_tokens_and_detokenize_round_trip(server):
    info = requests.get(server.url + "/tokenizer_info", timeout=10).json()
    with_bos = post(server, "/tokenize", {"prompt": PROMPT}).json()["tokens"]
    without = post(server, "/tokenize", {"prompt": PROMPT, "add_special_tokens": False}).json()["tokens"]
    assert with_bos[1:] == without and len(with_bos) == len(without) + 1
    assert post(server, "/detokenize", {"tokens": without}).json() == {"prompt": PROMPT}
    # Special tokens are written out, as vLLM's detokenize does.
    assert post(server, "/detokenize", {"tokens": with_bos[:1]}).json()["prompt"] == info["bos_token"]


def test_tokenize_messages_matches_a_chat_request(server):
    messages = [{"role": "user", "content": "Hi there"}]
    t = post(server, "/tokenize", {"messages": messages}).json()
    c = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 1}).json()
    assert t["count"] == c["usage"]["prompt_tokens"]
    shorter = post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    assert shorter["count"] < t["count"]


def test_tokenizer_info(server):
    r = requests.get(server.url + "/tokenizer_info", timeout=10)
    assert r.status_code == 200
    info = r.json()
    for key in ("tokenizer_class", "bos_token", "eos_token", "pad_token", "chat_template", "model_max_length"):
        assert key in info
    assert info["bos_token"] == "<s>" and info["eos_token"] == "</s>" and info["model_max_length"] == 2048


def test_tokenizer_route_errors(server):
    cases = [
        ("/detokenize", {"tokens": [100000]}, "tokens[0]"),
        ("/detokenize", {"tokens": [1, -1]}, "tokens[1]"),
        ("/detokenize", {"tokens": ["a"]}, "tokens[0]"),
        ("/detokenize", {"tokens": [1.5]}, "tokens[0]"),
        ("/detokenize", {}, "tokens"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
        ("/tokenize", {"prompt": "a", "messages": []}, "messages"),
        ("/tokenize", {"messages": "hi"}, "messages"),
    ]
    for path, body, param in cases:
        r = post(server, path, body)
        assert r.status_code == 400, (path, body, r.text)
        err = r.json()["error"]
        assert err["param"] == param and err["message"], (body, err)
    # Neither field: the message asks for one; both: it says not both.
    assert post(server, "/tokenize", {}).json()["error"]["message"] == "give prompt (a string) or messages"
    assert "not both" in post(server, "/tokenize", {"prompt": "a", "messages": []}).json()["error"]["message"]
    r = post(server, "/tokenize", {"prompt": "a", "model": "other"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = requests.post(server.url + "/tokenize", data=b"[1", headers={"Content-Type": "application/json"}, timeout=10)
    assert r.status_code == 400
    r = requests.get(server.url + "/tokenize", timeout=10)
    assert r.status_code == 405 and r.headers["Allow"] == "POST"
