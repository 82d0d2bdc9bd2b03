"""The HTTP layer itself: slow and idle clients hold no thread, keep-alive and pipelining, half-closed
clients, HTTP/1.0, the limits and the connection limit, and the errors it answers itself (each an
OpenAI error body naming what was wrong)."""

import json
import socket
import threading
import time

import pytest
import requests

from conftest import Server, kestrel_binary, require, stories_model
from raw_http import Conn, exchange, request_bytes, timed
from test_disconnect import wait_for

C = "/v1/completions"
BODY = {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def small():
    """Two event-loop threads, a 1 s keep-alive, 64 KiB bodies, at most 200 connections."""
    require(kestrel_binary())
    require(stories_model())
    s = Server(stories_model(), "--max-model-len", "512", "--http-threads", "2", "--timeout-keep-alive", "1",
               "--max-body-size", "64KiB", "--max-connections", "200", name="stories")
    yield s
    rc, out = s.stop()
    assert rc == 0, out


def error_of(r, status):
    assert r.status == status, r
    assert r.headers["content-type"] == "application/json", r
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert "HTTP error" not in err["message"]
    return err


def test_slow_header_clients_do_not_block_others(small):
    # 50 clients each sending one header line now and then, with 2 threads: the old thread-per-
    # connection server gave every thread to them and nobody else was answered.
    slow = [Conn(small.port) for _ in range(50)]
    for c in slow:
        c.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    stop = threading.Event()

    def trickle():
        i = 0
        while not stop.wait(0.3):
            for c in slow:
                try:
                    c.send(f"X-Slow-{i}: 1\r\n".encode())
                except OSError:
                    pass
            i += 1

    t = threading.Thread(target=trickle)
    t.start()
    try:
        time.sleep(0.5)
        r, dt = timed(requests.post, small.url + C, json=BODY, timeout=10)
        assert r.status_code == 200 and dt < 2, (r.status_code, dt)
        r, dt = timed(requests.get, small.url + "/health", timeout=10)
        assert r.status_code == 200 and dt < 0.5, dt
    finally:
        stop.set()
        t.join()
        for c in slow:
            c.close()


def test_idle_keep_alive_connections_hold_no_thread(small):
    idle = []
    for _ in range(20):  # ten times the thread count, each idle after one request
        c = Conn(small.port)
        c.send(request_bytes("GET", "/health"))
        assert c.response().status == 200
        idle.append(c)
    r, dt = timed(requests.post, small.url + C, json=BODY, timeout=10)
    assert r.status_code == 200 and dt < 2, dt
    # --timeout-keep-alive 1: the server closes them about a second later.
    assert all(c.closed_by_server(3) for c in idle)
    for c in idle:
        c.close()


def test_keep_alive_serves_many_requests_on_one_connection(small):
    c = Conn(small.port)
    for _ in range(5):
        c.send(request_bytes("POST", C, BODY))
        r = c.response()
        assert r.status == 200 and r.json()["usage"]["completion_tokens"] == 4
    c.close()


def test_three_pipelined_requests_are_answered_in_order(small):
    c = Conn(small.port)
    c.send(request_bytes("POST", C, dict(BODY, max_tokens=3)) + request_bytes("GET", "/v1/models") +
           request_bytes("POST", C, dict(BODY, max_tokens=2)))
    t0 = time.time()
    r1, r2, r3 = c.response(), c.response(), c.response()
    assert time.time() - t0 < 3
    assert r1.status == 200 and r1.json()["usage"]["completion_tokens"] == 3
    assert r2.status == 200 and r2.json()["data"][0]["id"] == "stories"
    assert r3.status == 200 and r3.json()["usage"]["completion_tokens"] == 2
    c.close()


def test_half_closed_client_gets_its_answer(small):
    # nc -N: the request, then shutdown(SHUT_WR); the answer must still come.
    r = exchange(small.port, request_bytes("POST", C, BODY), shut_wr=True)
    assert r.status == 200 and r.json()["usage"]["completion_tokens"] == 4
    # Streamed too, and two pipelined requests before the half-close.
    r = exchange(small.port, request_bytes("POST", C, dict(BODY, stream=True)), shut_wr=True)
    assert r.status == 200 and r.body.endswith(b"data: [DONE]\n\n")
    c = Conn(small.port)
    c.send(request_bytes("POST", C, BODY) + request_bytes("GET", "/health"))
    c.shutdown_write()
    assert c.response().status == 200 and c.response().status == 200
    assert c.closed_by_server(3)
    c.close()


def test_http_1_0(small):
    r = exchange(small.port, request_bytes("POST", C, BODY, version="HTTP/1.0"))
    assert r.status == 200 and r.json()["usage"]["completion_tokens"] == 4 and r.interim == []
    # A stream without chunked encoding: the body ends with the connection.
    r = exchange(small.port, request_bytes("POST", C, dict(BODY, stream=True), version="HTTP/1.0"))
    assert r.status == 200 and "transfer-encoding" not in r.headers
    assert r.body.startswith(b"data: ") and r.body.endswith(b"data: [DONE]\n\n")


MEDIA_CASES = [
    ("multipart/form-data; boundary=x", {}, 415, "Content-Type"),
    ("application/jsonx-evil", {}, 415, "Content-Type"),
    ("text/plain", {}, 415, "Content-Type"),
    ("application/json", {"Content-Encoding": "gzip"}, 415, "Content-Encoding"),
    ("application/json", {"Content-Encoding": "br"}, 415, "Content-Encoding"),
]


@pytest.mark.parametrize("ctype,extra,status,named", MEDIA_CASES)
def test_unsupported_media_is_415(small, ctype, extra, status, named):
    r = exchange(small.port, request_bytes("POST", C, BODY, content_type=ctype, headers=extra))
    err = error_of(r, status)
    assert named in err["message"] and err["code"] == "unsupported_media_type"


@pytest.mark.parametrize("ctype", [None, "application/json; charset=utf-8", "Application/JSON"])
def test_json_media_types_accepted(small, ctype):
    r = exchange(small.port, request_bytes("POST", C, BODY, content_type=ctype))
    assert r.status == 200, r


@pytest.mark.parametrize("method", ["OPTIONS", "PUT", "DELETE", "GET", "PATCH"])
def test_other_methods_on_known_routes_are_405(small, method):
    for path, allow in ((C, "POST"), ("/v1/chat/completions", "POST"), ("/tokenize", "POST")):
        r = exchange(small.port, request_bytes(method, path))
        if method == allow:
            continue
        err = error_of(r, 405)
        assert r.headers["allow"] == allow and method in err["message"] and err["code"] == "method_not_allowed"
    if method != "GET":
        r = exchange(small.port, request_bytes(method, "/health"))
        assert r.status == 405 and r.headers["allow"] == "GET, HEAD"


@pytest.mark.parametrize("value", ["-1", "abc", "1, 2", "99999999999999999999999"])
def test_bad_content_length_is_400(small, value):
    head = f"POST {C} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {value}\r\n\r\n"
    err = error_of(exchange(small.port, head.encode() + b"{}"), 400)
    assert "Content-Length" in err["message"]


def test_too_large_header_is_431(small):
    r = exchange(small.port, request_bytes("GET", "/health", headers={"X-Big": "a" * (1 << 20)}))
    err = error_of(r, 431)
    assert "16384 bytes" in err["message"]
    many = {f"X-H{i}": "1" for i in range(150)}
    err = error_of(exchange(small.port, request_bytes("GET", "/health", headers=many)), 431)
    assert "at most 100" in err["message"]


def test_body_over_the_limit_is_413_before_it_is_read(small):
    # Only the head is sent: the answer comes from Content-Length alone.
    head = f"POST {C} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100000000\r\n\r\n"
    r, dt = timed(exchange, small.port, head.encode())
    err = error_of(r, 413)
    assert "65536" in err["message"] and "--max-body-size" in err["message"] and dt < 2
    # A chunked body is cut at the limit too.
    chunk = b"a" * 50000
    data = (f"POST {C} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
            .encode() + b"%x\r\n" % len(chunk) + chunk + b"\r\n" + b"%x\r\n" % len(chunk) + chunk + b"\r\n0\r\n\r\n")
    error_of(exchange(small.port, data), 413)
    # Just below the limit is served.
    big = json.dumps(dict(BODY, pad="x" * 60000)).encode()
    assert exchange(small.port, request_bytes("POST", C, big)).status == 200


def test_http_1_1_needs_exactly_one_host(small):
    # RFC 9112 3.2: 400 for an HTTP/1.1 request without Host and for any request with two Host fields.
    for head in (b"GET /health HTTP/1.1\r\n\r\n",
                 b"GET /health HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
                 b"GET /health HTTP/1.0\r\nHost: a\r\nHost: a\r\n\r\n",
                 b"GET /health HTTP/1.1\r\nHost: a/b\r\n\r\n",
                 b"GET /health HTTP/1.1\r\nHost: user@a\r\n\r\n",
                 b"POST /v1/completions HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}"):
        r = exchange(small.port, head)
        err = error_of(r, 400)
        assert err["code"] == "bad_host" and "Host" in err["message"], (head, err)
        assert r.headers["connection"] == "close"
    # HTTP/1.0 needs none; an empty Host and host:port forms are valid.
    for head in (b"GET /health HTTP/1.0\r\n\r\n", b"GET /health HTTP/1.1\r\nHost:\r\n\r\n",
                 b"GET /health HTTP/1.1\r\nHost: [::1]:8000\r\n\r\n",
                 b"GET /health HTTP/1.1\r\nHost: 127.0.0.1:80\r\n\r\n"):
        assert exchange(small.port, head).status == 200, head


def test_absolute_form_target_is_routed_by_its_path(small):
    # RFC 9112 3.2.2: a server MUST accept the absolute form (what a request through a proxy carries).
    r = exchange(small.port, request_bytes("POST", f"http://localhost:{small.port}{C}", BODY))
    assert r.status == 200 and r.json()["usage"]["completion_tokens"] == 4, r
    r = exchange(small.port, request_bytes("GET", "HTTPS://example.com/v1/models?x=1"))
    assert r.status == 200 and r.json()["data"][0]["id"] == "stories", r
    assert error_of(exchange(small.port, request_bytes("GET", "http://h")), 404)["code"] == "not_found"
    for target in ("ftp://h/health", "http://user@h/health", "http:///health", "localhost:8000", "*"):
        err = error_of(exchange(small.port, request_bytes("GET", target)), 400)
        assert err["code"] == "bad_request_target", (target, err)


def read_head_only(c):
    """The next response head on c (status, headers), leaving whatever follows it in c.buf."""
    while b"\r\n\r\n" not in c.buf:
        c._fill()
    head, c.buf = c.buf.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    return int(lines[0].split()[1]), {k.strip().lower(): v.strip() for k, v in (x.split(":", 1) for x in lines[1:])}


@pytest.mark.parametrize("path", ["/health", "/v1/models", "/v1/models/stories", "/v1/models/nope", "/metrics",
                                  "/tokenizer_info"])
def test_head_on_get_routes_is_the_get_answer_without_body(small, path):
    # RFC 9110 9.3.2. HEAD, GET and HEAD pipelined on one connection: the HEAD answers carry no body,
    # so each next answer starts right after their heads.
    c = Conn(small.port)
    try:
        c.send(request_bytes("HEAD", path) + request_bytes("GET", path) + request_bytes("HEAD", path))
        status, headers = read_head_only(c)
        got = c.response()
        assert got.status in (200, 404) and status == got.status, (status, got)
        assert headers["content-type"] == got.headers["content-type"]
        if path != "/metrics":  # the counters move between requests
            assert int(headers["content-length"]) == len(got.body) > 0, (headers, got)
        else:
            assert int(headers["content-length"]) > 100
        status2, headers2 = read_head_only(c)
        assert status2 == status and "connection" not in headers2
        # Nothing follows the last HEAD answer; the connection stays open for another request.
        c.send(request_bytes("GET", "/health"))
        assert c.response().status == 200
        assert c.buf == b""
    finally:
        c.close()


def test_head_on_post_routes_is_405_without_body(small):
    c = Conn(small.port)
    try:
        c.send(request_bytes("HEAD", C))
        status, headers = read_head_only(c)
        assert status == 405 and headers["allow"] == "POST" and int(headers["content-length"]) > 0
        assert c.closed_by_server(3) and c.buf == b""
    finally:
        c.close()


@pytest.mark.parametrize("head", [
    b"GET /health HTTP/1.1\nHost: x\r\n\r\n",  # was a misleading 505
    b"GET /health HTTP/1.1\nHost: x\n\n",
    b"GET /health HTTP/1.1\r\nHost: x\nX-A: b\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\n\n",
])
def test_bare_lf_in_the_head_is_400(small, head):
    # Bare LF line ends are refused, not taken as CRLF (RFC 9112 2.2 allows either; a proxy that
    # splits lines differently would frame the request differently).
    r, dt = timed(exchange, small.port, head)
    err = error_of(r, 400)
    assert err["code"] == "bad_line_ending" and "CRLF" in err["message"] and dt < 2, (err, dt)


@pytest.mark.parametrize("chunks", [b"5\nhello\n0\n\n", b"5\r\nhello\r\n0\n\n", b"5\r\nhello\r\n0\r\n\n"])
def test_bare_lf_in_a_chunked_body_is_400_at_once(small, chunks):
    # Beast waited for a CRLF after the chunk size until the 30 s body deadline (408).
    c = Conn(small.port)
    try:
        c.send(f"POST {C} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               "Transfer-Encoding: chunked\r\n\r\n".encode())
        time.sleep(0.2)  # the head is read on its own first
        c.send(chunks)
        r, dt = timed(c.response)
        err = error_of(r, 400)
        assert err["code"] == "bad_line_ending" and "chunk" in err["message"] and dt < 2, (err, dt)
    finally:
        c.close()


def test_chunked_body_split_anywhere_is_served(small):
    # The session feeds the parser itself: a CRLF split across reads is no bare LF.
    body = json.dumps(BODY).encode()
    data = (f"POST {C} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
            .encode() + b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n")
    c = Conn(small.port)
    try:
        for i in range(0, len(data), 7):
            c.send(data[i:i + 7])
            time.sleep(0.005)
        r = c.response()
        assert r.status == 200 and r.json()["usage"]["completion_tokens"] == 4, r
    finally:
        c.close()


def test_malformed_request_line_is_400(small):
    err = error_of(exchange(small.port, b"HELLO\r\n\r\n"), 400)
    assert err["message"]
    err = error_of(exchange(small.port, b"GET /health HTTP/2.0\r\n\r\n"), 505)
    assert "HTTP/1.1" in err["message"]


def test_connection_limit_refuses_cleanly():
    require(kestrel_binary())
    require(stories_model())
    s = Server(stories_model(), "--max-model-len", "256", "--max-connections", "4", name="stories")
    try:
        held = [Conn(s.port) for _ in range(4)]
        for c in held:
            c.send(request_bytes("GET", "/health"))
            assert c.response().status == 200
        r, dt = timed(exchange, s.port, request_bytes("GET", "/health"))
        err = error_of(r, 503)
        assert "--max-connections" in err["message"] and r.headers["connection"] == "close" and dt < 2
        for c in held:
            c.close()
        time.sleep(0.2)
        assert exchange(s.port, request_bytes("GET", "/health")).status == 200
    finally:
        rc, out = s.stop()
        assert rc == 0, out


def test_bearer_scheme_is_case_insensitive_with_any_whitespace():
    require(kestrel_binary())
    require(stories_model())
    s = Server(stories_model(), "--api-key", "sekrit", "--max-model-len", "256", name="stories")
    try:
        for auth in ("bearer sekrit", "BEARER sekrit", "Bearer  sekrit", "Bearer \t sekrit", "Bearer sekrit "):
            r = exchange(s.port, request_bytes("POST", C, BODY, headers={"Authorization": auth}))
            assert r.status == 200, (auth, r)
        for auth in ("Bearersekrit", "Basic sekrit", "bearer sekri", "bearer sekritt", "bearer"):
            r = exchange(s.port, request_bytes("POST", C, BODY, headers={"Authorization": auth}))
            assert error_of(r, 401)["code"] == "invalid_api_key", auth
        # The tokenizer routes sit outside /v1, as vLLM's do: no key needed.
        assert exchange(s.port, request_bytes("GET", "/tokenizer_info")).status == 200
    finally:
        rc, out = s.stop()
        assert rc == 0, out


def test_sigterm_with_slow_and_idle_clients_exits_within_5_s():
    require(kestrel_binary())
    require(stories_model())
    s = Server(stories_model(), "--max-model-len", "2048", name="stories")
    conns = []
    try:
        for i in range(30):
            c = Conn(s.port)
            c.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" if i % 2 else request_bytes("GET", "/health"))
            conns.append(c)
        # A streaming client that never reads (its socket buffers fill) and one half-sent body.
        reader = Conn(s.port)
        reader.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        reader.send(request_bytes("POST", C, {"prompt": "Once", "max_tokens": 1900, "ignore_eos": True, "stream": True,
                                              "n": 4}))
        half = Conn(s.port)
        half.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"prompt\":")
        conns += [reader, half]
        time.sleep(1.0)
        t0 = time.time()
        s.proc.send_signal(15)
        s.proc.wait(timeout=10)
        assert time.time() - t0 < 5
        rc, out = s.stop()
        assert rc == 0 and "stopped" in out, out
    finally:
        for c in conns:
            c.close()
        if s.proc.poll() is None:
            s.stop()


def test_health_answers_fast_while_the_engine_is_busy(small):
    # /health reads the engine thread's snapshot: it never waits for a step or a queue.
    body = {"prompt": "Once", "max_tokens": 400, "ignore_eos": True, "n": 8, "temperature": 0.8}
    t = threading.Thread(target=lambda: requests.post(small.url + C, json=body, timeout=60))
    t.start()
    try:
        time.sleep(0.3)
        worst = 0.0
        c = Conn(small.port)
        for _ in range(20):
            t0 = time.time()
            c.send(request_bytes("GET", "/health"))
            assert c.response().status == 200
            worst = max(worst, time.time() - t0)
            time.sleep(0.02)
        c.close()
        assert worst < 0.1, worst
    finally:
        t.join()


def rss_mb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_large_bodies_do_not_ratchet_memory(server):
    # clang links the ASan runtime in (its name is in the binary); gcc links libasan.so (the binary
    # imports __asan_init).
    image = kestrel_binary().read_bytes()
    if b"AddressSanitizer" in image or b"__asan_init" in image:
        pytest.skip("ASan's allocator keeps freed memory in its quarantine")
    # 1.8 MB bodies of 600k small JSON values, four at a time (several threads, several malloc
    # arenas): without handing freed memory back (malloc_trim) the process kept about 100 MB.
    body = ('{"prompt": "a", "max_tokens": 1, "x": [' + ",".join(["[1,2]"] * 300000) + "]}").encode()
    before = rss_mb(server.proc.pid)
    for _ in range(3):
        ts = [threading.Thread(target=lambda: requests.post(server.url + C, data=body, timeout=60,
                                                            headers={"Content-Type": "application/json"}))
              for _ in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    time.sleep(0.3)
    assert rss_mb(server.proc.pid) - before < 40, (before, rss_mb(server.proc.pid))


def test_request_head_deadline_is_408(small):
    # A head still incomplete 10 s after its first byte gets a 408 and the connection closes; the old
    # server's timeout was per read, so one header line every few seconds held a thread for ever.
    c = Conn(small.port, timeout=20)
    c.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    t0 = time.time()
    for i in range(3):
        time.sleep(2)
        c.send(f"X-Slow-{i}: 1\r\n".encode())
    r = c.response()
    dt = time.time() - t0
    err = error_of(r, 408)
    assert 9.5 < dt < 12 and "request head" in err["message"] and "10" in err["message"], (dt, err)
    assert c.closed_by_server(3)
    c.close()


@pytest.fixture(scope="module")
def quick_deadlines():
    """Read and write deadlines of 2 s (--timeout-request-head, --timeout-request-body, --timeout-write)."""
    require(kestrel_binary())
    require(stories_model())
    s = Server(stories_model(), "--max-model-len", "2048", "--http-threads", "2", "--timeout-request-head", "2",
               "--timeout-request-body", "2", "--timeout-write", "2", name="stories")
    yield s
    rc, out = s.stop()
    assert rc == 0, out


def test_body_shorter_than_its_content_length_is_dropped_at_the_body_deadline(quick_deadlines):
    # The client promises 200 bytes and sends 20: with --timeout-request-body 2 the server answers
    # 408 and closes about 2 s after the head, and serves everyone else meanwhile.
    s = quick_deadlines
    c = Conn(s.port, timeout=20)
    c.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           b"Content-Length: 200\r\n\r\n" + b'{"prompt": "Once up')
    t0 = time.time()
    for _ in range(3):
        r, dt = timed(requests.post, s.url + C, json=BODY, timeout=10)
        assert r.status_code == 200 and dt < 1, dt
        assert requests.get(s.url + "/health", timeout=5).status_code == 200
    r = c.response()
    dt = time.time() - t0
    err = error_of(r, 408)
    assert 1.5 < dt < 4, dt
    assert "request body" in err["message"] and "2.00 s" in err["message"], err
    assert c.closed_by_server(3)
    c.close()
    # The same for a chunked body that stalls mid-chunk, and a head that never ends.
    c = Conn(s.port, timeout=20)
    c.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n10\r\n{\"prompt\"")
    t0 = time.time()
    assert "request body" in error_of(c.response(), 408)["message"]
    assert 1.5 < time.time() - t0 < 4
    c.close()
    c = Conn(s.port, timeout=20)
    c.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    t0 = time.time()
    assert "request head" in error_of(c.response(), 408)["message"]
    assert 1.5 < time.time() - t0 < 4
    c.close()


def test_a_client_that_stops_reading_is_dropped_at_the_write_deadline(quick_deadlines):
    # A streaming client that reads nothing (a 4 KiB receive buffer) while tens of MB of events are
    # due (8 x 1900 tokens with 20 logprobs each): once a write has waited 2 s (--timeout-write 2)
    # the server drops the connection, so what the client reads later stops short of the end and the
    # connection closes. (With the 30 s default it would get the whole stream and stay open.)
    s = quick_deadlines
    reader = socket.socket()
    reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    reader.connect(("127.0.0.1", s.port))
    reader.sendall(request_bytes("POST", C, {"prompt": "Once", "max_tokens": 1900, "ignore_eos": True,
                                             "stream": True, "n": 8, "logprobs": 20, "temperature": 1}))
    try:
        time.sleep(6)
        assert requests.post(s.url + C, json=BODY, timeout=10).status_code == 200  # others are served
        reader.settimeout(10)
        data = b""
        try:
            while True:
                chunk = reader.recv(1 << 20)
                if not chunk:
                    break
                data += chunk
        except ConnectionResetError:
            pass
        assert data.startswith(b"HTTP/1.1 200"), data[:200]
        assert b"data: [DONE]" not in data and data.count(b"data: ") < 8 * 1900, len(data)
    finally:
        reader.close()
    # The drop aborts the request through the engine loop's command queue, between two steps: the
    # blocks are freed shortly after the close, not before the client can ask.
    wait_for(s, lambda m: m["kestrel_kv_blocks_used"] == 0 and m["kestrel_num_requests_running"] == 0)


def test_huge_content_length_on_any_route_is_413(small):
    # The body reader reserves Content-Length bytes: on a route without a JSON body this length was
    # not checked, and the reservation threw out of the event loop (the process ended).
    for method, path in (("GET", "/health"), ("POST", "/health"), ("GET", "/no/such/route")):
        head = f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 1553269930417931002\r\n\r\n"
        r = exchange(small.port, head.encode())
        assert r.status in (404, 405, 413), r
        if method == "GET" and path == "/health":
            assert "--max-body-size" in error_of(r, 413)["message"]
    assert requests.get(small.url + "/health", timeout=10).status_code == 200


@pytest.mark.parametrize("coding", ["xchunked", "gzip", "chunked, gzip", "gzip, chunked"])
def test_transfer_encoding_other_than_chunked_is_501(small, coding):
    # A final coding that is not chunked leaves the body unframed (RFC 9112 6.3). Read as an empty
    # body, the bytes after the head were parsed as a second request: a request-smuggling vector.
    head = f"POST {C} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: {coding}\r\n\r\n"
    err = error_of(exchange(small.port, head.encode() + b"0\r\n\r\n"), 501)
    assert err["code"] == "unsupported_transfer_encoding", err


def test_unframed_body_is_not_taken_for_the_next_request(small):
    c = Conn(small.port)
    try:
        c.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: xchunked\r\n\r\n"
               b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        r = c.response()
        err = error_of(r, 501)
        assert err["code"] == "unsupported_transfer_encoding" and "xchunked" in err["message"]
        assert r.headers.get("connection", "").lower() == "close", r
        # Nothing else: the connection ends without answering the smuggled GET.
        with pytest.raises(EOFError):
            c.response()
    finally:
        c.close()


def test_nul_byte_in_a_body_is_400_not_the_end_of_input(small):
    # nlohmann's lexer takes NUL for the end of input: the body parsed as the text before it.
    body = b'{"prompt": "Once", "max_tokens": 2}\x00garbage'
    err = error_of(exchange(small.port, request_bytes("POST", C, body)), 400)
    assert "NUL byte at offset 35" in err["message"], err


@pytest.mark.parametrize("where", ["extension", "trailer"])
def test_endless_chunk_extension_or_trailer_is_431_not_buffered(small, where):
    # Beast's header limit covers neither: the server buffered whatever came (200 MB took +200 MB
    # of RSS until the body deadline). Now the unparsed bytes are capped.
    c = Conn(small.port)
    try:
        body = b'{"prompt": "Once", "max_tokens": 1}'
        c.send(f"POST {C} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
        if where == "extension":
            c.send(f"{len(body):x};ext=".encode())
        else:
            c.send(f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\nX-T: ")
        sent = 0
        try:
            while sent < (4 << 20):  # far past the cap; the server answers and closes long before
                c.send(b"v" * 65536)
                sent += 65536
        except OSError:
            pass  # the server closed while we were still sending
        r = c.response()
        err = error_of(r, 431)
        assert "too long" in err["message"], err
    finally:
        c.close()


def chunked_request(trailer=b"", extra=b""):
    body = json.dumps(BODY).encode()
    return (f"POST {C} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
            .encode() + extra + b"\r\n" + b"%x\r\n" % len(body) + body + b"\r\n0\r\n" + trailer + b"\r\n")


@pytest.mark.parametrize("trailer", [b"Content-Length: 5\r\n", b"Transfer-Encoding: gzip\r\n",
                                     b"Connection: close\r\n", b"Content-Type: text/plain\r\nX-A: b\r\n"])
def test_trailer_fields_are_discarded(small, trailer):
    # RFC 9110 6.5.1: trailer fields are not merged into the header. Beast merged them: a trailer
    # Content-Length or Transfer-Encoding was a 400 and a trailer Connection: close closed the connection.
    c = Conn(small.port)
    try:
        for _ in range(2):  # the connection stays open for a second request
            c.send(chunked_request(trailer))
            r = c.response()
            assert r.status == 200 and r.json()["usage"]["completion_tokens"] == 4, r
            assert r.headers.get("connection", "").lower() != "close", r
    finally:
        c.close()


def test_trailer_section_split_across_reads_is_served(small):
    data = chunked_request(b"X-Checksum: 1234\r\n")
    c = Conn(small.port)
    try:
        for i in range(0, len(data), 3):
            c.send(data[i:i + 3])
            time.sleep(0.002)
        r = c.response()
        assert r.status == 200 and r.json()["usage"]["completion_tokens"] == 4, r
    finally:
        c.close()


def test_malformed_trailer_field_is_400(small):
    err = error_of(exchange(small.port, chunked_request(b"no colon here\r\n")), 400)
    assert err["code"] == "bad_request", err


def test_empty_lines_before_the_request_line_are_ignored(small):
    # RFC 9112 2.2: a server SHOULD ignore at least one empty line before the request-line.
    r = exchange(small.port, b"\r\n\r\nGET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert r.status == 200, r


def test_bare_cr_in_the_head_is_400(small):
    # Was 505: Beast read the rest of the line as the HTTP version.
    err = error_of(exchange(small.port, b"GET /health HTTP/1.1\rHost: x\r\n\r\n"), 400)
    assert err["code"] == "bad_line_ending" and "bare CR" in err["message"], err


@pytest.mark.parametrize("fields", [b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n",
                                    b"Transfer-Encoding: chunked, chunked\r\n"])
def test_chunked_applied_twice_is_400(small, fields):
    head = f"POST {C} HTTP/1.1\r\nHost: x\r\n".encode() + fields + b"\r\n"
    err = error_of(exchange(small.port, head + b"0\r\n\r\n"), 400)
    assert err["code"] == "bad_transfer_encoding" and "more than once" in err["message"], err


@pytest.mark.parametrize("fields", [b"Content-Length: 3\r\nTransfer-Encoding: chunked\r\n",
                                    b"Transfer-Encoding: chunked\r\nContent-Length: 3\r\n"])
def test_content_length_with_transfer_encoding_is_400(small, fields):
    head = f"POST {C} HTTP/1.1\r\nHost: x\r\n".encode() + fields + b"\r\n"
    err = error_of(exchange(small.port, head + b"0\r\n\r\n"), 400)
    assert "Content-Length and Transfer-Encoding together" in err["message"], err


def test_empty_transfer_encoding_is_400(small):
    body = json.dumps(BODY).encode()
    head = f"POST {C} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: \r\nContent-Length: {len(body)}\r\n\r\n"
    err = error_of(exchange(small.port, head.encode() + body), 400)
    assert err["code"] == "bad_transfer_encoding" and "empty" in err["message"], err


def test_two_authorization_fields_are_400(small):
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer a\r\nAuthorization: Bearer b\r\n\r\n"
    err = error_of(exchange(small.port, head), 400)
    assert err["code"] == "bad_authorization" and "2 Authorization" in err["message"], err
