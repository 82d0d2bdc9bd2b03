#!/usr/bin/env python3
"""Batch-1 CPU speed of kestrel beside llama.cpp on one GGUF file, in one run.

For each round, runs `kestrel bench` and then `llama-bench` with the same model, thread count,
prompt lengths and decode length, one repetition each (both do their own warm-up pass first), and
prints every run and the median per engine and test. Before each run it waits (up to --max-wait
seconds) until the 1-minute load average is below --max-load, since the VM is shared: the load
seen at the start of each run is printed beside it.

Tests, named as llama-bench names them:
  ppP @ dD   P prompt tokens in one forward pass after a D-token context (tok/s), for each P in
             --prompts and D in --depths ("ppP" alone when D is 0)
  tgN @ dD   N tokens decoded one at a time after a D-token context (tok/s); kestrel samples
             greedily through its engine, llama-bench does not sample.
Both tools get the same -p, -n and -d lists (llama-bench's -d, --n-depth; `kestrel bench -d`): the
context is computed before the timing starts.

  scripts/bench_vs_llamacpp.py --kestrel build/kestrel \\
      --llama-bench ../peer/llama.cpp/build/bin/llama-bench \\
      --model models/SmolLM2-135M-Instruct.Q4_1.gguf --threads 2 --prompts 128,2048 --n-gen 128 \\
      --depths 0,512,2048,4096 --rounds 3

Exit status 0 when every run succeeded and gave every test, 1 otherwise. Python 3 standard library only.
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import re
import statistics
import subprocess
import sys
import time


def wait_for_quiet(max_load: float, max_wait: float) -> float:
    """Waits until the 1-minute load average is below max_load (or max_wait s passed); returns it."""
    deadline = time.monotonic() + max_wait
    while True:
        load = os.getloadavg()[0]
        if load < max_load or time.monotonic() >= deadline:
            return load
        time.sleep(5)


def run(cmd: list[str]) -> str:
    print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{cmd[0]} exited with {p.returncode}: {p.stderr[-2000:]}")
    return p.stdout


KESTREL_ROW = re.compile(r"^\|(?:[^|]*\|){3,4}\s*((?:pp|tg)\d+(?: @ d\d+)?)\s*\|\s*([0-9.]+)")


def lists(a: argparse.Namespace) -> list[str]:
    """The -p, -n and -d arguments both tools take."""
    return ["-p", ",".join(map(str, a.prompts)), "-n", str(a.n_gen), "-d", ",".join(map(str, a.depths))]


def test_name(n_prompt: int, n_gen: int, n_depth: int) -> str:
    name = f"pp{n_prompt}" if n_gen == 0 else f"tg{n_gen}"
    return name + (f" @ d{n_depth}" if n_depth else "")


def kestrel_runs(a: argparse.Namespace) -> dict[str, float]:
    out: dict[str, float] = {}
    text = run([a.kestrel, "bench", "-m", a.model, "-t", str(a.threads), *lists(a), "-r", "1"])
    for line in text.splitlines():
        m = KESTREL_ROW.match(line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def llama_runs(a: argparse.Namespace) -> dict[str, float]:
    text = run([a.llama_bench, "-m", a.model, "-t", str(a.threads), *lists(a), "-r", "1", "-o", "csv"])
    out: dict[str, float] = {}
    for row in csv.DictReader(io.StringIO(text)):
        if not a.llama_build_shown:  # which llama.cpp and model file the figures belong to
            print(f"llama.cpp build {row['build_commit']} ({row['build_number']}), backends {row['backends']}, "
                  f"model {row['model_type']}", flush=True)
            a.llama_build_shown = True
        name = test_name(int(row["n_prompt"]), int(row["n_gen"]), int(row.get("n_depth") or 0))
        out[name] = float(row["avg_ts"])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kestrel", required=True, help="kestrel binary")
    ap.add_argument("--llama-bench", required=True, help="llama.cpp's llama-bench binary")
    ap.add_argument("--model", required=True, help="GGUF file both engines load")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", default="16,512", help="prompt lengths, comma-separated")
    ap.add_argument("--n-gen", type=int, default=128)
    ap.add_argument("--depths", default="0", help="context lengths before each test, comma-separated (-d of both tools)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-load", type=float, default=0.7, help="wait for the 1-minute load average to drop below this")
    ap.add_argument("--max-wait", type=float, default=300, help="seconds to wait for it before running anyway")
    a = ap.parse_args()
    a.prompts = [int(p) for p in a.prompts.split(",")]
    a.depths = [int(d) for d in a.depths.split(",")]
    a.llama_build_shown = False

    engines = [("kestrel", kestrel_runs), ("llama.cpp", llama_runs)]
    results: dict[str, dict[str, list[float]]] = {name: {} for name, _ in engines}
    loads: list[float] = []
    try:
        for r in range(a.rounds):
            for name, fn in engines:
                load = wait_for_quiet(a.max_load, a.max_wait)
                loads.append(load)
                figures = fn(a)
                for test, v in figures.items():
                    results[name].setdefault(test, []).append(v)
                shown = ", ".join(f"{t} {v:.1f}" for t, v in figures.items())
                print(f"round {r + 1} {name:9s} load {load:.2f}: {shown}", flush=True)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1

    print(f"\nloads at the starts of the runs: {min(loads):.2f}-{max(loads):.2f}")
    tests = [test_name(p, 0, d) for d in a.depths for p in a.prompts] + [test_name(0, a.n_gen, d) for d in a.depths]
    print("| test | kestrel (median, runs) | llama.cpp (median, runs) | ratio |")
    print("| --- | --- | --- | --- |")
    missing = False
    for t in tests:
        k, l = results["kestrel"].get(t, []), results["llama.cpp"].get(t, [])
        if len(k) != a.rounds or len(l) != a.rounds:
            print(f"error: {t}: {len(k)} kestrel and {len(l)} llama.cpp figures for {a.rounds} rounds", file=sys.stderr)
            missing = True
        if not k or not l:
            continue
        km, lm = statistics.median(k), statistics.median(l)
        runs = lambda v: ", ".join(f"{x:.1f}" for x in v)
        print(f"| {t} | {km:.1f} ({runs(k)}) | {lm:.1f} ({runs(l)}) | {km / lm:.2f}x |")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
