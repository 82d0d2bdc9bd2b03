"""Speculative decoding through the server (--speculative-config, stories260K; n-gram drafts, and a
draft model: stories260K as its own draft): streamed and whole completions carry the same greedy text
as a server without drafts, a stream's chunks may carry several tokens, and /metrics counts the
drafts under vLLM's spec_decode names."""

import json
import subprocess

import pytest

from conftest import Server, kestrel_binary, require, stories_model
from sse import joined_text, stream_events

SPEC = '{"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_min": 1}'
PROMPTS = ["Once upon a time, there was a little girl named Lily", "One day, a big dog", "Long ago, a shy bunny"]


def completions(s, stream):
    out = []
    for p in PROMPTS:
        body = {"model": s.name, "prompt": p, "max_tokens": 60, "temperature": 0, "stream": stream}
        if stream:
            events, done = stream_events(s.url + "/v1/completions", body)
            assert done
            out.append(joined_text(events, chat=False)[0])
        else:
            r = s.post("/v1/completions", body)
            assert r.status_code == 200, r.text
            out.append(r.json()["choices"][0]["text"])
    return out


def plain_completions():
    plain = Server(stories_model(), "--max-model-len", "512", name="stories-plain")
    try:
        want = completions(plain, stream=False)
    finally:
        rc, out = plain.stop()
    assert rc == 0, out
    return want


def draft_model_spec(k):
    return json.dumps({"method": "draft_model", "model": str(stories_model()), "num_speculative_tokens": k})


def test_speculative_server_matches_plain_and_counts_drafts():
    require(kestrel_binary())
    require(stories_model())
    want = plain_completions()
    spec = Server(stories_model(), "--max-model-len", "512", "--speculative-config", SPEC, name="stories-spec")
    try:
        assert completions(spec, stream=False) == want
        assert completions(spec, stream=True) == want
        m = spec.metrics()
        drafts = m["kestrel_spec_decode_num_drafts_total"]
        draft_tokens = m["kestrel_spec_decode_num_draft_tokens_total"]
        accepted = m["kestrel_spec_decode_num_accepted_tokens_total"]
        assert drafts > 0 and 0 < accepted <= draft_tokens <= 6 * drafts
        per_pos = [m[f'kestrel_spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}'] for i in range(6)]
        assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
    finally:
        rc, out = spec.stop()
    assert rc == 0, out


def test_bad_speculative_config_names_the_flag():
    require(kestrel_binary())
    require(stories_model())
    r = subprocess.run([str(kestrel_binary()), "serve", "-m", str(stories_model()), "--port", "0",
                        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "--speculative-config" in r.stderr and "num_speculative_tokens" in r.stderr


def test_draft_model_server_matches_plain():
    require(kestrel_binary())
    require(stories_model())
    want = plain_completions()
    spec = Server(stories_model(), "--max-model-len", "512", "--speculative-config", draft_model_spec(4),
                  name="stories-draft")
    try:
        assert completions(spec, stream=False) == want
        assert completions(spec, stream=True) == want
        m = spec.metrics()
        drafts = m["kestrel_spec_decode_num_drafts_total"]
        accepted = m["kestrel_spec_decode_num_accepted_tokens_total"]
        # The draft is the target: every greedy draft is the target's argmax.
        assert drafts > 0 and 0 < accepted == m["kestrel_spec_decode_num_draft_tokens_total"] <= 4 * drafts
    finally:
        rc, out = spec.stop()
    assert rc == 0, out


def test_draft_model_with_another_vocabulary_names_the_flag():
    require(kestrel_binary())
    require(stories_model())
    tiny = stories_model().parent.parent / "llama-2-tiny-random" / "llama-2-tiny-random.gguf"
    require(tiny)
    r = subprocess.run([str(kestrel_binary()), "serve", "-m", str(stories_model()), "--port", "0",
                        "--speculative-config",
                        json.dumps({"model": str(tiny), "num_speculative_tokens": 3})],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "--speculative-config" in r.stderr and "32000 tokens" in r.stderr
