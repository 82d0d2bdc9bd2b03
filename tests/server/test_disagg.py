"""Disaggregated prefill across processes (vLLM's flow, pull model): a producer `kestrel serve
--kv-transfer-config '{"kv_role": "kv_producer"}'` prefills each request (max_tokens 1,
kv_transfer_params.do_remote_decode) and holds its K/V; a consumer (kv_role kv_consumer) gets the
original request with the producer's kv_transfer_params, pulls the K/V over HTTP and decodes. The
reference is one plain `kestrel serve` of the same model: greedy outputs must be token-identical,
called directly the way `kestrel router` calls the two sides, and through the router.
Aborts anywhere (a pull that never comes, a client that leaves the consumer, a producer that is
gone) end with an error or a freed block, never a hang: afterwards both sides hold no block."""

import json
import re
import subprocess
import tempfile
import time
from pathlib import Path
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


class Router:
    """A running `kestrel router` in front of the given producers and consumers."""

    def __init__(self, prefill, decode, *args):
        self.log = tempfile.NamedTemporaryFile(prefix="kestrel-router-", suffix=".log", delete=False)
        cmd = [str(kestrel_binary()), "router", "--port", "0", *args]
        for p in prefill:
            cmd += ["--prefill", p]
        for d in decode:
            cmd += ["--decode", d]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 30
        while time.time() < deadline:
            m = re.search(r"on http://[^:]+:(\d+)", Path(self.log.name).read_text())
            if m:
                self.url = f"http://127.0.0.1:{m.group(1)}"
                return
            assert self.proc.poll() is None, Path(self.log.name).read_text()
            time.sleep(0.05)
        raise RuntimeError("kestrel router did not start")

    def post(self, path, body, **kw):
        return requests.post(self.url + path, json=body, timeout=kw.pop("timeout", 120), **kw)

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=10)
        Path(self.log.name).unlink()


@pytest.fixture(scope="module")
def router(sides):
    producer, consumer, _ = sides
    r = Router([producer.url], [consumer.url], "--timeout", "20")
    yield r
    r.stop()


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


def test_router_32_requests_streamed_or_not_match_one_process(sides, router):
    producer, consumer, single = sides
    bodies = [request_body(i) for i in range(32)]

    def through_router(i_body):
        i, body = i_body
        if i % 2 == 0:
            r = router.post("/v1/completions", body)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]
        r = router.post("/v1/completions", {**body, "stream": True}, stream=True)
        assert r.status_code == 200, r.text
        text = ""
        for line in r.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
        return text

    with ThreadPoolExecutor(8) as pool:
        want = [r.json()["choices"][0]["text"] for r in pool.map(lambda b: single.post("/v1/completions", b), bodies)]
        got = list(pool.map(through_router, enumerate(bodies)))
    assert got == want
    assert wait_idle(producer) and wait_idle(consumer)


def test_router_chat_completions_match_one_process(sides, router):
    _, _, single = sides
    body = {"model": "stories", "messages": [{"role": "user", "content": "Tell me about a cat."}],
            "max_completion_tokens": 30, "temperature": 0}
    want = single.post("/v1/chat/completions", body)
    got = router.post("/v1/chat/completions", body)
    assert want.status_code == 200 and got.status_code == 200, (want.text, got.text)
    assert got.json()["choices"][0]["message"]["content"] == want.json()["choices"][0]["message"]["content"]
    assert got.json()["usage"] == want.json()["usage"]


def test_router_answers_errors_of_either_side(sides, router):
    producer, consumer, _ = sides
    # A client error from the producer is relayed as it is.
    r = router.post("/v1/completions", {**request_body(1), "temperature": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature", r.text
    # A side that is not there: an OpenAI error, quickly.
    gone = Server(stories_model(), *COMMON, name="stories")
    url = gone.url
    gone.stop()
    for prefill_url, decode_url in ((url, consumer.url), (producer.url, url)):
        lost = Router([prefill_url], [decode_url], "--timeout", "5")
        try:
            t0 = time.time()
            r = lost.post("/v1/completions", request_body(2), timeout=30)
            assert r.status_code == 502 and r.json()["error"]["type"] == "server_error", r.text
            assert time.time() - t0 < 10
        finally:
            lost.stop()
    # The producer's blocks of the request whose consumer was gone are freed by its timeout.
    time.sleep(HOLD_TIMEOUT_S + 0.5)
    assert wait_idle(producer) and wait_idle(consumer)


def test_consumer_killed_mid_decode_ends_the_routed_stream(sides):
    producer, _, _ = sides
    consumer = Server(stories_model(), *COMMON, "--kv-transfer-config", json.dumps({"kv_role": "kv_consumer"}),
                      name="stories")
    lost = Router([producer.url], [consumer.url], "--timeout", "5")
    try:
        r = lost.post("/v1/completions", {**request_body(3), "max_tokens": 400, "stream": True}, stream=True,
                      timeout=30)
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(l for l in lines if l.startswith(b"data: "))
        consumer.proc.kill()  # the consumer dies mid-decode
        t0 = time.time()
        with pytest.raises(requests.exceptions.RequestException):
            for line in lines:
                assert line != b"data: [DONE]"
        assert time.time() - t0 < 10
    finally:
        lost.stop()
        consumer.stop()
    # The producer's blocks went with the pull: nothing is held there.
    assert wait_idle(producer)


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
    # Client text never reaches the consumer's request line: a remote_request_id with CR LF (header
    # or request smuggling) or a path is a 400 naming it, and so is a host with a space.
    for bad in ["x HTTP/1.1\r\nX-Injected: 1\r\n\r\nDELETE /v1/kv_transfer/1", "../../health", ".."]:
        r = consumer.post("/v1/completions", {**body, "kv_transfer_params": {
            "do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 1, "remote_request_id": bad}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params.remote_request_id", r.text
    r = consumer.post("/v1/completions", {**body, "kv_transfer_params": {
        "do_remote_prefill": True, "remote_host": "a b", "remote_port": 1, "remote_request_id": "1"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params.remote_host", r.text
    # The pull hands the held blocks over once: a HEAD is refused and leaves them for the consumer.
    # The id is keyed (not the engine's sequential id alone): the bare engine id, or the id with
    # another tag, is a 404 and leaves the blocks held.
    params = prefill(producer, body)
    rid = str(params["remote_request_id"])
    engine_id, tag = rid.split("-")
    assert engine_id.isdigit() and len(tag) == 32, rid
    for guess in [engine_id, engine_id + "-" + "0" * 32]:
        r = requests.get(producer.url + "/v1/kv_transfer/" + guess, timeout=10)
        assert r.status_code == 404, r.text
    r = requests.head(producer.url + "/v1/kv_transfer/" + str(params["remote_request_id"]), timeout=10)
    assert r.status_code == 405 and r.headers["allow"] == "GET"
    r = consumer.post("/v1/completions", {**body, "kv_transfer_params": params})
    assert r.status_code == 200, r.text
    assert wait_idle(producer) and wait_idle(consumer)
    # Both sides keep serving.
    r = disaggregated(producer, consumer, request_body(13))
    assert r.status_code == 200


def test_bad_kv_transfer_config_is_refused_at_start():
    require(kestrel_binary())
    require(stories_model())
    with pytest.raises(RuntimeError, match="kv_role"):
        Server(stories_model(), "--kv-transfer-config", '{"kv_role": "decode"}')


def test_consumer_pulls_from_a_producer_with_an_api_key(sides):
    """A producer started with --api-key answers pulls that carry the key: the consumer's own
    --api-key, or kv_connector_extra_config.remote_api_key; a pull without it gets the producer's
    401, which the consumer answers as a failed transfer (502)."""
    _, _, single = sides
    key = "producer-key"
    auth = {"Authorization": f"Bearer {key}"}
    producer = Server(stories_model(), *COMMON, "--api-key", key, "--kv-transfer-config",
                      json.dumps({"kv_role": "kv_producer"}), name="stories")
    same_key = Server(stories_model(), *COMMON, "--api-key", key, "--kv-transfer-config",
                      json.dumps({"kv_role": "kv_consumer", "kv_pull_timeout": 10}), name="stories")
    own_key = Server(stories_model(), *COMMON, "--api-key", "consumer-key", "--kv-transfer-config",
                     json.dumps({"kv_role": "kv_consumer", "kv_pull_timeout": 10,
                                 "kv_connector_extra_config": {"remote_api_key": key}}), name="stories")
    no_key = Server(stories_model(), *COMMON, "--kv-transfer-config",
                    json.dumps({"kv_role": "kv_consumer", "kv_pull_timeout": 10}), name="stories")
    try:
        body = request_body(5)
        want = single.post("/v1/completions", body)
        assert want.status_code == 200, want.text

        def prefill_with_key():
            r = producer.post("/v1/completions", {**body, "max_tokens": 1, "stream": False,
                                                  "kv_transfer_params": {"do_remote_decode": True}}, headers=auth)
            assert r.status_code == 200, r.text
            return r.json()["kv_transfer_params"]

        for consumer, consumer_auth in ((same_key, auth), (own_key, {"Authorization": "Bearer consumer-key"})):
            r = consumer.post("/v1/completions", {**body, "kv_transfer_params": prefill_with_key()},
                              headers=consumer_auth)
            assert r.status_code == 200, r.text
            assert token_texts(r.json()) == token_texts(want.json())
        params = prefill_with_key()
        r = no_key.post("/v1/completions", {**body, "kv_transfer_params": params})
        assert r.status_code == 502 and "HTTP 401" in r.json()["error"]["message"], r.text
        # The refused pull left the blocks held; the right key still gets them.
        r = same_key.post("/v1/completions", {**body, "kv_transfer_params": params}, headers=auth)
        assert r.status_code == 200, r.text
        assert token_texts(r.json()) == token_texts(want.json())
    finally:
        for s in (producer, same_key, own_key, no_key):
            rc, out = s.stop()
            assert rc == 0, out


def test_cuda_ipc_transport_on_the_cpu():
    """kv_transport "cuda_ipc" needs a CUDA server: refused at start on the CPU."""
    require(kestrel_binary())
    require(stories_model())
    with pytest.raises(RuntimeError, match='kv_transport "cuda_ipc" needs --device cuda'):
        Server(stories_model(), "--kv-transfer-config",
               json.dumps({"kv_role": "kv_consumer", "kv_connector_extra_config": {"kv_transport": "cuda_ipc"}}))


def test_cuda_ipc_pull_and_release_routes(sides):
    """GET /v1/kv_transfer/<id>/cuda_ipc on a CPU producer is a 409 that leaves the blocks held, so
    a pull through host memory still gets them; DELETE /v1/kv_transfer/<id> frees held blocks once
    (then 404). A CPU consumer (auto) pulls through host memory, counted by transport in /metrics."""
    producer, consumer, single = sides
    body = {**request_body(0), "prompt": "Quietly the old owl sang a song to the moon and the stars"}
    want = single.post("/v1/completions", body)
    assert want.status_code == 200
    params = prefill(producer, body)
    kv_url = producer.url + "/v1/kv_transfer/" + str(params["remote_request_id"])
    r = requests.get(kv_url + "/cuda_ipc", timeout=10)
    assert r.status_code == 409 and r.json()["error"]["code"] == "kv_transport_unavailable", r.text
    assert "CUDA IPC" in r.json()["error"]["message"]
    r = requests.head(kv_url + "/cuda_ipc", timeout=10)
    assert r.status_code == 405
    assert used(producer)[1] == 1
    before = consumer.metrics()
    r = consumer.post("/v1/completions", {**body, "kv_transfer_params": params})
    assert r.status_code == 200, r.text
    assert token_texts(r.json()) == token_texts(want.json())
    after = consumer.metrics()
    host, ipc = '{kv_transport="host"}', '{kv_transport="cuda_ipc"}'
    assert after["kestrel_kv_transfer_pulls_total" + host] == before["kestrel_kv_transfer_pulls_total" + host] + 1
    assert after["kestrel_kv_transfer_imports_total" + host] == before["kestrel_kv_transfer_imports_total" + host] + 1
    # The whole blocks (8 tokens each) of the producer's tokens, none of them in the consumer's prefix cache.
    n_tokens = params["num_computed_tokens"]
    moved = after["kestrel_kv_transfer_import_bytes_total" + host] - before["kestrel_kv_transfer_import_bytes_total" + host]
    assert moved == (n_tokens + 7) // 8 * 8 * producer_bytes_per_token(producer), (moved, n_tokens)
    assert after["kestrel_kv_transfer_pulls_total" + ipc] == 0
    assert wait_idle(producer) and wait_idle(consumer)

    params = prefill(producer, body)
    kv_url = producer.url + "/v1/kv_transfer/" + str(params["remote_request_id"])
    assert used(producer)[1] == 1
    r = requests.delete(kv_url, timeout=10)
    assert r.status_code == 200 and r.json() == {"released": True}, r.text
    assert wait_idle(producer)
    assert requests.delete(kv_url, timeout=10).status_code == 404
    assert requests.get(kv_url, timeout=10).status_code == 404
    assert requests.get(kv_url + "/cuda_ipc", timeout=10).status_code == 404
    r = consumer.post("/v1/completions", {**body, "kv_transfer_params": params})
    assert r.status_code == 502 and "HTTP 404" in r.json()["error"]["message"], r.text
    assert wait_idle(consumer)


def producer_bytes_per_token(server):
    m = server.metrics()
    return m["kestrel_kv_cache_bytes_total"] / (m["kestrel_kv_blocks_total"] * 8)
