"""Disaggregated prefill across processes (vLLM's flow, pull model): a producer `kestrel serve
--kv-transfer-config '{"kv_role": "kv_producer"}'` prefills each request (max_tokens 1,
kv_transfer_params.do_remote_decode) and holds its K/V; a consumer (kv_role kv_consumer) gets the
original request with the producer's kv_transfer_params, pulls the K/V over HTTP and decodes. The
reference is one plain `kestrel serve` of the same model: greedy outputs must be token-identical.
Aborts anywhere (a pull that never comes, a client that leaves the consumer, a producer that is
gone) end with an error or a freed block, never a hang: afterwards both sides hold no block."""

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from conftest import Server, kestrel_binary, require, stories_model

COMMON = ("--max-model-len", "512", "--block-size", "8", "--num-kv-blocks", "512")
HOLD_TIMEOUT_S = 3


@pytest.fixture(scope="module")
def sides():
    require(kestrel_binary())
    require(stories_model())
    producer = Server(stories_model(), *COMMON, "--kv-transfer-config",
                      json.dumps({"kv_role": "kv_producer", "abort_request_timeout": HOLD_TIMEOUT_S}), name="stories")
    consumer = Server(stories_model(), *COMMON, "--kv-transfer-config",
                      json.dumps({"kv_role": "kv_consumer", "kv_pull_timeout": 10}), name="stories")
    single = Server(stories_model(), *COMMON, name="stories")
    yield producer, consumer, single
    for s in (producer, consumer, single):
        rc, out = s.stop()
        assert rc == 0, out


def prefill(producer, body):
    """The router's first half: the request with max_tokens 1 to the producer; its kv_transfer_params."""
    r = producer.post("/v1/completions", {**body, "max_tokens": 1, "stream": False,
                                          "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True
    return params


def disaggregated(producer, consumer, body):
    params = prefill(producer, body)
    return consumer.post("/v1/completions", {**body, "kv_transfer_params": params})


def request_body(i):
    starts = ["Once upon a time", "One day", "Lily and Ben", "The little dog"]
    names = ["Tom", "Sue", "a cat", "the sun", "Max", "a bird", "Mia", "the king"]
    return {"model": "stories", "prompt": f"{starts[i % 4]} {names[i // 4]} went to the park and",
            "max_tokens": 40, "temperature": 0, "logprobs": 0}


def token_texts(response_json):
    return response_json["choices"][0]["logprobs"]["tokens"]


def used(server):
    m = server.metrics()
    return m["kestrel_kv_blocks_used"], m["kestrel_kv_transfer_held_requests"]


def wait_idle(server, timeout=10):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if used(server) == (0, 0):
            return True
        time.sleep(0.1)
    return False


def test_32_requests_match_one_process(sides):
    producer, consumer, single = sides
    bodies = [request_body(i) for i in range(32)]
    computed_before = consumer.metrics()["kestrel_prompt_tokens_computed_total"]
    with ThreadPoolExecutor(8) as pool:
        want = list(pool.map(lambda b: single.post("/v1/completions", b), bodies))
        got = list(pool.map(lambda b: disaggregated(producer, consumer, b), bodies))
    for i, (w, g) in enumerate(zip(want, got)):
        assert w.status_code == 200 and g.status_code == 200, (w.text, g.text)
        assert token_texts(g.json()) == token_texts(w.json()), f"request {i}"
        assert g.json()["choices"][0]["text"] == w.json()["choices"][0]["text"]
        assert g.json()["usage"] == w.json()["usage"]
    # The consumer computed only each prompt's last token; the K/V of the rest came from the producer.
    assert consumer.metrics()["kestrel_prompt_tokens_computed_total"] - computed_before == len(bodies)
    assert wait_idle(producer) and wait_idle(consumer)


def test_streamed_consumer_and_producer_prefix_cache(sides):
    producer, consumer, single = sides
    body = request_body(5)
    want = single.post("/v1/completions", body).json()["choices"][0]["text"]
    first = prefill(producer, body)
    consumer.post("/v1/completions", {**body, "kv_transfer_params": first})
    # The same prompt again: the producer's prefix cache holds its full blocks, and the transfer
    # still carries every block of the prompt.
    hits_before = producer.metrics()["kestrel_prefix_cache_hit_rate"]
    params = prefill(producer, body)
    assert producer.metrics()["kestrel_prefix_cache_hit_rate"] > hits_before
    assert params["num_computed_tokens"] == first["num_computed_tokens"]
    assert len(params["remote_block_ids"]) == (params["num_computed_tokens"] + 7) // 8
    r = consumer.post("/v1/completions", {**body, "stream": True, "kv_transfer_params": params}, stream=True)
    assert r.status_code == 200
    text = ""
    for line in r.iter_lines():
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            text += json.loads(line[6:])["choices"][0]["text"]
    assert text == want
    assert wait_idle(producer) and wait_idle(consumer)


def test_unpulled_blocks_are_freed_after_the_timeout(sides):
    producer, consumer, _ = sides
    params = prefill(producer, request_body(7))
    assert used(producer)[1] == 1 and used(producer)[0] > 0
    time.sleep(HOLD_TIMEOUT_S + 0.5)
    assert used(producer) == (0, 0)
    # The consumer's pull then finds nothing: an error naming the transfer, not a hang.
    r = consumer.post("/v1/completions", {**request_body(7), "kv_transfer_params": params}, timeout=30)
    assert r.status_code == 502, r.text
    assert "holds no K/V" in r.json()["error"]["message"]
    assert wait_idle(consumer)


def test_client_leaving_the_consumer_mid_decode_frees_its_blocks(sides):
    producer, consumer, _ = sides
    body = {**request_body(9), "max_tokens": 400, "stream": True}
    params = prefill(producer, body)
    r = consumer.post("/v1/completions", {**body, "kv_transfer_params": params}, stream=True)
    lines = r.iter_lines()
    assert next(l for l in lines if l.startswith(b"data: "))
    r.close()  # the client leaves mid-stream
    assert wait_idle(consumer) and wait_idle(producer)


def test_errors_from_either_side_are_answers(sides):
    producer, consumer, single = sides
    body = request_body(11)
    # A producer that is not there (nothing listens on the port of a stopped server).
    gone = Server(stories_model(), *COMMON, "--kv-transfer-config", json.dumps({"kv_role": "kv_producer"}), name="stories")
    params = prefill(gone, body)
    gone.stop()
    t0 = time.time()
    r = consumer.post("/v1/completions", {**body, "kv_transfer_params": params}, timeout=30)
    assert r.status_code == 502 and "connecting" in r.json()["error"]["message"], r.text
    assert time.time() - t0 < 10
    # Another prompt's K/V: refused by the consumer.
    params = prefill(producer, body)
    r = consumer.post("/v1/completions", {**request_body(12), "kv_transfer_params": params})
    assert r.status_code == 400 and "another prompt" in r.json()["error"]["message"], r.text
    # Roles: a plain server takes neither side; bad parameters name their field.
    r = single.post("/v1/completions", {**body, "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 400 and "kv_producer" in r.json()["error"]["message"]
    r = consumer.post("/v1/completions", {**body, "kv_transfer_params": {"do_remote_prefill": True, "remote_port": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params.remote_host"
    r = requests.get(producer.url + "/v1/kv_transfer/999999", timeout=10)
    assert r.status_code == 404
    assert wait_idle(producer) and wait_idle(consumer)
    # Both sides keep serving.
    r = disaggregated(producer, consumer, request_body(13))
    assert r.status_code == 200


def test_bad_kv_transfer_config_is_refused_at_start():
    require(kestrel_binary())
    require(stories_model())
    with pytest.raises(RuntimeError, match="kv_role"):
        Server(stories_model(), "--kv-transfer-config", '{"kv_role": "decode"}')
