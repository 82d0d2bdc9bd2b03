"""/v1/completions with a batched prompt (a list of strings or of token-id lists, as the OpenAI API
allows): one set of n choices per prompt, index prompt-major then n, each choice echoing and
logging its own prompt, usage summing the prompts. Also the max_tokens context check at int64's end."""

import json

import requests

from sse import stream_events

C = "/v1/completions"
PROMPTS = ["Once upon a time", "The little dog"]


def complete(server, **body):
    r = requests.post(server.url + C, json=dict({"max_tokens": 5}, **body), timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_batched_string_prompts_with_n(server):
    singles = [complete(server, prompt=p, temperature=0.8, seed=7, n=2) for p in PROMPTS]
    both = complete(server, prompt=PROMPTS, temperature=0.8, seed=7, n=2)
    assert [c["index"] for c in both["choices"]] == [0, 1, 2, 3]
    # Prompt-major, then n: choice 2 * p + j is choice j of prompt p sent alone (same seed).
    for p in range(2):
        for j in range(2):
            assert both["choices"][2 * p + j]["text"] == singles[p]["choices"][j]["text"]
    assert both["usage"]["prompt_tokens"] == sum(s["usage"]["prompt_tokens"] for s in singles)
    assert both["usage"]["completion_tokens"] == sum(s["usage"]["completion_tokens"] for s in singles)


def test_batched_token_id_prompts_echo_and_logprobs(server):
    ids = [requests.post(server.url + "/tokenize", json={"prompt": p}, timeout=10).json()["tokens"] for p in PROMPTS]
    out = complete(server, prompt=ids, temperature=0, n=2, echo=True, logprobs=1, max_tokens=3)
    assert len(out["choices"]) == 4
    for i, c in enumerate(out["choices"]):
        p = i // 2
        # Token ids are echoed as sent, special tokens (the BOS) included.
        assert c["index"] == i and c["text"].startswith("<s>" + PROMPTS[p]), c["text"]
        # The echoed prompt's tokens come first in the logprobs: this choice's own prompt.
        assert len(c["logprobs"]["tokens"]) >= len(ids[p]) + 1
        assert c["logprobs"]["token_logprobs"][0] is None
    single = complete(server, prompt=ids[1], temperature=0, echo=True, logprobs=1, max_tokens=3)
    assert out["choices"][2]["logprobs"] == single["choices"][0]["logprobs"]
    assert out["choices"][2]["text"] == single["choices"][0]["text"]


def test_batched_prompts_streamed(server):
    events, done = stream_events(server.url + C, {"prompt": PROMPTS, "n": 2, "max_tokens": 4, "stream": True,
                                                  "temperature": 0, "stream_options": {"include_usage": True}})
    assert done
    finished = sorted(c["index"] for e in events for c in e["choices"] if c["finish_reason"])
    assert finished == [0, 1, 2, 3]
    assert events[-1]["usage"]["completion_tokens"] == 16


def test_max_tokens_at_the_end_of_int64_is_400(server):
    # n_prompt + max_tokens overflowed int64 here and the request ran to the end of the context.
    for raw in (b"9223372036854775807", b"9223372036854775806", b"9223372036854775808"):
        body = b'{"prompt": "Once upon a time", "max_tokens": ' + raw + b"}"
        r = requests.post(server.url + C, data=body, headers={"Content-Type": "application/json"}, timeout=30)
        assert r.status_code == 400, (raw, r.text)
        assert r.json()["error"]["param"] == "max_tokens"
    # The largest that fits is served (the prompt has 5 tokens with BOS, the context 2048).
    n_prompt = requests.post(server.url + "/tokenize", json={"prompt": "Once upon a time"}, timeout=10).json()["count"]
    r = requests.post(server.url + C, json={"prompt": "Once upon a time", "max_tokens": 2048 - n_prompt + 1}, timeout=30)
    assert r.status_code == 400 and f"at most {2048 - n_prompt}" in r.json()["error"]["message"]
