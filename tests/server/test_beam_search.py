"""use_beam_search and best_of on /v1/completions and /v1/chat/completions (stories260K).

Beam search: the choices are the beams that transformers' generate(num_beams=B, do_sample=False)
returns for the same prompt ids (tests/data/beam_stories260k.json, written by
tests/reference/beam_reference.py): the same text (the reference ids detokenized) and cumulative
logprob within 1e-4. best_of > n: the n choices are the best n, by cumulative logprob, of the
best_of choices that n = best_of draws with the same seed (whose logprobs give each sum)."""

import json
from pathlib import Path

import pytest
import requests

from sse import stream_events

C = "/v1/completions"
CHAT = "/v1/chat/completions"
REFERENCE = Path(__file__).resolve().parents[1] / "data" / "beam_stories260k.json"


def cases():
    """The reference's cases that stop at the model's EOS, as the server does."""
    return json.loads(REFERENCE.read_text())["server_cases"]


def post(server, path, body):
    return requests.post(server.url + path, json=body, timeout=60)


def continuation(server, prompt_ids, ids):
    """The text ids add after the prompt (a first word keeps its leading space, as completions give it)."""
    def text(t):
        return server.post("/detokenize", {"tokens": t}).json()["prompt"]
    head = text(prompt_ids)
    full = text(prompt_ids + [t for t in ids if t != 2])
    assert full.startswith(head)
    return full[len(head):]


@pytest.mark.parametrize("which", [0, 1, 2])  # B = 2 and 4; length penalties 1 and 2; early stopping false, never, true
def test_beams_match_transformers(server, which):
    for case in [cases()[which]]:
        body = {"prompt": case["prompt_ids"], "use_beam_search": True, "n": case["num_beams"],
                "max_tokens": case["max_new_tokens"], "temperature": 0,
                "length_penalty": case["length_penalty"], "early_stopping": case["early_stopping"]}
        r = post(server, C, body)
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        assert [c["index"] for c in choices] == list(range(case["num_beams"]))
        for c, ref in zip(choices, case["beams"]):
            assert c["text"] == continuation(server, case["prompt_ids"], ref["tokens"]), case["prompt"]
            assert abs(c["cumulative_logprob"] - ref["sum_logprobs"]) < 1e-4
            assert c["finish_reason"] == ("stop" if ref["tokens"][-1] == 2 else "length")
        usage = r.json()["usage"]
        assert usage["completion_tokens"] == sum(len(b["tokens"]) for b in case["beams"])


def test_best_of_is_the_beam_width_and_n_the_beams_returned(server):
    case = cases()[1]  # B = 4
    body = {"prompt": case["prompt_ids"], "use_beam_search": True, "n": 2, "best_of": 4,
            "max_tokens": case["max_new_tokens"], "length_penalty": case["length_penalty"],
            "early_stopping": case["early_stopping"]}
    choices = post(server, C, body).json()["choices"]
    assert len(choices) == 2
    for c, ref in zip(choices, case["beams"][:2]):
        assert abs(c["cumulative_logprob"] - ref["sum_logprobs"]) < 1e-4


def test_beams_streamed_come_at_the_end(server):
    case = cases()[1]
    body = {"prompt": case["prompt_ids"], "use_beam_search": True, "n": 4, "max_tokens": case["max_new_tokens"],
            "length_penalty": case["length_penalty"], "early_stopping": case["early_stopping"],
            "stream": True, "stream_options": {"include_usage": True}}
    events, done = stream_events(server.url + C, body)
    assert done
    texts = {c["index"]: c["text"] for e in events for c in e["choices"] if c["finish_reason"]}
    assert texts == {i: continuation(server, case["prompt_ids"], b["tokens"]) for i, b in enumerate(case["beams"])}
    assert events[-1]["usage"]["completion_tokens"] == sum(len(b["tokens"]) for b in case["beams"])


def test_chat_beams(server):
    body = {"messages": [{"role": "user", "content": "Tell me a story"}], "use_beam_search": True, "n": 3,
            "max_tokens": 8}
    r = post(server, CHAT, body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 3
    sums = [c["cumulative_logprob"] for c in choices]
    assert all(s < 0 for s in sums)
    # Scores (sum / length) are ranked; with equal lengths the sums are too.
    if len({c["finish_reason"] for c in choices}) == 1 and choices[0]["finish_reason"] == "length":
        assert sums == sorted(sums, reverse=True)


def test_best_of_returns_the_n_best_sampled_choices(server):
    prompt = "Once upon a time"
    all4 = post(server, C, {"prompt": prompt, "n": 4, "temperature": 1.0, "seed": 11, "max_tokens": 12,
                            "logprobs": 0}).json()["choices"]
    sums = [sum(c["logprobs"]["token_logprobs"]) for c in all4]
    best = post(server, C, {"prompt": prompt, "n": 2, "best_of": 4, "temperature": 1.0, "seed": 11,
                            "max_tokens": 12}).json()["choices"]
    order = sorted(range(4), key=lambda i: -sums[i])[:2]
    assert [c["index"] for c in best] == [0, 1]
    assert [c["text"] for c in best] == [all4[i]["text"] for i in order]
    for c, i in zip(best, order):
        assert abs(c["cumulative_logprob"] - sums[i]) < 1e-4
        assert c["logprobs"] is None  # not asked for


@pytest.mark.parametrize("path,body,param", [
    (C, {"prompt": "a", "n": 3, "best_of": 2}, "best_of"),
    (C, {"prompt": "a", "n": 1, "best_of": 2, "stream": True}, "best_of"),
    (CHAT, {"messages": [{"role": "user", "content": "a"}], "best_of": 2}, "best_of"),
    (C, {"prompt": "a", "use_beam_search": True, "n": 2, "temperature": 0.7}, "temperature"),
    (C, {"prompt": "a", "use_beam_search": True, "n": 2, "top_p": 0.5}, "top_p"),
    (C, {"prompt": "a", "use_beam_search": True, "n": 2, "stop": ["x"]}, "stop"),
    (C, {"prompt": "a", "use_beam_search": True, "n": 2, "logprobs": 1}, "logprobs"),
    (C, {"prompt": "a", "use_beam_search": True, "early_stopping": "sometimes"}, "early_stopping"),
    (C, {"prompt": "a", "use_beam_search": "yes"}, "use_beam_search"),
])
def test_conflicting_fields_are_400(server, path, body, param):
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
