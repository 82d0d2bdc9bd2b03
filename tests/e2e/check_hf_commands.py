#!/usr/bin/env python3
"""Every kestrel command that takes -m must accept a Hugging Face folder where it accepts a GGUF.

Runs generate, chat, batch, tokenize, bench and plan with -m FOLDER and with -m GGUF (the folder
being the GGUF converted by tests/reference/gguf_to_hf.py; ctest's fixture makes it first) and
requires the same output: equal greedy text and ids (generate, chat, batch without its timing
fields), equal token ids (tokenize), the same KV geometry (plan --json) and a successful run
(bench). Exits 77 (skipped) when the folder or the GGUF is missing, unless
KESTREL_REQUIRE_REFERENCE=1.

Usage: check_hf_commands.py --kestrel build/kestrel --gguf stories260K.gguf --folder build/hf/stories260K_f32
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

REQUIRED = os.environ.get("KESTREL_REQUIRE_REFERENCE") == "1"


def run(cmd: list[str]) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"FAILED: {' '.join(cmd)} exited {out.returncode}:\n{out.stderr}")
    return out.stdout


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kestrel", required=True)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--folder", required=True)
    args = ap.parse_args()
    for path in (args.kestrel, args.gguf, os.path.join(args.folder, "config.json")):
        if not os.path.exists(path):
            print(f"{'FAILED' if REQUIRED else 'skipped'}: missing {path}", file=sys.stderr)
            return 1 if REQUIRED else 77

    k = args.kestrel
    failures = []

    def same(what: str, make) -> None:
        a, b = make(args.gguf), make(args.folder)
        if a != b:
            failures.append(f"{what}:\n  gguf   {a!r}\n  folder {b!r}")
        else:
            print(f"{what}: same output")

    same("generate", lambda m: json.loads(run([k, "generate", "-m", m, "-p", "Lily and Tom went to the park", "-n", "24",
                                               "--temperature", "0", "--json"])))
    same("chat", lambda m: run([k, "chat", "-m", m, "-p", "Tell me a story", "-n", "16", "--temperature", "0"]))
    same("tokenize", lambda m: run([k, "tokenize", "-m", m, "Once upon a time, a cat sat."]))
    with tempfile.TemporaryDirectory() as tmp:
        requests = os.path.join(tmp, "in.jsonl")
        with open(requests, "w") as f:
            f.write(json.dumps({"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0}) + "\n")
            f.write(json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6,
                                "temperature": 0}) + "\n")

        def batch(m: str) -> list[dict]:
            lines = [json.loads(line) for line in run([k, "batch", "-m", m, "-i", requests, "-o", "-"]).splitlines()]
            for line in lines:
                line.pop("ttft_ms", None)
                line.pop("tpot_ms", None)
            return lines

        same("batch", batch)

    def plan(m: str) -> dict:
        p = json.loads(run([k, "plan", "-m", m, "--json"]))
        return {key: p[key] for key in ("n_layer", "n_head_kv", "head_dim", "kv_bytes_per_token", "context")}

    same("plan", plan)
    bench = run([k, "bench", "-m", args.folder, "-p", "16", "-n", "4", "-r", "1"])
    if "pp16" not in bench or "tg4" not in bench:
        failures.append(f"bench: no pp16/tg4 rows in\n{bench}")
    else:
        print("bench: ran")

    for f in failures:
        print(f"FAILED {f}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
