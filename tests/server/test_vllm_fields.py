"""vLLM's sampling fields min_tokens, stop_token_ids and prompt_logprobs on /v1/completions and
/v1/chat/completions, the per-request speculative_config they refuse, and OpenAI's legacy
max_tokens 0 (the echo alone, for scoring a prompt)."""

import pytest

from sse import stream_events
from vllm_requests import C, CH, PROMPT, choice, complete, greedy_ids


def fresh_index(ids, start):
    """The first index >= start whose id does not occur before it."""
    for i in range(start, len(ids)):
        if ids[i] not in ids[:i]:
            return i
    pytest.fail(f"no fresh id in {ids}")


def test_stop_token_ids_end_generation_without_their_text(server):
    _, g = greedy_ids(20)
    k = fresh_index(g, 3)
    before = choice(complete(server, max_tokens=k))["text"]
    for extra in ({}, {"ignore_eos": True}):  # ignore_eos ignores EOS alone, as in vLLM
        r = complete(server, max_tokens=20, stop_token_ids=[g[k]], **extra)
        assert choice(r)["finish_reason"] == "stop", r
        assert r["usage"]["completion_tokens"] == k + 1  # the stop token is counted, as vLLM counts it
        assert choice(r)["text"] == before  # ... but its text is not there
    # Streamed alike.
    events, done = stream_events(server.url + C, {"prompt": PROMPT, "max_tokens": 20, "temperature": 0,
                                                  "stop_token_ids": [g[k]], "stream": True})
    assert done
    assert "".join(c["text"] for e in events for c in e["choices"]) == before
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_min_tokens_holds_stop_token_ids_back(server):
    _, g = greedy_ids(20)
    k = fresh_index(g, 1)
    assert k < 6
    stop = g[k]
    plain = complete(server, max_tokens=30, stop_token_ids=[stop])
    assert plain["usage"]["completion_tokens"] == k + 1
    held = complete(server, max_tokens=30, stop_token_ids=[stop], min_tokens=10, logprobs=0)
    n = held["usage"]["completion_tokens"]
    assert n >= 10
    assert choice(held)["finish_reason"] == ("stop" if n < 30 else "length")
    if n < 30:
        assert n > 10  # the stop came after min_tokens
    # The first 10 tokens are greedy with the stop id's logit at -inf: as with a -100 bias.
    ref = complete(server, max_tokens=10, logit_bias={str(stop): -100}, logprobs=0)
    assert choice(held)["logprobs"]["tokens"][:10] == choice(ref)["logprobs"]["tokens"]
    assert choice(held)["text"].startswith(choice(ref)["text"])


def test_min_tokens_defers_stop_strings(server):
    full = complete(server, max_tokens=60, ignore_eos=True, logprobs=0)
    text = choice(full)["text"]
    tokens = choice(full)["logprobs"]["tokens"]
    assert "".join(tokens) == text
    k_min = 12
    early_end = len("".join(tokens[:k_min - 1]))  # a match must end past the first k_min - 1 tokens
    stop = next((s for s in (" the ", ".", " was ", ",", " a ", "e")
                 if 0 <= text.find(s) <= early_end - len(s) and text.find(s, early_end - len(s) + 1) >= 0), None)
    assert stop, text
    early = complete(server, max_tokens=60, ignore_eos=True, stop=stop)
    assert choice(early)["text"] == text[:text.find(stop)]
    held = complete(server, max_tokens=60, ignore_eos=True, stop=stop, min_tokens=k_min)
    assert choice(held)["finish_reason"] == "stop"
    assert choice(held)["text"] == text[:text.find(stop, early_end - len(stop) + 1)]
    assert held["usage"]["completion_tokens"] >= k_min


def test_min_tokens_outlasts_the_end_of_turn(chat_server):
    body = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 64,
            "temperature": 0}
    r = chat_server.post(CH, body)
    assert r.status_code == 200, r.text
    n = r.json()["usage"]["completion_tokens"]
    assert r.json()["choices"][0]["finish_reason"] == "stop" and n < 40, r.json()
    longer = chat_server.post(CH, dict(body, min_tokens=n + 8)).json()
    assert longer["usage"]["completion_tokens"] >= n + 8, longer
    answer = r.json()["choices"][0]["message"]["content"]
    assert longer["choices"][0]["message"]["content"].startswith(answer)


def prompt_token_ids(server, prompt=PROMPT):
    r = server.post("/tokenize", {"prompt": prompt})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def check_prompt_logprobs(pl, ids, n_top):
    """vLLM's shape: null, then {id: {logprob, rank, decoded_token}} with the prompt token and the
    n_top likeliest, ranked."""
    assert len(pl) == len(ids) and pl[0] is None
    for i in range(1, len(ids)):
        d = pl[i]
        entry = d[str(ids[i])]
        assert set(entry) == {"logprob", "rank", "decoded_token"}
        assert entry["logprob"] <= 0 and entry["rank"] >= 1
        others = {int(t): e for t, e in d.items() if int(t) != ids[i]}
        ranks = sorted(e["rank"] for e in d.values())
        if entry["rank"] <= n_top:  # among the top: listed once
            assert len(d) == n_top and ranks == list(range(1, n_top + 1)), d
        else:
            assert len(d) == n_top + 1 and ranks[:n_top] == list(range(1, n_top + 1)), d
            assert all(e["logprob"] >= entry["logprob"] for e in others.values())
        by_rank = sorted(d.values(), key=lambda e: e["rank"])
        assert [e["logprob"] for e in by_rank] == sorted((e["logprob"] for e in by_rank), reverse=True)


def test_prompt_logprobs_completions(server):
    ids = prompt_token_ids(server)
    r = complete(server, max_tokens=2, prompt_logprobs=3, echo=True, logprobs=1, n=2, temperature=0.8, seed=5)
    pls = [c["prompt_logprobs"] for c in r["choices"]]
    assert pls[0] == pls[1]  # computed once, repeated in each choice
    check_prompt_logprobs(pls[0], ids, 3)
    echo = choice(r)["logprobs"]
    for i in range(1, len(ids)):
        # The same numbers as echo's logprobs; echo lists its own 1 alternative, not prompt_logprobs' 3.
        assert abs(pls[0][i][str(ids[i])]["logprob"] - echo["token_logprobs"][i]) < 1e-6
        assert len(echo["top_logprobs"][i]) <= 2
        if i >= 2:  # past the first word (listed without SentencePiece's leading space)
            assert pls[0][i][str(ids[i])]["decoded_token"] == echo["tokens"][i]
    # prompt_logprobs alone; the generated tokens do not change.
    plain = complete(server, max_tokens=6)
    alone = complete(server, max_tokens=6, prompt_logprobs=0)
    check_prompt_logprobs(choice(alone)["prompt_logprobs"], ids, 0)
    assert choice(alone)["text"] == choice(plain)["text"]
    assert "prompt_logprobs" not in choice(plain)
    # Batched prompts: each choice has its own prompt's.
    two = complete(server, prompt=[PROMPT, "The dog"], max_tokens=1, prompt_logprobs=1)
    by_index = sorted(two["choices"], key=lambda c: c["index"])
    check_prompt_logprobs(by_index[0]["prompt_logprobs"], ids, 1)
    check_prompt_logprobs(by_index[1]["prompt_logprobs"], prompt_token_ids(server, "The dog"), 1)


def test_prompt_logprobs_chat_beside_the_choices(server):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0, "prompt_logprobs": 2}
    r = server.post(CH, body)
    assert r.status_code == 200, r.text
    j = r.json()
    ids = server.post("/tokenize", {"messages": body["messages"]}).json()["tokens"]
    assert j["usage"]["prompt_tokens"] == len(ids)
    check_prompt_logprobs(j["prompt_logprobs"], ids, 2)
    assert "prompt_logprobs" not in j["choices"][0]


def test_echo_with_max_tokens_zero_returns_the_prompt(server):
    ids = prompt_token_ids(server)
    r = complete(server, max_tokens=0, echo=True)
    assert choice(r)["text"] == PROMPT and choice(r)["finish_reason"] == "length"
    assert r["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
    assert complete(server, max_completion_tokens=0, echo=True)["choices"][0]["text"] == PROMPT
    # With logprobs: the prompt's alone (lm-evaluation-harness' loglikelihood), as max_tokens 1 lists them.
    scored = complete(server, max_tokens=0, echo=True, logprobs=2)
    lp = choice(scored)["logprobs"]
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None
    one = choice(complete(server, max_tokens=1, echo=True, logprobs=2))["logprobs"]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert lp[key] == one[key][:len(ids)], key
    # Without echo: an empty completion (as OpenAI answers).
    empty = complete(server, max_tokens=0)
    assert choice(empty)["text"] == "" and choice(empty)["finish_reason"] == "length"
    assert empty["usage"]["completion_tokens"] == 0
    # Several prompts and choices: each choice its own prompt.
    many = complete(server, prompt=[PROMPT, "The dog"], max_tokens=0, echo=True, n=2)
    assert sorted((c["index"], c["text"]) for c in many["choices"]) == [
        (0, PROMPT), (1, PROMPT), (2, "The dog"), (3, "The dog")]
    assert many["usage"]["completion_tokens"] == 0
    # Streamed: the echo, then the end.
    events, done = stream_events(server.url + C, {"prompt": PROMPT, "max_tokens": 0, "echo": True, "stream": True,
                                                  "stream_options": {"include_usage": True}})
    assert done
    assert "".join(c["text"] for e in events for c in e["choices"]) == PROMPT
    assert [c["finish_reason"] for e in events for c in e["choices"]][-1] == "length"
    assert events[-1]["usage"]["completion_tokens"] == 0
    events, done = stream_events(server.url + C, {"prompt": PROMPT, "max_tokens": 0, "echo": True, "stream": True,
                                                  "logprobs": 1})
    assert done
    chunks = [c for e in events for c in e["choices"]]
    assert "".join(c["text"] for c in chunks) == PROMPT
    assert [t for c in chunks if c["logprobs"] for t in c["logprobs"]["tokens"]] == lp["tokens"]
    assert chunks[-1]["finish_reason"] == "length"
    assert server.metrics()["kestrel_kv_blocks_used"] == 0


def test_speculative_config_is_the_servers_setting(server):
    r = server.post(C, {"prompt": PROMPT, "speculative_config": {"method": "ngram", "num_speculative_tokens": 3}})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "speculative_config" and "--speculative-config" in err["message"], err
