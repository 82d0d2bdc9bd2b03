"""A server with pipeline parallelism (2 stages on the CPU, passes of different requests in flight):
concurrent requests get the one-stage server's text, and a client that leaves mid-stream has its
requests aborted and their blocks freed while other requests keep streaming."""

import concurrent.futures

import pytest

from conftest import STORIES_CTX, Server, kestrel_binary, require, stories_model
from test_disconnect import LONG, aborted, read_stream_start, send_request, wait_for

NAMES = ("Lily", "Tom", "a dog", "the sun", "Ben", "a little bird", "Sue", "the old king")


@pytest.fixture(scope="module")
def pp_server():
    require(kestrel_binary())
    require(stories_model())
    s = Server(stories_model(), "--max-model-len", str(STORIES_CTX), "--pipeline-parallel-size", "2",
               "--threads", "2", name="stories")
    yield s
    rc, out = s.stop()
    assert rc == 0, out


def completion(server, prompt, max_tokens=48):
    r = server.post("/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                        "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_concurrent_requests_give_the_one_stage_text(server, pp_server):
    prompts = [f"Once upon a time, {name}" for name in NAMES]
    want = [completion(server, p) for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: completion(pp_server, p), prompts))
    assert got == want
    assert all(len(t) > 0 for t in got)


def test_a_client_leaving_mid_stream_frees_its_blocks_while_others_run(server, pp_server):
    n_aborted = aborted(pp_server.metrics())
    want = completion(server, "Once upon a time, Tom", max_tokens=200)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        other = pool.submit(completion, pp_server, "Once upon a time, Tom", 200)
        s = send_request(pp_server.port, dict(LONG, stream=True))
        read_stream_start(s)
        s.close()
        assert other.result(timeout=120) == want
    m = wait_for(pp_server, lambda m: m["kestrel_kv_blocks_used"] == 0 and m["kestrel_num_requests_running"] == 0)
    assert aborted(m) == n_aborted + 4
    assert completion(pp_server, "Once upon a time, Sue", max_tokens=8) == completion(server, "Once upon a time, Sue", 8)
