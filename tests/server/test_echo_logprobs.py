"""Completions with echo and logprobs (lm-evaluation-harness' loglikelihood requests): every prompt
token after the first is scored under the model given the tokens before it."""

import subprocess

from conftest import kestrel_binary, stories_model
from sse import stream_events

PROMPT = "Once upon a time, there was a little girl named Lily. She loved to play"


def prompt_ids():
    # The prompt as the server tokenizes it: BOS (id 1 in the llama2.c vocabulary) and the pieces.
    out = subprocess.run([str(kestrel_binary()), "tokenize", "-m", str(stories_model()), PROMPT],
                         capture_output=True, text=True, check=True).stdout
    return [1] + [int(t) for t in out.split()]


def complete(server, **body):
    body.setdefault("prompt", PROMPT)
    r = server.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    return r.json()


def test_echo_logprobs_score_every_prompt_token(server):
    ids = prompt_ids()
    r = complete(server, max_tokens=1, temperature=0, echo=True, logprobs=2)
    assert r["usage"]["prompt_tokens"] == len(ids)
    lp = r["choices"][0]["logprobs"]
    n = len(ids) + 1  # the prompt, then the one generated token
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    assert r["choices"][0]["text"].startswith(PROMPT)
    # Nothing precedes the first token: no logprob.
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for i in range(1, n):
        assert lp["token_logprobs"][i] <= 0
        top = lp["top_logprobs"][i]
        assert lp["tokens"][i] in top and len(top) >= 2
        assert max(top.values()) >= lp["token_logprobs"][i] - 1e-6
    assert lp["text_offset"] == sorted(lp["text_offset"])
    # Each prompt token's logprob is the model's, independently: the same prefix as the prompt with
    # that token forced by logit_bias; reported logprobs are the raw model's, before any bias.
    for p in (1, 2, 5, len(ids) // 2, len(ids) - 1):
        forced = complete(server, prompt=ids[:p], max_tokens=1, temperature=0, logprobs=0,
                          logit_bias={str(ids[p]): 100})
        flp = forced["choices"][0]["logprobs"]
        # Echoed, the first word is listed without SentencePiece's leading space (its text has none).
        assert [lp["tokens"][p]] == ([flp["tokens"][0].removeprefix(" ")] if p == 1 else flp["tokens"])
        assert abs(flp["token_logprobs"][0] - lp["token_logprobs"][p]) < 1e-4, p
    # Asking for the prompt's logprobs changes no generated token.
    plain = complete(server, max_tokens=1, temperature=0, logprobs=2)
    assert lp["tokens"][-1] == plain["choices"][0]["logprobs"]["tokens"][0]


def test_echo_logprobs_stream_like_the_full_response(server):
    full = complete(server, max_tokens=6, temperature=0, echo=True, logprobs=1)
    events, done = stream_events(server.url + "/v1/completions",
                                 {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "echo": True, "logprobs": 1,
                                  "stream": True})
    assert done
    first = events[0]["choices"][0]
    assert first["text"] == PROMPT
    assert len(first["logprobs"]["tokens"]) == len(prompt_ids())
    chunks = [c for e in events for c in e["choices"] if c.get("logprobs")]
    joined = {k: [v for c in chunks for v in c["logprobs"][k]] for k in ("tokens", "token_logprobs", "text_offset")}
    for k in joined:
        assert joined[k] == full["choices"][0]["logprobs"][k], k
    assert "".join(c["text"] for e in events for c in e["choices"]) == full["choices"][0]["text"]


def test_echo_logprobs_with_token_ids_and_n(server):
    ids = prompt_ids()
    r = complete(server, prompt=ids, max_tokens=3, temperature=0.8, seed=3, n=2, echo=True, logprobs=0)
    a, b = (c["logprobs"] for c in sorted(r["choices"], key=lambda c: c["index"]))
    assert a["token_logprobs"][:len(ids)] == b["token_logprobs"][:len(ids)]
    assert len(a["tokens"]) == len(ids) + 3
