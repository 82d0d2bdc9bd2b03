"""Malformed requests: each gets a 4xx with an OpenAI error body, and the server keeps serving."""

import json

import pytest
import requests

from conftest import STORIES_CTX

C = "/v1/completions"
CH = "/v1/chat/completions"
MSG = [{"role": "user", "content": "Hi"}]


def body(**fields):
    b = {"prompt": "Once upon a time", "max_tokens": 4}
    b.update(fields)
    return json.dumps(b).encode()


def chat_body(**fields):
    b = {"messages": MSG, "max_tokens": 4}
    b.update(fields)
    return json.dumps(b).encode()


# (path, raw body, expected status, expected param or None when the error names none)
CASES = [
    # Not JSON, or not an object.
    (C, b'{"prompt": "a",', 400, None),
    (C, b"not json", 400, None),
    (C, b"", 400, None),
    (C, b"[1, 2]", 400, None),
    (C, b'"a string"', 400, None),
    (C, b'{"prompt": "a", "temperature": NaN}', 400, None),
    (C, b'{"prompt": "a", "temperature": Infinity}', 400, None),
    (C, b'{"prompt": "a", "top_p": -Infinity}', 400, None),
    (C, b'{"prompt": "\xff\xfe bad utf-8"}', 400, None),
    (C, b'{"prompt": "\\ud800 lone surrogate"}', 400, None),
    # The prompt.
    (C, json.dumps({"max_tokens": 4}).encode(), 400, "prompt"),
    (C, body(prompt=3), 400, "prompt"),
    (C, body(prompt=True), 400, "prompt"),
    (C, body(prompt={"text": "a"}), 400, "prompt"),
    (C, body(prompt=[]), 400, "prompt"),
    (C, body(prompt=[1.5, 2]), 400, "prompt[0]"),
    (C, body(prompt=[-1]), 400, "prompt[0]"),
    (C, body(prompt=[100000]), 400, "prompt"),
    (C, body(prompt=["a", 1]), 400, "prompt[1]"),  # a batch is all strings, all ids or all id lists
    (C, body(prompt=[1] * (STORIES_CTX + 10)), 400, "prompt"),
    # max_tokens.
    (C, body(max_tokens=-1), 400, "max_tokens"),
    (CH, chat_body(max_tokens=0), 400, "max_tokens"),  # completions take 0 (the echo alone)
    (C, body(max_tokens="16"), 400, "max_tokens"),
    (C, body(max_tokens=1.5), 400, "max_tokens"),
    (C, body(max_tokens=10**12), 400, "max_tokens"),
    (C, body(max_tokens=1e300), 400, "max_tokens"),
    (C, body(max_tokens=4, max_completion_tokens=5), 400, "max_completion_tokens"),
    # Sampling.
    (C, body(temperature=-1), 400, "temperature"),
    (C, body(temperature="hot"), 400, "temperature"),
    (C, body(temperature=1e39), 400, "temperature"),
    (C, body(top_p=0), 400, "top_p"),
    (C, body(top_p=1.5), 400, "top_p"),
    (C, body(top_k=-2), 400, "top_k"),
    (C, body(top_k=2.5), 400, "top_k"),
    (C, body(min_p=2), 400, "min_p"),
    (C, body(presence_penalty=3), 400, "presence_penalty"),
    (C, body(frequency_penalty=-3), 400, "frequency_penalty"),
    (C, body(repetition_penalty=0), 400, "repetition_penalty"),
    (C, body(logit_bias=[1]), 400, "logit_bias"),
    (C, body(logit_bias={"abc": 1}), 400, "logit_bias"),
    (C, body(logit_bias={"5": 200}), 400, "logit_bias"),
    (C, body(logit_bias={"99999": 1}), 400, "logit_bias"),
    (C, body(seed=-1), 400, "seed"),
    (C, body(seed="x"), 400, "seed"),
    # Stop strings.
    (C, body(stop=["a", "b", "c", "d", "e"]), 400, "stop"),
    (C, body(stop=""), 400, "stop"),
    (C, body(stop=[1]), 400, "stop[0]"),
    # Other fields.
    (C, body(n=0), 400, "n"),
    (C, body(n=1000), 400, "n"),
    (C, body(logprobs=50), 400, "logprobs"),
    (C, body(logprobs="yes"), 400, "logprobs"),
    (C, body(echo="yes"), 400, "echo"),
    (C, body(stream="yes"), 400, "stream"),
    (C, body(stream_options="x"), 400, "stream_options"),
    (C, body(stream_options={"include_usage": True}), 400, "stream_options"),  # without stream: true
    (C, body(ignore_eos="no"), 400, "ignore_eos"),
    (C, body(model=5), 400, "model"),
    (C, body(model="no-such-model"), 404, "model"),
    # vLLM's fields.
    (C, body(min_tokens=-1), 400, "min_tokens"),
    (C, body(min_tokens=5), 400, "min_tokens"),  # above max_tokens 4
    (C, body(min_tokens="2"), 400, "min_tokens"),
    (C, body(stop_token_ids=[100000]), 400, "stop_token_ids"),
    (C, body(stop_token_ids=[-1]), 400, "stop_token_ids[0]"),
    (C, body(stop_token_ids=5), 400, "stop_token_ids"),
    (C, body(prompt_logprobs=-1), 400, "prompt_logprobs"),
    (C, body(prompt_logprobs=21), 400, "prompt_logprobs"),
    (C, body(prompt_logprobs=1, stream=True), 400, "prompt_logprobs"),
    (C, body(speculative_config={"method": "ngram", "num_speculative_tokens": 2}), 400, "speculative_config"),
    # Chat.
    (CH, json.dumps({"max_tokens": 4}).encode(), 400, "messages"),
    (CH, chat_body(messages=[]), 400, "messages"),
    (CH, chat_body(messages="hi"), 400, "messages"),
    (CH, chat_body(messages=["hi"]), 400, "messages[0]"),
    (CH, chat_body(messages=[{"role": "user"}]), 400, "messages[0].content"),
    (CH, chat_body(messages=[{"content": "x"}]), 400, "messages[0].role"),
    (CH, chat_body(messages=[{"role": "wizard", "content": "x"}]), 400, "messages[0].role"),
    (CH, chat_body(messages=[{"role": "user", "content": 5}]), 400, "messages[0].content"),
    (CH, chat_body(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), 400, "messages[0].content[0]"),
    (CH, chat_body(top_logprobs=2), 400, "top_logprobs"),
    (CH, chat_body(logprobs=True, top_logprobs=30), 400, "top_logprobs"),
    (CH, chat_body(logprobs=3), 400, "logprobs"),
    (CH, chat_body(max_completion_tokens=-5), 400, "max_completion_tokens"),
    (CH, chat_body(temperature="NaN"), 400, "temperature"),
    (CH, chat_body(min_tokens=5), 400, "min_tokens"),
    (CH, chat_body(stop_token_ids=[100000]), 400, "stop_token_ids"),
    (CH, chat_body(prompt_logprobs=1, stream=True), 400, "prompt_logprobs"),
    (CH, chat_body(speculative_config={"method": "ngram"}), 400, "speculative_config"),
]


def test_there_are_at_least_50_cases():
    assert len(CASES) >= 50


@pytest.mark.parametrize("path,raw,status,param", CASES, ids=[f"{i}" for i in range(len(CASES))])
def test_malformed_request_gets_4xx(server, path, raw, status, param):
    r = requests.post(server.url + path, data=raw, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == status, (raw[:200], r.text)
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert isinstance(err["message"], str) and err["message"]
    assert err["param"] == param, err
    assert "code" in err


def test_other_http_errors(server):
    r = requests.post(server.url + C, data=body(), headers={"Content-Type": "text/plain"}, timeout=10)
    assert r.status_code == 415 and "error" in r.json()
    r = requests.get(server.url + "/no/such/route", timeout=10)
    assert r.status_code == 404 and "error" in r.json()


def test_still_serving_after_malformed_requests(server):
    for path, raw, _, _ in CASES:
        requests.post(server.url + path, data=raw, headers={"Content-Type": "application/json"}, timeout=30)
    r = server.post(C, {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    assert requests.get(server.url + "/health", timeout=10).status_code == 200
    m = server.metrics()
    assert m['kestrel_requests_total{status="400"}'] >= 2 * (len(CASES) - 1)
    assert m["kestrel_kv_blocks_used"] == 0
