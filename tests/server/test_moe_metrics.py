"""Expert usage in /metrics: kestrel_moe_expert_tokens_total{layer,expert} for a mixture-of-experts
model (the tiny random-weight Mixtral of ../shared/data/hf-tiny: 3 layers, all MoE, 8 experts,
top-2), none for a dense model."""

import os
import re
import time
from pathlib import Path

import pytest
import requests

from conftest import REPO, Server, kestrel_binary, require

NAME = "kestrel_moe_expert_tokens_total"
N_LAYER, N_EXPERT, TOP_K = 3, 8, 2


def mixtral_tiny():
    return Path(os.environ.get("KESTREL_DATA_DIR", REPO.parent / "shared" / "data")) / "hf-tiny" / "mixtral-tiny"


@pytest.fixture(scope="module")
def moe_server():
    require(kestrel_binary())
    require(mixtral_tiny() / "config.json")
    s = Server(mixtral_tiny(), "--max-model-len", "256", name="mixtral-tiny")
    yield s
    rc, out = s.stop()
    assert rc == 0, out


def expert_counts(metrics):
    """{(layer, expert): count} from the parsed samples."""
    out = {}
    for key, value in metrics.items():
        m = re.fullmatch(NAME + r'\{layer="(\d+)",expert="(\d+)"\}', key)
        if m:
            out[(int(m.group(1)), int(m.group(2)))] = value
        else:
            assert not key.startswith(NAME), key
    return out


def fed_tokens(metrics):
    """Tokens run through the model so far, when every request has finished: computed prompt tokens
    plus generated ones less the last token of each request (sampled, never fed back)."""
    return (metrics["kestrel_prompt_tokens_computed_total"] + metrics["kestrel_generation_tokens_total"]
            - sum(v for k, v in metrics.items() if k.startswith("kestrel_request_finished_total{")))


def settled_metrics(server):
    """/metrics once the engine thread has published the step that finished the last request (it
    answers the request just before it publishes)."""
    deadline = time.time() + 10
    while True:
        m = server.metrics()
        if m["kestrel_num_requests_running"] == 0 and all(
                sum(v for (layer, _), v in expert_counts(m).items() if layer == l) == TOP_K * fed_tokens(m)
                for l in range(N_LAYER)):
            return m
        if time.time() > deadline:
            return m
        time.sleep(0.05)


def test_expert_counters_per_moe_layer(moe_server):
    text = requests.get(moe_server.url + "/metrics", timeout=10).text
    assert f"# TYPE {NAME} counter" in text and f"# HELP {NAME} " in text
    # Every (layer, expert) pair, from start-up on, at 0 before any request.
    before = expert_counts(moe_server.metrics())
    assert sorted(before) == [(l, e) for l in range(N_LAYER) for e in range(N_EXPERT)]
    for prompt, n in (("Once upon a time", 6), ("The quick brown fox jumps over the lazy dog", 3)):
        r = moe_server.post("/v1/completions", {"prompt": prompt, "max_tokens": n, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1
    m = settled_metrics(moe_server)
    counts = expert_counts(m)
    assert sorted(counts) == sorted(before)
    fed = fed_tokens(m)
    assert fed >= 2 * 3
    for layer in range(N_LAYER):
        # Each token a layer runs picks top-2 distinct experts: the layer's counts sum to 2 per token.
        assert sum(counts[(layer, e)] for e in range(N_EXPERT)) == TOP_K * fed, (layer, counts, fed)
        assert max(counts[(layer, e)] for e in range(N_EXPERT)) <= fed
    assert all(counts[key] >= before[key] for key in counts)


def test_dense_model_has_no_expert_counters(server):
    r = server.post("/v1/completions", {"prompt": "Once", "max_tokens": 2})
    assert r.status_code == 200, r.text
    text = requests.get(server.url + "/metrics", timeout=10).text
    assert NAME not in text
