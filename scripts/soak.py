#!/usr/bin/env python3
"""Soak test of `kestrel serve`: MINUTES (default 10) of mixed traffic from CLIENTS (default 64)
concurrent clients on the default model, then checks that nothing leaked or drifted.

The traffic, chosen at random per request: non-streaming and streaming completions and chat
completions, streams the client abandons after a few chunks (or before any answer), n > 1,
logprobs (with echo), stop strings, batched prompts, requests through the official `openai` client,
and malformed requests interleaved: truncated JSON, wrong field types, out-of-range values
(max_tokens 2^63 - 1, repetition_penalty 1e-38), 100,000-deep nesting, a Content-Length far over
the body limit, an unknown route. Each request has an expected status class (2xx for valid ones,
4xx for malformed ones).

Pass criteria: zero 5xx answers and zero connection errors (other than the client's own aborts);
every answer in its expected class; the server's RSS (VmRSS) at most 10% above its value at the end
of the first minute; /metrics `kestrel_kv_blocks_used` back to 0 after the traffic; a fixed greedy
request answers the same text before and after. Prints a JSON summary; exit status 0 when every
criterion holds, 1 otherwise, 2 on a setup error.

Starts `kestrel serve` itself (--binary, else $KESTREL_BINARY, else build/kestrel; the model is
models/SmolLM2-135M-Instruct.Q4_1.gguf; extra flags with --server-arg) or attaches with
--attach HOST:PORT --pid PID. Needs the `openai` package for the openai-client requests
(--no-openai leaves them out).

  scripts/soak.py --binary build/kestrel                 # 10 minutes, 64 clients
  scripts/soak.py --minutes 2 --clients 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load_test import log, read_body, read_head, rss_mb, start_server  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

PROMPTS = [
    "Once upon a time, in a small village by the sea,",
    "The best way to learn a new language is",
    "Here is a list of fruits: apple, banana,",
    "Q: What is the capital of Italy?\nA:",
    "def fibonacci(n):",
    "The weather today is",
]
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three colors.",
    "How many days are in a week?",
    "Tell me a short story about a cat.",
]
GREEDY = {"prompt": "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
          "max_tokens": 32, "temperature": 0}


class Result:
    def __init__(self) -> None:
        self.by_kind: dict[str, dict[str, int]] = {}
        self.status_5xx: list[str] = []
        self.unexpected: list[str] = []
        self.conn_errors: list[str] = []
        self.total = 0

    def add(self, kind: str, outcome: str) -> None:
        self.total += 1
        d = self.by_kind.setdefault(kind, {})
        d[outcome] = d.get(outcome, 0) + 1


async def http(host: str, port: int, method: str, path: str, body: bytes | None = None, *,
               headers: dict[str, str] | None = None, timeout: float = 300.0, abort_after_chunks: int | None = None):
    """One request on a fresh connection. Returns (status, body bytes); with abort_after_chunks, closes
    the connection after that many body chunks (0: right after sending) and returns (status or 0, b"")."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port, limit=1 << 22), 30)
    try:
        h = {"Host": f"{host}:{port}", "Connection": "close"}
        if body is not None:
            h["Content-Type"] = "application/json"
            h["Content-Length"] = str(len(body))
        h.update(headers or {})
        head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in h.items()) + "\r\n"
        writer.write(head.encode() + (body or b""))
        await writer.drain()
        if abort_after_chunks == 0:
            return 0, b""
        status, rh = await asyncio.wait_for(read_head(reader), timeout)
        if abort_after_chunks is not None and status == 200:
            seen = 0
            while seen < abort_after_chunks:
                line = await asyncio.wait_for(reader.readuntil(b"\r\n"), timeout)
                size = int(line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    break
                await reader.readexactly(size + 2)
                seen += 1
            return status, b""
        data = await asyncio.wait_for(read_body(reader, rh), timeout)
        return status, data
    finally:
        writer.transport.abort()


def sse_events(data: bytes) -> tuple[list[dict], bool]:
    events, done = [], False
    for line in data.decode("utf-8", "replace").split("\n"):
        if line.startswith("data: "):
            payload = line[6:].strip()
            if payload == "[DONE]":
                done = True
            else:
                events.append(json.loads(payload))
    return events, done


def valid_request(rng: random.Random, model: str) -> tuple[str, str, dict, dict]:
    """(kind, path, body, what to check) for one valid request."""
    kind = rng.choice(["completion", "completion_stream", "chat", "chat_stream", "n_choices", "logprobs",
                       "echo_logprobs", "stop", "batched_prompts", "abort_stream", "abort_early"])
    max_tokens = rng.randint(4, 48)
    sampling = {"temperature": rng.choice([0, 0.7, 1.0]), "top_p": rng.choice([1.0, 0.9]), "seed": rng.randint(0, 1 << 30)}
    if kind.startswith("chat"):
        body = {"model": model, "messages": [{"role": "user", "content": rng.choice(QUESTIONS)}],
                "max_tokens": max_tokens, **sampling}
        if rng.random() < 0.3:
            body.update(logprobs=True, top_logprobs=rng.randint(0, 5))
        if kind == "chat_stream":
            body["stream"] = True
        return kind, "/v1/chat/completions", body, {"stream": kind == "chat_stream"}
    body = {"model": model, "prompt": rng.choice(PROMPTS), "max_tokens": max_tokens, **sampling}
    check: dict = {}
    if kind == "completion_stream":
        body["stream"] = True
        check["stream"] = True
    elif kind == "n_choices":
        body["n"] = rng.randint(2, 4)
        body["temperature"] = 0.8
        check["choices"] = body["n"]
    elif kind == "logprobs":
        body["logprobs"] = rng.randint(0, 5)
    elif kind == "echo_logprobs":
        body.update(echo=True, logprobs=1, max_tokens=1, temperature=0)
    elif kind == "stop":
        body["stop"] = rng.choice([["\n"], [".", "!"], ["the"], "and"])
    elif kind == "batched_prompts":
        body["prompt"] = rng.sample(PROMPTS, 2)
        check["choices"] = 2
    elif kind == "abort_stream":
        body["stream"] = True
        body["max_tokens"] = 200
        check["abort_after_chunks"] = rng.randint(1, 4)
    elif kind == "abort_early":
        body["stream"] = rng.random() < 0.5
        check["abort_after_chunks"] = 0
    return kind, "/v1/completions", body, check


def malformed_request(rng: random.Random, model: str) -> tuple[str, str, bytes, dict[str, str]]:
    """(kind, path, raw body, extra headers); every one must get a 4xx."""
    kind = rng.choice(["bad_json", "wrong_type", "huge_max_tokens", "tiny_penalty", "deep_nesting",
                       "over_length", "unknown_route", "bad_n", "bad_stop", "bad_messages"])
    base = {"model": model, "prompt": "Hello", "max_tokens": 4}
    headers: dict[str, str] = {}
    path = "/v1/completions"
    if kind == "bad_json":
        raw = json.dumps(base).encode()[: rng.randint(1, 30)]
    elif kind == "wrong_type":
        field, value = rng.choice([("max_tokens", "ten"), ("temperature", "hot"), ("prompt", 5), ("stream", "yes"),
                                   ("logprobs", [1]), ("seed", 1.5)])
        raw = json.dumps({**base, field: value}).encode()
    elif kind == "huge_max_tokens":
        raw = json.dumps({**base, "max_tokens": rng.choice([9223372036854775807, 10 ** 30])}).encode()
    elif kind == "tiny_penalty":
        raw = json.dumps({**base, "repetition_penalty": 1e-38}).encode()
    elif kind == "deep_nesting":
        depth = 100_000
        field = rng.choice(["temperature", "prompt", "unknown_field"])
        raw = (f'{{"model":"{model}","max_tokens":4,"prompt":"a","{field}":' if field != "prompt"
               else f'{{"model":"{model}","max_tokens":4,"prompt":').encode() + b"[" * depth + b"]" * depth + b"}"
    elif kind == "over_length":
        raw = json.dumps(base).encode()
        headers["Content-Length"] = str(1 << 40)  # the body is never sent in full: 413 from the head
    elif kind == "unknown_route":
        path = rng.choice(["/v1/nothing", "/v2/completions"])
        raw = json.dumps(base).encode()
    elif kind == "bad_n":
        raw = json.dumps({**base, "n": rng.choice([0, -1, 10 ** 6])}).encode()
    elif kind == "bad_stop":
        raw = json.dumps({**base, "stop": rng.choice([7, [1, 2], {"a": 1}])}).encode()
    else:  # bad_messages
        path = "/v1/chat/completions"
        raw = json.dumps({"model": model, "messages": rng.choice(["hi", [{"role": "user"}], [{"content": 5}]])}).encode()
    return kind, path, raw, headers


async def one_valid(host, port, rng, model, res: Result) -> None:
    kind, path, body, check = valid_request(rng, model)
    try:
        status, data = await http(host, port, "POST", path, json.dumps(body).encode(),
                                  abort_after_chunks=check.get("abort_after_chunks"))
    except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError) as e:
        res.conn_errors.append(f"{kind}: {type(e).__name__}: {e}"[:200])
        res.add(kind, "connection error")
        return
    if "abort_after_chunks" in check:
        if status >= 500:
            res.status_5xx.append(f"{kind}: {status}")
        res.add(kind, f"aborted ({status or 'before the answer'})")
        return
    if status >= 500:
        res.status_5xx.append(f"{kind}: {status} {data[:200]!r}")
    if status != 200:
        res.unexpected.append(f"{kind}: {status} {data[:200]!r}")
        res.add(kind, str(status))
        return
    try:
        if check.get("stream"):
            events, done = sse_events(data)
            if not done or any("error" in e for e in events):
                raise ValueError(f"stream without [DONE] or with an error event: {data[-300:]!r}")
        else:
            obj = json.loads(data)
            if len(obj["choices"]) != check.get("choices", 1):
                raise ValueError(f"{len(obj['choices'])} choices")
            if any(c.get("finish_reason") not in ("stop", "length") for c in obj["choices"]):
                raise ValueError(f"finish_reason {[c.get('finish_reason') for c in obj['choices']]}")
        res.add(kind, "200")
    except (ValueError, KeyError) as e:
        res.unexpected.append(f"{kind}: {e}"[:300])
        res.add(kind, "bad answer")


async def one_malformed(host, port, rng, model, res: Result) -> None:
    kind, path, raw, headers = malformed_request(rng, model)
    try:
        status, data = await http(host, port, "POST", path, raw, headers=headers, timeout=60)
    except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError) as e:
        res.conn_errors.append(f"malformed {kind}: {type(e).__name__}: {e}"[:200])
        res.add("malformed_" + kind, "connection error")
        return
    if status >= 500:
        res.status_5xx.append(f"malformed {kind}: {status} {data[:200]!r}")
    elif not 400 <= status < 500:
        res.unexpected.append(f"malformed {kind}: {status} {data[:200]!r}")
    res.add("malformed_" + kind, str(status))


async def one_openai(client, rng, model, res: Result) -> None:
    import openai

    kind = rng.choice(["openai_completion", "openai_chat_stream"])
    try:
        if kind == "openai_completion":
            r = await client.completions.create(model=model, prompt=rng.choice(PROMPTS), max_tokens=rng.randint(4, 32),
                                                temperature=0.7, n=rng.choice([1, 2]), logprobs=rng.choice([None, 2]))
            if not r.choices:
                raise ValueError("no choices")
        else:
            stream = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": rng.choice(QUESTIONS)}],
                max_tokens=rng.randint(4, 32), stream=True)
            async for _ in stream:
                pass
        res.add(kind, "200")
    except openai.APIStatusError as e:
        if e.status_code >= 500:
            res.status_5xx.append(f"{kind}: {e.status_code} {str(e)[:200]}")
        res.unexpected.append(f"{kind}: {e.status_code} {str(e)[:200]}")
        res.add(kind, str(e.status_code))
    except (openai.APIConnectionError, openai.APITimeoutError) as e:
        res.conn_errors.append(f"{kind}: {type(e).__name__}: {e}"[:200])
        res.add(kind, "connection error")
    except ValueError as e:
        res.unexpected.append(f"{kind}: {e}")
        res.add(kind, "bad answer")


async def greedy_answer(host, port, model) -> str:
    """The fixed greedy request's text, or a line starting with "error:" saying why there is none."""
    try:
        status, data = await http(host, port, "POST", "/v1/completions", json.dumps({"model": model, **GREEDY}).encode())
    except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError) as e:
        return f"error: {type(e).__name__}: {e}"
    if status != 200:
        return f"error: status {status}: {data[:300]!r}"
    return json.loads(data)["choices"][0]["text"]


async def metric(host, port, names: list[str]) -> dict[str, float | None]:
    """The /metrics samples with these names (no labels), None where missing or unreachable."""
    out: dict[str, float | None] = {n: None for n in names}
    try:
        status, data = await http(host, port, "GET", "/metrics", timeout=30)
    except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError):
        return out
    for n in names:
        m = re.search(rb"(?m)^" + n.encode() + rb"(?:\{[^}]*\})? (\S+)$", data)
        if status == 200 and m:
            out[n] = float(m.group(1))
    return out


async def kv_blocks_used(host, port) -> float | None:
    return (await metric(host, port, ["kestrel_kv_blocks_used"]))["kestrel_kv_blocks_used"]


async def soak(args, host: str, port: int, pid: int, proc=None) -> dict:
    res = Result()
    greedy_before = await greedy_answer(host, port, args.model_name)
    log(f"greedy answer before: {greedy_before!r}")
    if greedy_before.startswith("error:"):
        raise SystemExit(f"soak: the greedy request failed before the traffic: {greedy_before}")
    client = None
    if not args.no_openai:
        import openai

        client = openai.AsyncOpenAI(base_url=f"http://{host}:{port}/v1", api_key="unused", max_retries=0, timeout=300)

    t0 = time.monotonic()
    end = t0 + args.minutes * 60
    rss: list[tuple[float, float]] = []
    died_at: list[float] = []

    async def sampler():
        nonlocal end
        while time.monotonic() < end:
            v = rss_mb(pid) if pid else None
            if v is not None:
                rss.append((time.monotonic() - t0, v))
            elif pid and not Path(f"/proc/{pid}").exists() or (proc is not None and proc.poll() is not None):
                died_at.append(time.monotonic() - t0)
                log(f"the server exited after {died_at[0]:.1f} s; stopping the traffic")
                end = time.monotonic()  # the workers finish their current request (refused) and stop
                return
            await asyncio.sleep(1.0)

    async def worker(i: int):
        rng = random.Random(args.seed * 1000 + i)
        while time.monotonic() < end:
            r = rng.random()
            if r < args.malformed_share:
                await one_malformed(host, port, rng, args.model_name, res)
            elif client is not None and r < args.malformed_share + args.openai_share:
                await one_openai(client, rng, args.model_name, res)
            else:
                await one_valid(host, port, rng, args.model_name, res)

    kv: list[tuple[float, float | None, float | None]] = []  # (t, blocks used, blocks cached)

    async def kv_sampler():
        # The prefix cache keeps finished requests' blocks; the pool's memory is touched as blocks
        # are first used, so RSS follows used + cached blocks until the pool is all touched.
        while time.monotonic() < end:
            m = await metric(host, port, ["kestrel_kv_blocks_used", "kestrel_kv_blocks_cached"])
            kv.append((time.monotonic() - t0, m["kestrel_kv_blocks_used"], m["kestrel_kv_blocks_cached"]))
            await asyncio.sleep(5.0)

    async def progress():
        while time.monotonic() < end:
            await asyncio.sleep(30)
            log(f"{(time.monotonic() - t0) / 60:.1f} min: {res.total} requests, {len(res.status_5xx)} 5xx, "
                f"{len(res.conn_errors)} connection errors, {len(res.unexpected)} unexpected; "
                f"RSS {rss[-1][1] if rss else float('nan'):.0f} MB; KV blocks used {kv[-1][1] if kv else None}, "
                f"cached {kv[-1][2] if kv else None}")

    await asyncio.gather(sampler(), kv_sampler(), progress(), *(worker(i) for i in range(args.clients)))
    run_s = time.monotonic() - t0
    if client is not None:
        await client.close()

    # Aborted streams are released by the engine's next steps: give it a moment.
    blocks = None
    for _ in range(50):
        blocks = await kv_blocks_used(host, port)
        if blocks == 0:
            break
        await asyncio.sleep(0.2)
    greedy_after = await greedy_answer(host, port, args.model_name)
    log(f"greedy answer after: {greedy_after!r}")

    base = [v for t, v in rss if t <= 60]
    baseline = base[-1] if base else None
    later = [v for t, v in rss if t > 60]
    growth = (max(later) - baseline) / baseline if baseline and later else None
    return {
        "minutes": args.minutes, "clients": args.clients, "seconds": round(run_s, 1), "requests": res.total,
        "requests_per_s": round(res.total / run_s, 2),
        "by_kind": dict(sorted(res.by_kind.items())),
        "status_5xx": len(res.status_5xx), "status_5xx_sample": res.status_5xx[:5],
        "connection_errors": len(res.conn_errors), "connection_errors_sample": res.conn_errors[:5],
        "unexpected": len(res.unexpected), "unexpected_sample": res.unexpected[:10],
        "rss_mb": {"at_1_min": baseline, "max_after_1_min": max(later, default=None),
                   "max": max((v for _, v in rss), default=None), "last": rss[-1][1] if rss else None,
                   "growth_after_1_min": None if growth is None else round(growth, 4)},
        "server_exited_at_s": died_at[0] if died_at else None,
        "kv_blocks": {"total": (await metric(host, port, ["kestrel_kv_blocks_total"]))["kestrel_kv_blocks_total"],
                      "used_max": max((u for _, u, _ in kv if u is not None), default=None),
                      "cached_at_1_min": next((c for t, _, c in reversed(kv) if t <= 60), None),
                      "cached_max": max((c for _, _, c in kv if c is not None), default=None)},
        "kv_blocks_used_at_end": blocks,
        "greedy": {"before": greedy_before, "after": greedy_after},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--binary", default=os.environ.get("KESTREL_BINARY", str(REPO / "build" / "kestrel")))
    ap.add_argument("--model", default=str(REPO / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--model-name", default="smollm2")
    ap.add_argument("--server-arg", action="append", default=["--max-model-len=2048"],
                    help="extra `kestrel serve` flag (repeat; use --server-arg=--flag for a leading dash)")
    ap.add_argument("--attach", metavar="HOST:PORT")
    ap.add_argument("--pid", type=int, default=0, help="with --attach: the server's pid (RSS)")
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--malformed-share", type=float, default=0.15, help="share of malformed requests")
    ap.add_argument("--openai-share", type=float, default=0.1, help="share of requests through the openai client")
    ap.add_argument("--no-openai", action="store_true")
    ap.add_argument("--max-rss-growth", type=float, default=0.10)
    args = ap.parse_args()

    proc = None
    if args.attach:
        host, _, port_s = args.attach.rpartition(":")
        port, pid = int(port_s), args.pid
    else:
        if not Path(args.binary).exists():
            print(f"soak: no binary {args.binary}", file=sys.stderr)
            return 2
        proc, host, port, logf = start_server(args)
        pid = proc.pid
    log(f"server {host}:{port} pid {pid}: {args.minutes:g} min at {args.clients} clients")
    try:
        summary = asyncio.run(soak(args, host, port, pid, proc))
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(30)
            except Exception:  # noqa: BLE001 - a hung server is killed; the summary says why
                proc.kill()
                proc.wait()
            summary_exit = proc.returncode
            log(f"server exit status {summary_exit}; log tail:\n" + "\n".join(
                logf.read_text(errors="replace").splitlines()[-5:]))
            os.unlink(logf)
    growth = summary["rss_mb"]["growth_after_1_min"]
    checks = {
        "the server stayed up": summary["server_exited_at_s"] is None,
        "zero 5xx": summary["status_5xx"] == 0,
        "zero connection errors": summary["connection_errors"] == 0,
        "every answer in its expected status class": summary["unexpected"] == 0,
        f"RSS growth after the first minute < {args.max_rss_growth:.0%}":
            growth is not None and growth < args.max_rss_growth,
        "KV blocks in use 0 at the end": summary["kv_blocks_used_at_end"] == 0,
        "greedy answer unchanged": summary["greedy"]["before"] == summary["greedy"]["after"]
                                   and not summary["greedy"]["after"].startswith("error:"),
    }
    summary["checks"] = checks
    summary["passed"] = all(checks.values())
    print(json.dumps(summary, indent=2))
    for name, ok in checks.items():
        log(f"{'PASS' if ok else 'FAIL'}: {name}")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
