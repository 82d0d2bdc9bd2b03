#!/usr/bin/env python3
"""Load client for an OpenAI-compatible server (`kestrel serve`, or any other): streaming requests
with fixed input and output lengths, arriving at a given rate with at most C in flight.

  .venv/bin/python bench/serve_bench.py --url http://127.0.0.1:8000 --rate inf --num-requests 512 \\
      --max-concurrency 256 --input-len 32 --output-len 32

Each request is POST /v1/completions with `prompt` = input-len random token ids (uniform in
--token-range, so the length is exact and no two prompts share a prefix), `max_tokens` =
output-len, `ignore_eos`, `stream` and `stream_options.include_usage`. Per request it records the
time to the first token (TTFT), the gaps between streamed chunks (ITL), the time per output token
after the first (TPOT = (e2e - TTFT) / (tokens - 1)) and the end-to-end latency; a request fails on
an HTTP error, a broken stream, a missing `data: [DONE]` or a token count other than output-len.
Reports p50/p90/p99 of each, request and token throughput, and the failures (--json FILE also
writes them as JSON). Needs aiohttp (scripts/test.sh's .venv: pip install aiohttp==3.12.15).
"""

import argparse
import asyncio
import json
import math
import random
import sys
import time

import aiohttp


def percentile(values, p):
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


class Result:
    def __init__(self):
        self.ok = False
        self.error = ""
        self.start = 0.0
        self.ttft = None
        self.itl = []
        self.e2e = 0.0
        self.prompt_tokens = 0
        self.output_tokens = 0


async def one_request(session, args, model, prompt, result):
    body = {"model": model, "prompt": prompt, "max_tokens": args.output_len, "ignore_eos": True,
            "temperature": args.temperature, "stream": True, "stream_options": {"include_usage": True}}
    headers = {"Content-Type": "application/json"}
    if args.api_key:
        headers["Authorization"] = "Bearer " + args.api_key
    result.start = time.perf_counter()
    last = result.start
    done = False
    try:
        async with session.post(args.url + "/v1/completions", json=body, headers=headers) as r:
            if r.status != 200:
                result.error = f"HTTP {r.status}: {(await r.text())[:200]}"
                return
            buf = b""
            async for data in r.content.iter_any():
                buf += data
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    if not event.startswith(b"data: "):
                        continue
                    payload = event[6:]
                    if payload == b"[DONE]":
                        done = True
                        continue
                    obj = json.loads(payload)
                    if "error" in obj:
                        result.error = "stream error: " + str(obj["error"])[:200]
                        return
                    now = time.perf_counter()
                    if obj.get("usage"):
                        result.prompt_tokens = obj["usage"]["prompt_tokens"]
                        result.output_tokens = obj["usage"]["completion_tokens"]
                    if any(c.get("text") for c in obj.get("choices", [])):
                        if result.ttft is None:
                            result.ttft = now - result.start
                        else:
                            result.itl.append(now - last)
                        last = now
        result.e2e = time.perf_counter() - result.start
        if not done:
            result.error = "the stream ended without data: [DONE]"
        elif result.output_tokens != args.output_len:
            result.error = f"{result.output_tokens} output tokens, expected {args.output_len}"
        elif result.ttft is None:
            result.error = "no text streamed"
        else:
            result.ok = True
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        result.error = f"{type(e).__name__}: {e}"


async def run(args):
    rng = random.Random(args.seed)
    lo, hi = (int(x) for x in args.token_range.split(":"))
    prompts = [[rng.randrange(lo, hi) for _ in range(args.input_len)] for _ in range(args.num_requests)]
    connector = aiohttp.TCPConnector(limit=args.max_concurrency or 0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=60, sock_read=args.timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        model = args.model
        if not model:
            headers = {"Authorization": "Bearer " + args.api_key} if args.api_key else {}
            async with session.get(args.url + "/v1/models", headers=headers) as r:
                model = (await r.json())["data"][0]["id"]
        sem = asyncio.Semaphore(args.max_concurrency or args.num_requests)
        results = [Result() for _ in prompts]

        async def limited(i):
            async with sem:
                await one_request(session, args, model, prompts[i], results[i])

        t0 = time.perf_counter()
        tasks = []
        for i in range(args.num_requests):
            tasks.append(asyncio.create_task(limited(i)))
            if args.rate != math.inf and i + 1 < args.num_requests:
                await asyncio.sleep(rng.expovariate(args.rate))  # Poisson arrivals
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    return model, results, duration


def report(args, model, results, duration):
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    ms = 1e3
    ttft = [r.ttft * ms for r in ok]
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) * ms for r in ok if r.output_tokens > 1]
    itl = [x * ms for r in ok for x in r.itl]
    e2e = [r.e2e * ms for r in ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    summary = {
        "model": model, "url": args.url, "num_requests": args.num_requests, "rate": args.rate,
        "max_concurrency": args.max_concurrency, "input_len": args.input_len, "output_len": args.output_len,
        "completed": len(ok), "failed": len(failed), "duration_s": duration,
        "request_throughput": len(ok) / duration, "output_token_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "errors": sorted({r.error for r in failed})[:10],
    }
    for name, values in (("ttft_ms", ttft), ("tpot_ms", tpot), ("itl_ms", itl), ("e2e_ms", e2e)):
        summary[name] = {"mean": sum(values) / len(values) if values else float("nan"),
                         **{f"p{p}": percentile(values, p) for p in (50, 90, 99)}}
    print(f"model {model}, {args.num_requests} requests, rate {args.rate}/s, max concurrency {args.max_concurrency}, "
          f"input {args.input_len} / output {args.output_len} tokens")
    print(f"completed {len(ok)}, failed {len(failed)}, duration {duration:.2f} s")
    print(f"request throughput {summary['request_throughput']:.2f} req/s, output {summary['output_token_throughput']:.1f} "
          f"tok/s, total (in + out) {summary['total_token_throughput']:.1f} tok/s")
    print(f"{'':8}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}  (ms)")
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        s = summary[name]
        print(f"{name[:-3].upper():8}{s['mean']:10.1f}{s['p50']:10.1f}{s['p90']:10.1f}{s['p99']:10.1f}")
    for e in summary["errors"]:
        print("error:", e)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return summary


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (without /v1)")
    p.add_argument("--rate", type=float, default=math.inf, help="requests per second (Poisson); inf = all at once")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--max-concurrency", type=int, default=256, help="requests in flight at most; 0 = no limit")
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=32, help="output tokens per request (ignore_eos)")
    p.add_argument("--token-range", default="100:500", help="prompt token ids are drawn from [lo, hi)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--model", default="", help="default: the first model of /v1/models")
    p.add_argument("--api-key", default="")
    p.add_argument("--timeout", type=float, default=1800, help="seconds without data before a request fails")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="", help="also write the summary to this file")
    args = p.parse_args()
    args.url = args.url.rstrip("/")
    summary = report(args, *asyncio.run(run(args)))
    sys.exit(1 if summary["failed"] else 0)


if __name__ == "__main__":
    main()
