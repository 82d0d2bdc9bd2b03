"""Clients that go away: their requests are aborted and their KV blocks freed (seen in /metrics);
SIGTERM stops the server gracefully."""

import json
import signal
import socket
import threading
import time

from conftest import Server, kestrel_binary, require, stories_model
from sse import stream_events

PROMPT = "Once upon a time"
# About 4 x 2000 tokens: several seconds of work on stories260K, so the requests are still running
# when the client leaves.
LONG = {"prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True, "n": 4, "temperature": 0.8}


def send_request(port, body, path="/v1/completions"):
    s = socket.create_connection(("127.0.0.1", port))
    payload = json.dumps(body).encode()
    s.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    return s


def read_stream_start(s, n_events=12):
    """Reads from socket s until n_events SSE events have come; asserts a 200 response."""
    received = b""
    while received.count(b"data: ") < n_events:
        chunk = s.recv(65536)
        assert chunk, received
        received += chunk
    assert received.startswith(b"HTTP/1.1 200")


def wait_for(server, predicate, timeout=10.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        m = server.metrics()
        if predicate(m):
            return m
        time.sleep(0.05)
    raise AssertionError(f"timed out; metrics: { {k: v for k, v in m.items() if 'bucket' not in k} }")


def aborted(m):
    return m.get('kestrel_request_finished_total{finish_reason="abort"}', 0)


def test_disconnect_mid_stream_frees_blocks(server):
    n_aborted = aborted(server.metrics())
    s = send_request(server.port, dict(LONG, stream=True))
    read_stream_start(s)
    m = server.metrics()
    assert m["kestrel_num_requests_running"] == 4 and m["kestrel_kv_blocks_used"] > 0
    t0 = time.time()
    s.close()
    m = wait_for(server, lambda m: m["kestrel_kv_blocks_used"] == 0 and m["kestrel_num_requests_running"] == 0)
    assert time.time() - t0 < 3
    assert aborted(m) == n_aborted + 4  # all four choices were cut short, not finished


def test_disconnect_during_a_non_streamed_request_frees_blocks(server):
    n_aborted = aborted(server.metrics())
    s = send_request(server.port, LONG)
    wait_for(server, lambda m: m["kestrel_num_requests_running"] == 4 and m["kestrel_kv_blocks_used"] > 0)
    s.close()
    m = wait_for(server, lambda m: m["kestrel_kv_blocks_used"] == 0 and m["kestrel_num_requests_running"] == 0)
    assert aborted(m) == n_aborted + 4
    assert m['kestrel_requests_total{status="499"}'] >= 1
    # Still serving.
    r = server.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 3})
    assert r.status_code == 200


def test_sigterm_ends_open_streams_and_exits_cleanly():
    require(kestrel_binary())
    require(stories_model())
    s = Server(stories_model(), name="stories")
    result = {}

    def stream():
        result["events"], result["done"] = stream_events(s.url + "/v1/completions", dict(LONG, stream=True))

    t = threading.Thread(target=stream)
    t.start()
    wait_for(s, lambda m: m["kestrel_num_requests_running"] == 4)
    s.proc.send_signal(signal.SIGTERM)
    t.join(timeout=30)
    assert not t.is_alive()
    assert result["done"]
    finishes = [c["finish_reason"] for e in result["events"] for c in e["choices"] if c["finish_reason"]]
    assert sorted(finishes) == ["abort"] * 4
    s.proc.wait(timeout=30)
    rc, out = s.stop()
    assert rc == 0 and "stopped" in out, out


def test_half_close_then_full_close_during_a_non_streamed_request_frees_blocks(server):
    # The client half-closes after its request (the server cannot yet tell it from a close), reads
    # the interim 100 Continue, and only then goes away: no unread data makes its close a reset, so
    # the server must write again to find out.
    n_aborted = aborted(server.metrics())
    s = send_request(server.port, LONG)
    s.shutdown(socket.SHUT_WR)
    wait_for(server, lambda m: m["kestrel_num_requests_running"] == 4)
    s.settimeout(5)
    assert s.recv(64).startswith(b"HTTP/1.1 100 Continue")
    time.sleep(0.3)  # any further interim response read too
    s.setblocking(False)
    try:
        s.recv(4096)
    except BlockingIOError:
        pass
    s.close()
    t0 = time.time()
    m = wait_for(server, lambda m: m["kestrel_kv_blocks_used"] == 0 and m["kestrel_num_requests_running"] == 0)
    assert time.time() - t0 < 3
    assert aborted(m) == n_aborted + 4
