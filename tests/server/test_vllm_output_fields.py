"""vLLM's output and token-filter fields on /v1/completions, /v1/chat/completions and batch lines:
include_stop_str_in_output, skip_special_tokens, spaces_between_special_tokens, allowed_token_ids,
bad_words, truncate_prompt_tokens, priority, and the stop_reason of each choice; min_tokens beyond
the context. Greedy decoding of stories260K (and SmolLM2 for chat) gives the text each field must
change."""

import json
import subprocess

import pytest

from conftest import kestrel_binary, stories_model
from sse import joined_text, stream_events
from vllm_requests import C, CH, PROMPT, choice, complete, greedy_ids


def refused(server, path, body, param):
    r = server.post(path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    return err["message"]


def token_text(server, token_id):
    """A token's own text (stripped: /detokenize drops SentencePiece's leading space of a first piece)."""
    r = server.post("/detokenize", {"tokens": [token_id]})
    assert r.status_code == 200, r.text
    return r.json()["prompt"].strip()


def tokenize(server, text, special=True):
    r = server.post("/tokenize", {"prompt": text, "add_special_tokens": special})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_include_stop_str_in_output(server):
    text = choice(complete(server, max_tokens=40, ignore_eos=True))["text"]
    stop = next(s for s in (" was ", " the ", ".", ",", " a ") if s in text)
    at = text.find(stop)
    cut = complete(server, max_tokens=40, ignore_eos=True, stop=[stop])
    assert choice(cut)["text"] == text[:at] and choice(cut)["stop_reason"] == stop
    kept = complete(server, max_tokens=40, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)
    assert choice(kept)["text"] == text[:at + len(stop)]
    assert choice(kept)["text"].endswith(stop)
    assert choice(kept)["finish_reason"] == "stop" and choice(kept)["stop_reason"] == stop
    for chat in (False, True):
        body = {"max_tokens": 40, "temperature": 0, "ignore_eos": True, "stop": [stop],
                "include_stop_str_in_output": True, "stream": True}
        body.update({"messages": [{"role": "user", "content": PROMPT}]} if chat else {"prompt": PROMPT})
        events, done = stream_events(server.url + (CH if chat else C), body)
        assert done
        streamed = joined_text(events, chat)[0]
        assert streamed.endswith(stop), streamed
        last = [c for e in events for c in e["choices"] if c["finish_reason"]]
        assert len(last) == 1 and last[0]["finish_reason"] == "stop" and last[0]["stop_reason"] == stop, last
        if not chat:
            assert streamed == text[:at + len(stop)]


def test_stop_reason(server, chat_server):
    _, g = greedy_ids(20)
    k = next(i for i in range(3, 20) if g[i] not in g[:i])
    r = complete(server, max_tokens=20, stop_token_ids=[g[k]])
    assert choice(r)["finish_reason"] == "stop" and choice(r)["stop_reason"] == g[k], r
    r = complete(server, max_tokens=3, ignore_eos=True)
    assert choice(r)["finish_reason"] == "length" and choice(r)["stop_reason"] is None
    # Streamed: the last chunk of the choice carries it.
    events, done = stream_events(server.url + C, {"prompt": PROMPT, "max_tokens": 20, "temperature": 0,
                                                  "stop_token_ids": [g[k]], "stream": True})
    assert done and events[-1]["choices"][0]["stop_reason"] == g[k]
    # The end of turn (EOS for vLLM): null, in the message and the stream.
    body = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 64,
            "temperature": 0}
    r = chat_server.post(CH, body)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert c["finish_reason"] == "stop" and "stop_reason" in c and c["stop_reason"] is None, c
    events, done = stream_events(chat_server.url + CH, dict(body, stream=True))
    last = [c for e in events for c in e["choices"] if c["finish_reason"]]
    assert done and last[0]["stop_reason"] is None and "stop_reason" in last[0]


def test_skip_special_tokens_and_the_end_of_turn_text(server, chat_server):
    # BOS, forced through allowed_token_ids: its text only with skip_special_tokens false.
    bos_text = token_text(server, 1)
    assert bos_text == "<s>"
    plain = complete(server, max_tokens=3, allowed_token_ids=[1])
    assert choice(plain)["text"] == ""
    for spaces in (True, False):  # kestrel's decoder puts no space around a special token either way
        shown = complete(server, max_tokens=3, allowed_token_ids=[1], skip_special_tokens=False,
                         spaces_between_special_tokens=spaces)
        assert choice(shown)["text"] == bos_text * 3
    # SmolLM2's <|im_end|> ends the answer: with include_stop_str_in_output and skip_special_tokens
    # false its text ends the content.
    body = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 64,
            "temperature": 0}
    answer = chat_server.post(CH, body).json()["choices"][0]["message"]["content"]
    r = chat_server.post(CH, dict(body, skip_special_tokens=False, include_stop_str_in_output=True))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == answer + "<|im_end|>"
    r = chat_server.post(CH, dict(body, include_stop_str_in_output=True))  # skipped as special
    assert r.json()["choices"][0]["message"]["content"] == answer
    for bad in ("false", 0, [True]):
        refused(server, C, {"prompt": PROMPT, "skip_special_tokens": bad}, "skip_special_tokens")
        refused(server, C, {"prompt": PROMPT, "spaces_between_special_tokens": bad}, "spaces_between_special_tokens")
        refused(server, C, {"prompt": PROMPT, "include_stop_str_in_output": bad}, "include_stop_str_in_output")


def test_allowed_token_ids(server):
    _, g = greedy_ids(8)
    words = [t for t in tokenize(server, " Once upon a time there was a little girl named Lily. She", False)
             if t != g[0]]
    allowed = sorted(set(words))
    texts = {token_text(server, t) for t in allowed}
    free = choice(complete(server, max_tokens=8, logprobs=0))
    r = choice(complete(server, max_tokens=8, logprobs=0, allowed_token_ids=allowed))
    tokens = r["logprobs"]["tokens"]
    assert len(tokens) == 8
    assert all(t.strip() in texts for t in tokens), (tokens, texts)
    assert tokens[0] != free["logprobs"]["tokens"][0]
    # Chat and streamed alike.
    events, done = stream_events(server.url + CH, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6,
                                                   "temperature": 0, "allowed_token_ids": allowed, "stream": True,
                                                   "logprobs": True})
    chunks = [c for e in events for c in e["choices"] if c.get("logprobs")]
    assert done and all(x["token"].strip() in texts for c in chunks for x in c["logprobs"]["content"])
    assert "outside the vocabulary" in refused(server, C, {"prompt": PROMPT, "allowed_token_ids": [5, 512]},
                                               "allowed_token_ids")
    refused(server, C, {"prompt": PROMPT, "allowed_token_ids": []}, "allowed_token_ids")
    refused(server, C, {"prompt": PROMPT, "allowed_token_ids": [1, "2"]}, "allowed_token_ids[1]")


def test_bad_words(server):
    _, g = greedy_ids(30)
    free = choice(complete(server, max_tokens=30, ignore_eos=True, logprobs=0))["logprobs"]["tokens"]
    # A word of the greedy text that is one token, fresh where it first occurs.
    for k in range(2, 30):
        word = token_text(server, g[k])
        if g[k] not in g[:k] and word.isalpha() and g[k] in (tokenize(server, word, False) +
                                                             tokenize(server, " " + word, False)):
            break
    else:
        pytest.fail(f"no one-token word in {free}")
    r = choice(complete(server, max_tokens=30, ignore_eos=True, logprobs=0, bad_words=[word]))
    tokens = r["logprobs"]["tokens"]
    assert tokens[:k] == free[:k]  # greedy until the word ...
    assert tokens[k] != free[k]  # ... which is never taken
    assert free[k] not in tokens, tokens
    # Two words that tokenize as the greedy text's tokens k - 1 and k: the last is banned only right
    # after the first.
    pair = f"{token_text(server, g[k - 1])} {word}"
    if tokenize(server, pair, False) == [g[k - 1], g[k]]:
        two = choice(complete(server, max_tokens=30, ignore_eos=True, logprobs=0, bad_words=[pair]))
        assert two["logprobs"]["tokens"][:k] == free[:k] and two["logprobs"]["tokens"][k] != free[k]
    refused(server, C, {"prompt": PROMPT, "bad_words": "word"}, "bad_words")
    refused(server, C, {"prompt": PROMPT, "bad_words": ["  "]}, "bad_words[0]")
    refused(server, CH, {"messages": [{"role": "user", "content": "Hi"}], "bad_words": [3]}, "bad_words[0]")


def test_filters_that_leave_no_token_are_the_requests_error(server):
    """allowed_token_ids and bad_words that together rule out every token: a 400 (an error event of
    type invalid_request_error when streamed), not a server error; the server serves on."""
    _, g = greedy_ids(30)
    for k in range(0, 30):
        word = token_text(server, g[k])
        if word.isalpha() and g[k] in tokenize(server, word, False) + tokenize(server, " " + word, False):
            break
    else:
        pytest.fail("no one-token word in the greedy text")
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "allowed_token_ids": [g[k]], "bad_words": [word]}
    r = server.post(C, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and "no token may be sampled" in err["message"], err
    events, done = stream_events(server.url + C, dict(body, stream=True))
    errors = [e["error"] for e in events if "error" in e]
    assert done and errors and errors[0]["type"] == "invalid_request_error", events
    assert choice(complete(server, max_tokens=4))["finish_reason"] in ("stop", "length")


def test_truncate_prompt_tokens(server):
    long_prompt = "Once upon a time there was a little girl named Lily. She loved to play outside in the sun"
    ids = tokenize(server, long_prompt)
    n = 6
    r = complete(server, prompt=long_prompt, max_tokens=8, truncate_prompt_tokens=n)
    assert r["usage"]["prompt_tokens"] == n
    same = complete(server, prompt=ids[-n:], max_tokens=8)
    assert choice(r)["text"] == choice(same)["text"]
    # Echo shows the prompt the model saw.
    echo = complete(server, prompt=long_prompt, max_tokens=1, truncate_prompt_tokens=n, echo=True)
    assert choice(echo)["text"].startswith(server.post("/detokenize", {"tokens": ids[-n:]}).json()["prompt"])
    # Longer than the prompt: nothing cut.
    assert complete(server, prompt=long_prompt, max_tokens=1, truncate_prompt_tokens=500)["usage"]["prompt_tokens"] \
        == len(ids)
    assert complete(server, prompt=long_prompt, max_tokens=1, truncate_prompt_tokens=-1)["usage"]["prompt_tokens"] \
        == len(ids)
    # A prompt longer than the context is served once truncated (the text's length alone is not refused).
    huge = "Once upon a time there was a girl. " * 3000
    assert server.post(C, {"prompt": huge, "max_tokens": 1}).status_code == 400
    assert complete(server, prompt=huge, max_tokens=1, truncate_prompt_tokens=n)["usage"]["prompt_tokens"] == n
    chat = server.post(CH, {"messages": [{"role": "user", "content": long_prompt}], "max_tokens": 2,
                            "truncate_prompt_tokens": n})
    assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == n, chat.text
    for bad in (0, -2, 1.5, "6"):
        refused(server, C, {"prompt": PROMPT, "truncate_prompt_tokens": bad}, "truncate_prompt_tokens")
    assert "max_model_len" in refused(server, C, {"prompt": PROMPT, "truncate_prompt_tokens": 4096},
                                      "truncate_prompt_tokens")


def test_priority_needs_a_priority_policy(server):
    assert choice(complete(server, max_tokens=2, priority=0))["finish_reason"] == "length"
    for p in (1, -5):
        assert "priority scheduling" in refused(server, C, {"prompt": PROMPT, "priority": p}, "priority")
    refused(server, CH, {"messages": [{"role": "user", "content": "Hi"}], "priority": 2}, "priority")
    refused(server, C, {"prompt": PROMPT, "priority": "high"}, "priority")


def test_min_tokens_beyond_the_context_and_integer_ranges(server):
    n_prompt = len(tokenize(server, PROMPT))
    msg = refused(server, C, {"prompt": PROMPT, "min_tokens": 2048 - n_prompt + 1}, "min_tokens")
    assert f"at most {2048 - n_prompt}" in msg, msg
    refused(server, CH, {"messages": [{"role": "user", "content": "Hi"}], "min_tokens": 5000}, "min_tokens")
    msg = refused(server, C, {"prompt": PROMPT, "min_tokens": 2 ** 64 - 1}, "min_tokens")
    assert "[0, 9223372036854775807]" in msg, msg
    msg = refused(server, C, {"prompt": PROMPT, "stop_token_ids": [2 ** 40]}, "stop_token_ids[0]")
    assert "[0, 2147483647]" in msg, msg


def test_batch_lines(tmp_path):
    """The batch command reads the same fields and writes stop_reason."""
    _, g = greedy_ids(20)
    k = next(i for i in range(3, 20) if g[i] not in g[:i])
    allowed = sorted(set(g[:5]) | {3, 4})
    lines = [{"id": "stop", "prompt": PROMPT, "max_tokens": 20, "temperature": 0, "stop_token_ids": [g[k]]},
             {"id": "allowed", "prompt": PROMPT, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
              "allowed_token_ids": allowed},
             {"id": "priority", "prompt": PROMPT, "priority": 3}]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    subprocess.run([str(kestrel_binary()), "batch", "-m", str(stories_model()), "-i", str(src), "-o", str(dst)],
                   check=True, capture_output=True)
    out = {j["id"]: j for j in map(json.loads, dst.read_text().splitlines())}
    assert out["stop"]["stop_reason"] == g[k] and out["stop"]["output_ids"] == g[:k + 1]
    assert all(t in allowed for t in out["allowed"]["output_ids"]) and len(out["allowed"]["output_ids"]) == 10
    assert out["allowed"]["stop_reason"] is None
    assert "priority" in out["priority"]["error"]["message"]
