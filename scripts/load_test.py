#!/usr/bin/env python3
"""Connection-load test of `kestrel serve`: idle and slow clients must not starve real ones.

Holds, at the same time, against one server:
  - IDLE keep-alive connections (default 10,000): each sends one `GET /health`, reads the answer and
    then stays open without a byte more (one the server closes is opened again, as a pool would);
  - SLOW connections (default 1,000): a request head sent one header line every 2 s, never finished;
    a connection the server closes (its head deadline) is opened again, so the load stays;
  - CLIENTS streaming clients (default 256) that complete REQUESTS (default 1,024) `stream: true`
    `/v1/completions` requests between them, each on a fresh connection;
while a separate process opens a fresh connection every 100-200 ms for `GET /health` (the latency
is connect to last byte of the answer) and samples the server's resident memory (VmRSS in
/proc/PID/status). At the end it sends SIGTERM with the idle and slow connections (and a few
long streams) still attached and times the exit.

Pass criteria (each can be changed by a flag): zero failed streaming requests, /health latency
max < 100 ms with no probe failing, RSS max < 1 GiB, exit within 5 s of SIGTERM with status 0.
Prints a JSON summary on stdout (progress on stderr); exit status 0 when every criterion holds,
1 otherwise, 2 on a setup error.

Starts `kestrel serve` on stories260K itself (the binary is --binary, else $KESTREL_BINARY, else
build/kestrel; extra server flags with --server-arg), or attaches with --attach HOST:PORT --pid PID.
Python 3.10+ standard library only (asyncio streams, raw HTTP/1.1).

  scripts/load_test.py --binary build/kestrel
  scripts/load_test.py --idle 1000 --slow 100 --requests 128     # a quick run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import re
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def log(msg: str) -> None:
    print(f"[{Path(sys.argv[0]).stem} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def raise_nofile(need: int) -> int:
    """Raises this process's open-file limit (inherited by a server started here) to the hard limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(need, soft)
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft < need:
        raise SystemExit(f"load_test: RLIMIT_NOFILE is {soft} (hard {hard}); this load needs about {need}")
    return soft


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a process (/proc/PID/stat), or None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return round((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), 2)
    except (OSError, IndexError, ValueError):
        return None


# ---------------------------------------------------------------------------------------------------
# The probe process: /health latency on fresh connections and the server's RSS, on its own core time
# (not behind the load generator's event loop).


def health_probe(host: str, port: int, timeout: float) -> tuple[float, str | None]:
    """One GET /health on a fresh connection: (seconds from connect to the answer's last byte, error)."""
    request = f"GET /health HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n".encode()
    start = time.monotonic()
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.settimeout(max(0.001, timeout - (time.monotonic() - start)))
            s.sendall(request)
            data = b""
            while True:
                chunk = s.recv(4096)
                if not chunk:
                    break
                data += chunk
                if b"\r\n\r\n" in data:
                    head, _, body = data.partition(b"\r\n\r\n")
                    m = re.search(rb"(?i)\r\ncontent-length:\s*(\d+)", head)
                    if m and len(body) >= int(m.group(1)):
                        break
        elapsed = time.monotonic() - start
        status = data.split(b" ", 2)[1] if data.startswith(b"HTTP/1.") else b"?"
        if status != b"200":
            return elapsed, f"status {status.decode(errors='replace')} after {elapsed * 1000:.1f} ms"
        return elapsed, None
    except OSError as e:
        elapsed = time.monotonic() - start
        return elapsed, f"{type(e).__name__}: {e} after {elapsed * 1000:.1f} ms"


def probe_main(host: str, port: int, pid: int, interval: tuple[float, float], timeout: float, stop, out) -> None:
    """Starts a probe every 100-200 ms, each in its own thread (a stalled probe does not delay the
    next), and samples the server's RSS every 250 ms; sends the results down `out` when `stop` is set."""
    latencies: list[tuple[float, float]] = []  # (time since start, seconds)
    failures: list[tuple[float, str]] = []
    rss: list[tuple[float, float]] = []
    lock = threading.Lock()
    t0 = time.monotonic()

    def one(at: float) -> None:
        elapsed, error = health_probe(host, port, timeout)
        with lock:
            latencies.append((at, elapsed))
            if error:
                failures.append((at, error))

    threads = []
    next_rss = 0.0
    while not stop.is_set():
        now = time.monotonic() - t0
        if now >= next_rss:
            value = rss_mb(pid) if pid else None
            if value is not None:
                rss.append((now, value))
            next_rss = now + 0.25
        th = threading.Thread(target=one, args=(now,), daemon=True)
        th.start()
        threads.append(th)
        threads = [t for t in threads if t.is_alive()]
        stop.wait(random.uniform(*interval))
    for th in threads:
        th.join(timeout + 1)
    with lock:
        out.send({"latencies": sorted(latencies), "failures": sorted(failures), "rss": rss})
    out.close()


# ---------------------------------------------------------------------------------------------------
# Raw HTTP/1.1 over asyncio streams.


async def read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1."):
        raise ValueError(f"bad status line {lines[0]!r}")
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    return int(parts[1]), headers


async def read_body(reader: asyncio.StreamReader, headers: dict[str, str], on_data=None) -> bytes:
    """The whole body (Content-Length or chunked); on_data(bytes) sees each piece as it arrives."""
    out = bytearray()
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while True:
            size_line = await reader.readuntil(b"\r\n")
            size = int(size_line.split(b";")[0].strip(), 16)
            if size == 0:
                await reader.readuntil(b"\r\n")  # no trailers expected: the empty line
                return bytes(out)
            chunk = await reader.readexactly(size + 2)
            out += chunk[:-2]
            if on_data:
                on_data(chunk[:-2])
    if "content-length" in headers:
        data = await reader.readexactly(int(headers["content-length"]))
        if on_data:
            on_data(data)
        return data
    while chunk := await reader.read(65536):  # close-delimited
        out += chunk
        if on_data:
            on_data(chunk)
    return bytes(out)


class Stats:
    def __init__(self) -> None:
        self.idle_open = 0
        self.idle_opened = 0
        self.idle_failed = 0
        self.idle_closed_by_server = 0
        self.slow_open = 0
        self.slow_opened = 0
        self.slow_closed_by_server = 0
        self.slow_connect_failed = 0
        self.slow_answers: dict[str, int] = {}
        self.slow_lifetimes: list[float] = []  # seconds from connect to the server's answer or close
        self.stream_ok = 0
        self.stream_failed: list[str] = []
        self.stream_latency: list[float] = []
        self.stream_tokens = 0
        self.connect_errors: dict[str, int] = {}
        self.terminating = False  # set when SIGTERM is sent: closures after it are the shutdown's

    def connect_error(self, e: BaseException) -> None:
        key = type(e).__name__ + (f" {e.errno}" if isinstance(e, OSError) and e.errno else "")
        self.connect_errors[key] = self.connect_errors.get(key, 0) + 1


async def open_conn(host: str, port: int, timeout: float):
    return await asyncio.wait_for(asyncio.open_connection(host, port, limit=1 << 20), timeout)


async def idle_connection(host: str, port: int, st: Stats, sem: asyncio.Semaphore, stop: asyncio.Event,
                          reopen: bool) -> None:
    while not stop.is_set() and not st.terminating:
        async with sem:  # bounds the connects in flight (the listen backlog is finite)
            try:
                reader, writer = await open_conn(host, port, 30)
                writer.write(f"GET /health HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
                status, headers = await asyncio.wait_for(read_head(reader), 30)
                await asyncio.wait_for(read_body(reader, headers), 30)
                if status != 200:
                    raise ValueError(f"status {status}")
            except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError) as e:
                st.idle_failed += 1
                st.connect_error(e)
                await asyncio.sleep(1)
                continue
        st.idle_open += 1
        st.idle_opened += 1
        try:
            stopped = asyncio.ensure_future(stop.wait())
            eof = asyncio.ensure_future(reader.read(1))
            await asyncio.wait([stopped, eof], return_when=asyncio.FIRST_COMPLETED)
            if not stop.is_set() and not st.terminating:
                st.idle_closed_by_server += 1
            stopped.cancel()
            eof.cancel()
        except OSError:
            if not st.terminating:
                st.idle_closed_by_server += 1
        finally:
            st.idle_open -= 1
        if stop.is_set():
            writer.transport.abort()
            return
        writer.transport.abort()
        if not reopen:
            return


async def slow_connection(host: str, port: int, st: Stats, sem: asyncio.Semaphore, stop: asyncio.Event,
                          line_interval: float) -> None:
    while not stop.is_set() and not st.terminating:
        async with sem:
            try:
                reader, writer = await open_conn(host, port, 30)
                writer.write(f"GET /health HTTP/1.1\r\nHost: {host}:{port}\r\n".encode())
                await writer.drain()
            except (OSError, asyncio.TimeoutError) as e:
                st.slow_connect_failed += 1
                st.connect_error(e)
                await asyncio.sleep(1)
                continue
        st.slow_open += 1
        st.slow_opened += 1
        opened_at = time.monotonic()
        answer = asyncio.ensure_future(reader.read(4096))
        n = 0
        try:
            while not stop.is_set():
                done, _ = await asyncio.wait([answer], timeout=line_interval * random.uniform(0.9, 1.1))
                if done:
                    if st.terminating:
                        break
                    data = answer.result()
                    key = data.split(b"\r\n", 1)[0].decode("latin-1")[:40] if data else "closed"
                    st.slow_answers[key] = st.slow_answers.get(key, 0) + 1
                    st.slow_closed_by_server += 1
                    st.slow_lifetimes.append(time.monotonic() - opened_at)
                    break
                n += 1
                writer.write(f"X-Slow-{n}: {'v' * 16}\r\n".encode())
                await writer.drain()
        except OSError:
            if not st.terminating:
                st.slow_closed_by_server += 1
                st.slow_answers["reset"] = st.slow_answers.get("reset", 0) + 1
        finally:
            st.slow_open -= 1
            answer.cancel()
            writer.transport.abort()


async def stream_request(host: str, port: int, body: bytes, timeout: float) -> tuple[int, float]:
    """One streaming completion on a fresh connection; returns (content chunks, seconds)."""
    start = time.monotonic()
    reader, writer = await open_conn(host, port, timeout)
    try:
        writer.write((f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body)
        status, headers = await asyncio.wait_for(read_head(reader), timeout)
        data = await asyncio.wait_for(read_body(reader, headers), max(1.0, timeout - (time.monotonic() - start)))
        if status != 200:
            raise ValueError(f"status {status}: {data[:200]!r}")
        events = [line[6:] for line in data.decode("utf-8", "replace").split("\n") if line.startswith("data: ")]
        if not events or events[-1].strip() != "[DONE]":
            raise ValueError(f"stream without [DONE] ({len(events)} events)")
        chunks = 0
        for e in events[:-1]:
            obj = json.loads(e)
            if "error" in obj:
                raise ValueError(f"error event {e[:200]}")
            choice = obj["choices"][0]
            if choice.get("finish_reason") not in (None, "stop", "length"):
                raise ValueError(f"finish_reason {choice.get('finish_reason')!r}")
            chunks += 1
        return chunks, time.monotonic() - start
    finally:
        writer.transport.abort()


async def stream_client(host: str, port: int, st: Stats, queue: asyncio.Queue, body: bytes, timeout: float) -> None:
    while True:
        try:
            queue.get_nowait()
        except asyncio.QueueEmpty:
            return
        try:
            chunks, seconds = await stream_request(host, port, body, timeout)
            st.stream_ok += 1
            st.stream_tokens += chunks
            st.stream_latency.append(seconds)
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError, KeyError,
                json.JSONDecodeError) as e:
            st.stream_failed.append(f"{type(e).__name__}: {e}"[:300])


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))]


async def run_load(args, host: str, port: int, proc: subprocess.Popen | None, pid: int) -> dict:
    st = Stats()
    stop = asyncio.Event()
    connect_sem = asyncio.Semaphore(args.connect_concurrency)
    ctx = mp.get_context("fork")
    stop_probe = ctx.Event()
    probe_rx, probe_tx = ctx.Pipe(duplex=False)
    probe = ctx.Process(target=probe_main, args=(host, port, pid, (args.health_interval_min, args.health_interval_max),
                                                 args.health_timeout, stop_probe, probe_tx), daemon=True)
    probe.start()
    t0 = time.monotonic()
    load_start = Path("/proc/loadavg").read_text().split()[:3]

    tasks = [asyncio.ensure_future(idle_connection(host, port, st, connect_sem, stop, args.reopen_idle))
             for _ in range(args.idle)]
    tasks += [asyncio.ensure_future(slow_connection(host, port, st, connect_sem, stop, args.slow_interval))
              for _ in range(args.slow)]

    # Wait until the idle and slow connections are in place (or the setup time is spent).
    deadline = time.monotonic() + args.setup_timeout
    while time.monotonic() < deadline:
        if st.idle_open >= args.idle and st.slow_open >= args.slow:
            break
        await asyncio.sleep(0.5)
    setup_s = time.monotonic() - t0
    log(f"setup {setup_s:.1f} s: {st.idle_open}/{args.idle} idle, {st.slow_open}/{args.slow} slow open "
        f"({st.idle_failed} idle connects failed)")
    idle_at_streams = st.idle_open
    slow_at_streams = st.slow_open

    body = json.dumps({"model": args.model_name, "prompt": args.prompt, "max_tokens": args.max_tokens,
                       "temperature": 0.8, "seed": 1, "stream": True}).encode()
    queue: asyncio.Queue = asyncio.Queue()
    for i in range(args.requests):
        queue.put_nowait(i)
    ts = time.monotonic()
    clients = [asyncio.ensure_future(stream_client(host, port, st, queue, body, args.request_timeout))
               for _ in range(args.clients)]
    last = 0.0
    while not all(c.done() for c in clients):
        await asyncio.sleep(0.5)
        if time.monotonic() - last > 10:
            last = time.monotonic()
            log(f"streams {st.stream_ok} ok, {len(st.stream_failed)} failed of {args.requests}; "
                f"{st.idle_open} idle, {st.slow_open} slow open")
    stream_s = time.monotonic() - ts
    idle_after_streams = st.idle_open
    slow_after_streams = st.slow_open

    # SIGTERM with the load attached: the idle and slow connections plus a few long streams.
    exit_s = None
    exit_code = None
    live_streams = []
    cpu_at_sigterm = cpu_seconds(pid)
    if pid and not args.no_sigterm:
        long_body = json.dumps({"model": args.model_name, "prompt": args.prompt, "max_tokens": 1900,
                                "temperature": 0.8, "seed": 2, "stream": True, "ignore_eos": True}).encode()
        live_streams = [asyncio.ensure_future(stream_request(host, port, long_body, 60)) for _ in range(args.live_streams)]
        await asyncio.sleep(1.0)
        log(f"SIGTERM to {pid} with {st.idle_open} idle, {st.slow_open} slow connections and "
            f"{sum(not t.done() for t in live_streams)} streams attached")
        stop_probe.set()  # the latency window ends here: a stopping server may refuse new connections
        st.terminating = True
        cpu_at_sigterm = cpu_seconds(pid)
        t_sig = time.monotonic()
        os.kill(pid, signal.SIGTERM)
        while time.monotonic() - t_sig < args.exit_wait:
            if proc is not None:
                if proc.poll() is not None:
                    exit_code = proc.returncode
                    break
            elif not Path(f"/proc/{pid}").exists():
                break
            await asyncio.sleep(0.01)
        else:
            log(f"the server did not exit within {args.exit_wait} s")
        if exit_code is not None or (proc is None and not Path(f"/proc/{pid}").exists()):
            exit_s = time.monotonic() - t_sig
    stop.set()
    stop_probe.set()
    await asyncio.sleep(0.2)
    for t in tasks + live_streams:
        t.cancel()
    await asyncio.gather(*tasks, *live_streams, return_exceptions=True)

    result = probe_rx.recv() if probe_rx.poll(30) else {"latencies": [], "failures": [("", "probe gave no result")], "rss": []}
    probe.join(5)
    lat_ms = [x[1] * 1000 for x in result["latencies"]]
    rss = [x[1] for x in result["rss"]]
    worst = sorted(result["latencies"], key=lambda x: -x[1])[:5]
    return {
        "setup_s": round(setup_s, 2),
        "machine": {"cpus": os.cpu_count(), "loadavg_start": load_start, "loadavg_end": Path("/proc/loadavg").read_text().split()[:3]},
        "server_cpu_s": cpu_at_sigterm,
        "connect_errors": st.connect_errors,
        "idle": {"target": args.idle, "open_when_streams_started": idle_at_streams,
                 "open_when_streams_ended": idle_after_streams, "opened": st.idle_opened,
                 "connect_failures": st.idle_failed, "closed_by_server": st.idle_closed_by_server},
        "slow": {"target": args.slow, "open_when_streams_started": slow_at_streams,
                 "open_when_streams_ended": slow_after_streams, "opened": st.slow_opened,
                 "closed_by_server": st.slow_closed_by_server, "connect_failures": st.slow_connect_failed,
                 "answers": st.slow_answers, "held_s_min": min(st.slow_lifetimes, default=None),
                 "held_s_max": max(st.slow_lifetimes, default=None)},
        "streams": {"clients": args.clients, "requests": args.requests, "ok": st.stream_ok,
                    "failed": len(st.stream_failed), "failures_sample": st.stream_failed[:5],
                    "seconds": round(stream_s, 2), "chunks": st.stream_tokens,
                    "latency_s_p50": pct(st.stream_latency, 0.5), "latency_s_max": max(st.stream_latency, default=None)},
        "health": {"probes": len(lat_ms), "failures": len(result["failures"]),
                   "failures_sample": result["failures"][:5],
                   "latency_ms_p50": pct(lat_ms, 0.5), "latency_ms_p99": pct(lat_ms, 0.99),
                   "latency_ms_max": max(lat_ms, default=None),
                   "worst": [{"t_s": round(t, 2), "ms": round(v * 1000, 2)} for t, v in worst]},
        "rss_mb": {"first": rss[0] if rss else None, "max": max(rss, default=None), "samples": len(rss)},
        "sigterm": {"sent": bool(pid and not args.no_sigterm), "exit_s": None if exit_s is None else round(exit_s, 3),
                    "exit_code": exit_code,
                    "live_streams_ended": sum(t.done() for t in live_streams)},
    }


def start_server(args) -> tuple[subprocess.Popen, str, int, Path]:
    logf = Path(tempfile.mkstemp(prefix="kestrel-load-", suffix=".log")[1])
    cmd = [args.binary, "serve", "-m", args.model, "--port", "0", "--served-model-name", args.model_name,
           *args.server_arg]
    log("starting " + " ".join(cmd))
    with open(logf, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    deadline = time.time() + 60
    while time.time() < deadline:
        text = logf.read_text(errors="replace")
        m = re.search(r"on http://([^:\s]+):(\d+)", text)
        if m:
            host = m.group(1) if m.group(1) not in ("0.0.0.0", "::") else "127.0.0.1"
            return proc, host, int(m.group(2)), logf
        if proc.poll() is not None:
            raise SystemExit(f"kestrel serve exited with {proc.returncode}:\n{text}")
        time.sleep(0.05)
    proc.kill()
    raise SystemExit("kestrel serve did not start:\n" + logf.read_text(errors="replace"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--binary", default=os.environ.get("KESTREL_BINARY", str(REPO / "build" / "kestrel")))
    ap.add_argument("--model", default=str(REPO.parent / "shared" / "data" / "stories260K" / "stories260K.gguf"))
    ap.add_argument("--model-name", default="stories")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="extra `kestrel serve` flag (repeat; use --server-arg=--flag for a leading dash)")
    ap.add_argument("--attach", metavar="HOST:PORT", help="use a running server instead of starting one")
    ap.add_argument("--pid", type=int, default=0, help="with --attach: the server's pid (RSS, SIGTERM)")
    ap.add_argument("--idle", type=int, default=10000, help="idle keep-alive connections")
    ap.add_argument("--slow", type=int, default=1000, help="slow-header connections")
    ap.add_argument("--slow-interval", type=float, default=2.0, help="seconds between a slow client's header lines")
    ap.add_argument("--clients", type=int, default=256, help="streaming clients")
    ap.add_argument("--requests", type=int, default=1024, help="streaming requests in all")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens per streaming request")
    ap.add_argument("--prompt", default="Once upon a time, there was a little girl named Lily.")
    ap.add_argument("--request-timeout", type=float, default=120.0, help="seconds a streaming request may take")
    ap.add_argument("--connect-concurrency", type=int, default=512, help="connects in flight at once")
    ap.add_argument("--setup-timeout", type=float, default=90.0, help="seconds to open the idle and slow connections")
    ap.add_argument("--no-reopen-idle", dest="reopen_idle", action="store_false",
                    help="do not reopen idle connections the server closes (by default they come back, as a pool would)")
    ap.add_argument("--health-interval-min", type=float, default=0.1)
    ap.add_argument("--health-interval-max", type=float, default=0.2)
    ap.add_argument("--health-timeout", type=float, default=5.0, help="a probe slower than this fails")
    ap.add_argument("--live-streams", type=int, default=16, help="long streams attached at SIGTERM")
    ap.add_argument("--no-sigterm", action="store_true")
    ap.add_argument("--exit-wait", type=float, default=30.0, help="seconds to wait for the exit after SIGTERM")
    ap.add_argument("--max-health-ms", type=float, default=100.0)
    ap.add_argument("--max-rss-mb", type=float, default=1024.0)
    ap.add_argument("--max-exit-s", type=float, default=5.0)
    args = ap.parse_args()

    nofile = raise_nofile(args.idle + args.slow + args.clients + args.live_streams + 256)
    proc = None
    logf = None
    if args.attach:
        host, _, port_s = args.attach.rpartition(":")
        port, pid = int(port_s), args.pid
    else:
        if not Path(args.binary).exists():
            print(f"load_test: no binary {args.binary}", file=sys.stderr)
            return 2
        proc, host, port, logf = start_server(args)
        pid = proc.pid
    log(f"server {host}:{port} pid {pid}; RLIMIT_NOFILE {nofile}")
    try:
        summary = asyncio.run(run_load(args, host, port, proc, pid))
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
    summary["server"] = {"binary": args.binary if proc else None, "model": args.model,
                         "args": args.server_arg, "address": f"{host}:{port}"}
    if logf is not None:
        tail = logf.read_text(errors="replace").splitlines()[-5:]
        summary["server"]["log_tail"] = tail
        os.unlink(logf)

    checks = {
        "zero failed streaming requests": summary["streams"]["failed"] == 0 and summary["streams"]["ok"] == args.requests,
        f"/health max latency < {args.max_health_ms:g} ms, no probe failed":
            summary["health"]["failures"] == 0 and (summary["health"]["latency_ms_max"] or 1e9) < args.max_health_ms,
        f"RSS max < {args.max_rss_mb:g} MB": summary["rss_mb"]["max"] is not None and summary["rss_mb"]["max"] < args.max_rss_mb,
        "idle and slow connections all open when the streams started":
            summary["idle"]["open_when_streams_started"] >= args.idle and summary["slow"]["open_when_streams_started"] >= args.slow,
    }
    if pid and not args.no_sigterm:
        exit_s = summary["sigterm"]["exit_s"]
        checks[f"exit within {args.max_exit_s:g} s of SIGTERM, status 0"] = (
            exit_s is not None and exit_s < args.max_exit_s and (proc is None or summary["sigterm"]["exit_code"] == 0))
    summary["checks"] = checks
    summary["passed"] = all(checks.values())
    print(json.dumps(summary, indent=2))
    for name, ok in checks.items():
        log(f"{'PASS' if ok else 'FAIL'}: {name}")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
