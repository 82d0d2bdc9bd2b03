"""The OpenAI API of `kestrel serve` on stories260K, through the official openai client and raw HTTP."""

import concurrent.futures
import json
import math
import re
import subprocess

import pytest
import requests

from conftest import STORIES_CTX, Server, kestrel_binary, require, stories_model
from sse import joined_text, stream_events

PROMPT = "Once upon a time"


def complete(server, **body):
    body.setdefault("prompt", PROMPT)
    r = server.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    return r.json()


def chat(server, **body):
    body.setdefault("messages", [{"role": "user", "content": "Tell me a story."}])
    r = server.post("/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    return r.json()


def test_models_and_health(server):
    assert requests.get(server.url + "/health", timeout=10).status_code == 200
    models = server.openai().models.list()
    assert [m.id for m in models.data] == ["stories"]
    r = requests.get(server.url + "/v1/models/stories", timeout=10)
    assert r.status_code == 200 and r.json()["id"] == "stories"
    assert requests.get(server.url + "/v1/models/other", timeout=10).status_code == 404


def test_completion_with_openai_client(server):
    client = server.openai()
    r = client.completions.create(model="stories", prompt=PROMPT, max_tokens=16, temperature=0)
    assert r.object == "text_completion"
    assert r.id.startswith("cmpl-")
    assert r.model == "stories"
    assert len(r.choices) == 1 and r.choices[0].index == 0
    assert r.choices[0].text.startswith(", there was")
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == 5  # BOS + 4 pieces
    assert r.usage.completion_tokens == 16
    assert r.usage.total_tokens == 21


def test_chat_with_openai_client(server):
    client = server.openai()
    r = client.chat.completions.create(
        model="stories", messages=[{"role": "user", "content": "Hello"}], max_tokens=8, temperature=0)
    assert r.object == "chat.completion"
    assert r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert isinstance(r.choices[0].message.content, str) and r.choices[0].message.content
    assert r.usage.completion_tokens == 8

    # max_completion_tokens is the newer name; unknown fields are ignored.
    r = client.chat.completions.create(
        model="stories", messages=[{"role": "user", "content": "Hello"}], max_completion_tokens=3,
        temperature=0, extra_body={"an_unknown_field": [1, 2], "user": "someone"})
    assert r.usage.completion_tokens == 3


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_stream_equals_non_stream_for_the_same_seed(server, api):
    is_chat = api == "chat"
    path = "/v1/chat/completions" if is_chat else "/v1/completions"
    body = {"max_tokens": 96, "temperature": 0.9, "top_p": 0.95, "seed": 1234}
    if is_chat:
        body["messages"] = [{"role": "user", "content": "Tell me about a cat."}]
    else:
        body["prompt"] = PROMPT
    full = server.post(path, body).json()
    events, done = stream_events(server.url + path, dict(body, stream=True))
    assert done
    text = full["choices"][0]["message"]["content"] if is_chat else full["choices"][0]["text"]
    assert joined_text(events, is_chat) == [text]
    assert len(text) > 20
    finishes = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert finishes == [full["choices"][0]["finish_reason"]]
    assert all(e["id"] == events[0]["id"] for e in events)
    assert all(e["object"] == ("chat.completion.chunk" if is_chat else "text_completion") for e in events)
    if is_chat:
        assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}


def test_stream_with_openai_client_and_usage(server):
    client = server.openai()
    stream = client.chat.completions.create(
        model="stories", messages=[{"role": "user", "content": "Hi"}], max_tokens=12, temperature=0.7, seed=5,
        stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])
    full = client.chat.completions.create(
        model="stories", messages=[{"role": "user", "content": "Hi"}], max_tokens=12, temperature=0.7, seed=5)
    assert text == full.choices[0].message.content

    stream = client.completions.create(model="stories", prompt=PROMPT, max_tokens=10, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream) == complete(server, max_tokens=10, temperature=0)["choices"][0]["text"]


def greedy_tokens(server, max_tokens=48):
    r = complete(server, max_tokens=max_tokens, temperature=0, logprobs=0)
    lp = r["choices"][0]["logprobs"]
    assert "".join(lp["tokens"]) == r["choices"][0]["text"]
    return r["choices"][0]["text"], lp["tokens"]


def test_stop_strings_across_token_boundaries(server):
    text, tokens = greedy_tokens(server)
    # A stop string made of the end of one token and the start of the next, whose first occurrence
    # in the text is that boundary.
    offset = 0
    cases = []
    for k in range(len(tokens) - 1):
        offset += len(tokens[k])
        a, b = tokens[k], tokens[k + 1]
        if len(a) >= 2 and len(b) >= 2:
            stop = a[-2:] + b[:2]
            if text.find(stop) == offset - 2:
                cases.append((stop, text[: offset - 2]))
    assert len(cases) >= 3, tokens
    for stop, expected in cases[:3]:
        r = complete(server, max_tokens=48, temperature=0, stop=[stop, "never appears"])
        assert r["choices"][0]["text"] == expected
        assert r["choices"][0]["finish_reason"] == "stop"
        events, done = stream_events(server.url + "/v1/completions",
                                     {"prompt": PROMPT, "max_tokens": 48, "temperature": 0, "stop": stop,
                                      "stream": True})
        # The concatenation is exactly the text before the stop string: no delta ever held part of it.
        assert done and joined_text(events, False) == [expected]
        assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_n_choices_prefill_their_prompt_once(server):
    # A 300-token prompt no earlier test sent (no prefix-cache hits): n=4 computes it once, and each
    # choice is the single request with seed + i.
    prompt = [1] + [260 + (i * 37) % 240 for i in range(299)]
    body = {"prompt": prompt, "max_tokens": 16, "temperature": 0.9, "seed": 4242}
    before = server.metrics()["kestrel_prompt_tokens_computed_total"]
    r = complete(server, n=4, **body)
    computed = server.metrics()["kestrel_prompt_tokens_computed_total"] - before
    assert r["usage"]["prompt_tokens"] == 300
    assert computed == 300, computed
    singles = [complete(server, **dict(body, seed=4242 + i))["choices"][0]["text"] for i in range(4)]
    assert [c["text"] for c in sorted(r["choices"], key=lambda c: c["index"])] == singles
    assert len(set(singles)) > 1


def test_n_choices_match_single_requests_with_consecutive_seeds(server):
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 1.0, "seed": 77}
    r = complete(server, n=2, **{k: v for k, v in body.items() if k != "prompt"})
    assert [c["index"] for c in r["choices"]] == [0, 1]
    singles = [complete(server, **dict(body, seed=77 + i))["choices"][0]["text"] for i in range(2)]
    assert [c["text"] for c in r["choices"]] == singles
    assert singles[0] != singles[1]
    assert r["usage"]["prompt_tokens"] == 5
    assert r["usage"]["completion_tokens"] == 48

    client = server.openai()
    c = client.chat.completions.create(model="stories", messages=[{"role": "user", "content": "Hi"}], n=2,
                                       max_tokens=6, seed=3)
    assert sorted(ch.index for ch in c.choices) == [0, 1]
    events, done = stream_events(server.url + "/v1/chat/completions",
                                 {"messages": [{"role": "user", "content": "Hi"}], "n": 2, "max_tokens": 6,
                                  "seed": 3, "stream": True})
    assert done and joined_text(events, True, n=2) == [ch.message.content for ch in sorted(c.choices, key=lambda x: x.index)]


def test_completion_logprobs_are_those_of_the_sampled_tokens(server):
    # Greedy: each chosen token is the most likely one.
    r = complete(server, max_tokens=20, temperature=0, logprobs=3)
    lp = r["choices"][0]["logprobs"]
    assert "".join(lp["tokens"]) == r["choices"][0]["text"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 20
    for tok, chosen, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert chosen <= 0 and 3 <= len(top) <= 4
        assert math.isclose(chosen, max(top.values()), abs_tol=1e-6)
        assert math.isclose(top[tok], chosen, abs_tol=1e-6)
    assert lp["text_offset"][0] == 0
    assert lp["text_offset"][1] == len(lp["tokens"][0])

    # Sampled: the chosen token's logprob is its own, never above the most likely one's.
    r = complete(server, max_tokens=40, temperature=1.0, seed=9, logprobs=5)
    lp = r["choices"][0]["logprobs"]
    assert "".join(lp["tokens"]) == r["choices"][0]["text"]
    for tok, chosen, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert chosen <= max(top.values()) + 1e-6
        assert math.isclose(top[tok], chosen, abs_tol=1e-6)
    assert sum(lp["token_logprobs"]) < 0

    # The stream carries the same logprobs.
    events, _ = stream_events(server.url + "/v1/completions",
                              {"prompt": PROMPT, "max_tokens": 40, "temperature": 1.0, "seed": 9, "logprobs": 5,
                               "stream": True})
    streamed = [t for e in events for c in e["choices"] if c["logprobs"] for t in c["logprobs"]["tokens"]]
    assert streamed == lp["tokens"]


def test_chat_logprobs(server):
    client = server.openai()
    r = client.chat.completions.create(model="stories", messages=[{"role": "user", "content": "Hi"}], max_tokens=12,
                                       temperature=0.8, seed=2, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) >= 1
    assert bytes(b for t in content for b in t.bytes).decode("utf-8") == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 2
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        assert t.logprob <= t.top_logprobs[0].logprob + 1e-6
    r = client.chat.completions.create(model="stories", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                       logprobs=True)
    assert all(t.top_logprobs == [] for t in r.choices[0].logprobs.content)
    r = client.chat.completions.create(model="stories", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert r.choices[0].logprobs is None


def test_echo_and_token_id_prompts(server):
    # The prompt as the server tokenizes it: BOS (id 1 in the llama2.c vocabulary) and the pieces.
    ids = [1] + [int(t) for t in subprocess.run([str(kestrel_binary()), "tokenize", "-m", str(stories_model()), PROMPT],
                                                capture_output=True, text=True, check=True).stdout.split()]
    by_text = complete(server, max_tokens=12, temperature=0)
    by_ids = complete(server, prompt=ids, max_tokens=12, temperature=0)
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]
    assert by_ids["usage"]["prompt_tokens"] == len(ids) == by_text["usage"]["prompt_tokens"]
    assert complete(server, prompt=[ids], max_tokens=12, temperature=0)["choices"][0]["text"] == by_text["choices"][0]["text"]

    echoed = complete(server, max_tokens=12, temperature=0, echo=True)
    assert echoed["choices"][0]["text"] == PROMPT + by_text["choices"][0]["text"]
    events, _ = stream_events(server.url + "/v1/completions",
                              {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "echo": True, "stream": True})
    assert events[0]["choices"][0]["text"] == PROMPT
    assert joined_text(events, False) == [echoed["choices"][0]["text"]]


def test_ignore_eos_and_no_max_tokens_runs_to_the_end_of_the_context(server):
    r = complete(server, temperature=0, ignore_eos=True)
    assert r["usage"]["completion_tokens"] == STORIES_CTX - 5
    assert r["choices"][0]["finish_reason"] == "length"
    r = complete(server, max_tokens=300, temperature=0, ignore_eos=True)
    assert r["usage"]["completion_tokens"] == 300


def test_prompt_longer_than_the_context_is_refused(server):
    r = server.post("/v1/completions", {"prompt": [1] * STORIES_CTX, "max_tokens": 1})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "prompt" and err["code"] == "context_length_exceeded"
    assert str(STORIES_CTX) in err["message"]
    r = server.post("/v1/completions", {"prompt": [1] * (STORIES_CTX - 1), "max_tokens": 1})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == STORIES_CTX - 1
    r = server.post("/v1/completions", {"prompt": [1] * 100, "max_tokens": STORIES_CTX - 99})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert str(STORIES_CTX - 100) in r.json()["error"]["message"]


def test_concurrent_streams(server):
    def one(i):
        events, done = stream_events(server.url + "/v1/completions",
                                     {"prompt": PROMPT, "max_tokens": 40, "temperature": 0.8, "seed": i,
                                      "stream": True})
        return done, joined_text(events, False)[0]

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(32)))
    assert all(done for done, _ in results)
    # Same seed, same text, whatever else shares the batch.
    again = complete(server, max_tokens=40, temperature=0.8, seed=3)["choices"][0]["text"]
    assert results[3][1] == again


def test_metrics(server):
    # The same long prompt twice: the second finds its blocks in the prefix cache.
    # Requested prompt tokens count both; computed ones only the first's and the second's tail.
    long_prompt = PROMPT + " there was a little girl named Lily." * 8
    complete(server, prompt=long_prompt, max_tokens=2)
    m1 = server.metrics()
    n_prompt = complete(server, prompt=long_prompt, max_tokens=2)["usage"]["prompt_tokens"]
    m = server.metrics()
    assert n_prompt > 64
    assert m["kestrel_prompt_tokens_total"] - m1["kestrel_prompt_tokens_total"] == n_prompt
    computed = m["kestrel_prompt_tokens_computed_total"] - m1["kestrel_prompt_tokens_computed_total"]
    # Every full 16-token block before the last token was a hit (the last token is always computed).
    assert computed == n_prompt - (n_prompt - 1) // 16 * 16, (computed, n_prompt)
    assert m['kestrel_requests_total{status="200"}'] >= 2
    assert m["kestrel_prompt_tokens_total"] > 0 and m["kestrel_generation_tokens_total"] > 0
    for h in ("kestrel_time_to_first_token_seconds", "kestrel_time_per_output_token_seconds",
              "kestrel_e2e_request_latency_seconds"):
        buckets = [(k, v) for k, v in m.items() if k.startswith(h + "_bucket")]
        assert buckets[-1][0] == h + '_bucket{le="+Inf"}'
        counts = [v for _, v in buckets]
        assert counts == sorted(counts) and counts[-1] == m[h + "_count"] > 0
    assert m["kestrel_num_requests_running"] == 0 and m["kestrel_num_requests_waiting"] == 0
    assert m["kestrel_kv_blocks_used"] == 0 and m["kestrel_kv_blocks_total"] > 0
    assert 0 < m["kestrel_prefix_cache_hit_rate"] <= 1
    assert m["kestrel_preemptions_total"] >= 0
    # Without --swap-space there is no host pool and no preemption goes by swap.
    assert m["kestrel_swap_blocks"] == 0 and m["kestrel_swap_preemptions_total"] == 0
    assert m["kestrel_kv_blocks_swapped_out_total"] == m["kestrel_kv_blocks_swapped_in_total"] == 0
    # Without --cpu-offload-kv-gb there is no host tier.
    assert m["kestrel_kv_offload_blocks"] == 0 and m["kestrel_kv_blocks_offloaded_total"] == 0
    assert m["kestrel_kv_offload_hits_total"] == 0
    text = requests.get(server.url + "/metrics", timeout=10).text
    assert "# TYPE kestrel_time_to_first_token_seconds histogram" in text


def test_routes_and_methods(server):
    r = requests.get(server.url + "/v1/completions", timeout=10)
    assert r.status_code == 405 and r.headers["Allow"] == "POST" and "error" in r.json()
    r = requests.post(server.url + "/v1/unknown", json={}, timeout=10)
    assert r.status_code == 404 and "error" in r.json()
    r = requests.post(server.url + "/health", timeout=10)
    assert r.status_code == 405


def test_api_key():
    require(kestrel_binary())
    require(stories_model())
    s = Server(stories_model(), "--api-key", "sekrit", "--max-model-len", "256")
    try:
        body = {"prompt": PROMPT, "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
            r = s.post("/v1/completions", body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert requests.get(s.url + "/v1/models", timeout=10).status_code == 401
        assert s.post("/v1/completions", body, headers={"Authorization": "Bearer sekrit"}).status_code == 200
        r = s.openai(api_key="sekrit").completions.create(model=s.name, prompt=PROMPT, max_tokens=2)
        assert r.usage.completion_tokens == 2
        import openai

        with pytest.raises(openai.AuthenticationError):
            s.openai(api_key="wrong").completions.create(model=s.name, prompt=PROMPT, max_tokens=2)
        # Health and metrics stay open for probes and scrapers.
        assert requests.get(s.url + "/health", timeout=10).status_code == 200
        assert requests.get(s.url + "/metrics", timeout=10).status_code == 200
    finally:
        rc, out = s.stop()
        assert rc == 0, out


def test_echo_lists_the_first_word_as_the_text_it_covers(server):
    """SentencePiece tokenizes "Once" as "▁Once": echoed, the token is the text it covers ("Once" at
    offset 0), not " Once"; the chosen token's entry in top_logprobs has the same text."""
    r = complete(server, max_tokens=1, temperature=0, echo=True, logprobs=1)
    lp = r["choices"][0]["logprobs"]
    text = r["choices"][0]["text"]
    assert lp["tokens"][:3] == ["<s>", "Once", " upon"]
    assert lp["text_offset"][:3] == [0, 0, 4]
    for token, at, top in list(zip(lp["tokens"], lp["text_offset"], lp["top_logprobs"]))[1:]:
        assert text[at:at + len(token)] == token
        assert token in top


@pytest.mark.parametrize("api, extra, param, words", [
    ("completions", {"response_format": {"type": "structural_tag"}}, "response_format", "structural_tag"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"uniqueItems": True}}}},
     "response_format", "uniqueItems"),
    ("completions", {"suffix": " The end."}, "suffix", "suffix is not supported"),
    ("chat", {"n": 2, "best_of": 3}, "best_of", "completions field"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice", "\"auto\""),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"}, "tool_choice",
     "does not return tool calls"),
])
def test_fields_the_server_cannot_honour_are_400s(server, api, extra, param, words):
    """They were ignored: a 200 the client took for what it asked."""
    body = {"prompt": PROMPT} if api == "completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    r = server.post("/v1/completions" if api == "completions" else "/v1/chat/completions", dict(body, max_tokens=2, **extra))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert words in r.json()["error"]["message"]


def test_fields_served_as_vllm_serves_them(server):
    assert complete(server, max_tokens=2, response_format={"type": "text"}, n=2, best_of=2)["choices"][1]["index"] == 1
    r = chat(server, max_tokens=2, tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="none")
    assert r["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("field", ["response_format", "structured_outputs", "guided_json", "json_schema"])
def test_structured_output_follows_the_schema(server, field):
    """Sampled at temperature 1, every choice is JSON that satisfies the schema (checked by hand below),
    and ends with "stop" once the object is closed."""
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
              "properties": {"name": {"type": "string", "maxLength": 10},
                             "age": {"type": "integer", "minimum": 1, "maximum": 99},
                             "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2}}}
    extra = {"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}},
             "structured_outputs": {"json": schema}, "guided_json": schema, "json_schema": schema}[field]
    body = dict(prompt=PROMPT, max_tokens=200, temperature=1.0, n=4, seed=5)
    body[field] = extra
    r = server.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert choice["finish_reason"] == "stop", choice
        value = json.loads(choice["text"])
        assert set(value) <= {"name", "age", "pets"} and {"name", "age"} <= set(value), value
        assert isinstance(value["name"], str) and len(value["name"]) <= 10, value
        assert isinstance(value["age"], int) and 1 <= value["age"] <= 99, value
        assert all(p in ("cat", "dog") for p in value.get("pets", [])) and len(value.get("pets", [])) <= 2, value


def test_hostile_grammars_are_400s_and_the_server_serves_on(server):
    """Each of these killed the server (a stack overflow) or held its engine for tens of seconds."""
    deep = 20000
    cases = [("guided_regex", "(" * deep + "a" + ")" * deep, "nested deeper than 1000"),
             ("guided_grammar", "root ::= " + "(" * deep + '"a"' + ")" * deep, "nested deeper than 1000"),
             ("guided_regex", "(((((a?){0,8}){0,8}){0,8}){0,8}){0,8}", "too ambiguous")]
    for field, text, words in cases:
        # min_tokens holds EOS back, so the ambiguous grammar's parses pile up to the bound.
        r = server.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 400, "min_tokens": 400, field: text})
        assert r.status_code == 400, r.text[:300]
        assert words in r.json()["error"]["message"], r.text[:300]
    r = server.post("/v1/completions", dict(prompt=PROMPT, max_tokens=4, guided_regex="(a?){0,99999}"))
    assert r.status_code == 200, r.text[:300]
    assert re.fullmatch("a*", r.json()["choices"][0]["text"]), r.text
    r = server.post("/v1/completions", dict(prompt=PROMPT, max_tokens=4, temperature=0))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text


def test_structured_output_regex_and_choice(server):
    r = server.post("/v1/completions", dict(prompt=PROMPT, max_tokens=30, temperature=1.0, n=4, seed=2,
                                            guided_regex="(Lily|Tom) has [1-9] (cats|dogs)\\."))
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert re.fullmatch(r"(Lily|Tom) has [1-9] (cats|dogs)\.", choice["text"]), choice
    r = server.post("/v1/completions", dict(prompt=PROMPT, max_tokens=10, temperature=1.0, n=4, seed=2,
                                            structured_outputs={"choice": ["red", "green", "blue"]}))
    assert r.status_code == 200, r.text
    assert all(c["text"] in ("red", "green", "blue") and c["finish_reason"] == "stop" for c in r.json()["choices"])
