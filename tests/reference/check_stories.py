#!/usr/bin/env python3
"""Validates llama_ref.py on stories260K: greedy decoding must reproduce upstream llama2.c.

expected-greedy-llama2c-run.txt (see its README) lists, per prompt, the ids run.c fed at each
position after the first: the forced prompt tokens, then greedy argmax tokens, `steps` positions
in all, stopping early only at BOS (id 1). We replay exactly that with the float64 reference and
require every id to match. Exits 1 on any mismatch, 77 (ctest's "skipped") when numpy, gguf
or the data is missing.

Usage: check_stories.py [--data DIR]   (default: ../shared/data/stories260K from the repo root)
"""

from __future__ import annotations

import argparse
import os
import sys

SKIP = 77
try:
    import numpy as np

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from llama_ref import LlamaRef
except ImportError as e:  # pip install numpy gguf
    print(f"skipped: {e}", file=sys.stderr)
    sys.exit(SKIP)

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BOS = 1


def parse_expected(path: str) -> list[dict]:
    cases, case = [], None
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.rstrip("\n")
            if line.startswith("=== prompt:"):
                case = {"prompt": line[len("=== prompt: "):]}
                cases.append(case)
            elif case is not None and ":" in line:
                key, value = line.split(":", 1)
                if key in ("steps",):
                    case[key] = int(value)
                elif key in ("prompt_ids", "next_ids"):
                    case[key] = [int(v) for v in value.split()]
    return cases


def replay(model: LlamaRef, prompt_ids: list[int], steps: int) -> list[int]:
    """run.c's loop: at position pos feed `token`; the next one is the prompt's while the prompt
    lasts, else the argmax; stop after `steps` positions or when the next token is BOS."""
    model.reset()
    token, fed = prompt_ids[0], []
    for pos in range(steps):
        logits = model.forward([token])[-1]
        nxt = prompt_ids[pos + 1] if pos + 1 < len(prompt_ids) else int(np.argmax(logits))
        if nxt == BOS:
            break
        fed.append(nxt)
        token = nxt
    return fed


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=os.path.join(REPO, "..", "shared", "data", "stories260K"))
    args = ap.parse_args()
    gguf_path = os.path.join(args.data, "stories260K.gguf")
    expected_path = os.path.join(args.data, "expected-greedy-llama2c-run.txt")
    if not (os.path.exists(gguf_path) and os.path.exists(expected_path)):
        print(f"skipped: missing {gguf_path} or {expected_path}", file=sys.stderr)
        return SKIP
    model = LlamaRef(gguf_path)
    failed = 0
    for case in parse_expected(expected_path):
        got = replay(model, case["prompt_ids"], case["steps"])
        want = case["next_ids"]
        if got == want:
            print(f"ok   prompt {case['prompt']!r} steps {case['steps']}: {len(want)} ids match")
            continue
        failed += 1
        first = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), min(len(got), len(want)))
        print(f"FAIL prompt {case['prompt']!r} steps {case['steps']}: first difference at index "
              f"{first}: got {got[first:first + 8]} want {want[first:first + 8]} "
              f"(lengths {len(got)} / {len(want)})")
    # The incremental (KV-cached) and the all-at-once forward must agree to float64 rounding.
    ids = parse_expected(expected_path)[2]["prompt_ids"]
    full = model.logits(ids)
    model.reset()
    step = np.concatenate([model.forward([t]) for t in ids])
    diff = float(np.max(np.abs(full - step)))
    consistent = diff < 1e-9
    print(f"{'ok  ' if consistent else 'FAIL'} incremental vs batched forward: max |diff| {diff:.2e}")
    failed += not consistent
    print(f"{'FAILED' if failed else 'PASSED'}: {failed} failure(s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
