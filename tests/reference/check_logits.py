#!/usr/bin/env python3
"""kestrel's logits against the float64 reference (llama_ref.py), at every prompt position.

Runs `kestrel generate --dump-logits` on a prompt, feeds the same prompt ids to LlamaRef and
checks, for every position i, the relative error

    max_v |kestrel[i, v] - ref[i, v]| / max_v |ref[i, v]|

against --tol, and that the argmax agrees where the reference's top-2 margin is clear. Exits 1 on a
failure, 77 (ctest's "skipped") when numpy, gguf, the binary or the model is missing, unless
KESTREL_REQUIRE_REFERENCE=1 (scripts/test.sh sets it), when missing pieces are failures too.

Usage: check_logits.py --kestrel build/kestrel --model M.gguf [--prompt TEXT] [--tol 1e-3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

REQUIRED = os.environ.get("KESTREL_REQUIRE_REFERENCE") == "1"


def skip(why: str) -> None:
    print(f"{'FAILED' if REQUIRED else 'skipped'}: {why}", file=sys.stderr)
    sys.exit(1 if REQUIRED else 77)


try:
    import numpy as np

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from llama_ref import LlamaRef
except ImportError as e:  # pip install numpy gguf
    skip(str(e))

DEFAULT_PROMPT = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                  "Hugging Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?"
                  "<|im_end|>\n<|im_start|>assistant\n")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kestrel", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt", default=DEFAULT_PROMPT)
    ap.add_argument("--tol", type=float, default=1e-3)
    ap.add_argument("--kv-dtype", default="f32", help="KV cache element type kestrel uses (f32 or f16)")
    ap.add_argument("--env", action="append", default=[], help="extra NAME=VALUE for kestrel")
    args = ap.parse_args()
    for path in (args.kestrel, args.model):
        if not os.path.exists(path):
            skip(f"missing {path}")

    with tempfile.TemporaryDirectory() as tmp:
        npy = os.path.join(tmp, "logits.npy")
        env = dict(os.environ, **dict(e.split("=", 1) for e in args.env))
        out = subprocess.run([args.kestrel, "generate", "-m", args.model, "-p", args.prompt, "-n", "1",
                              "--temperature", "0", "--json", "--dump-logits", npy, "--kv-dtype", args.kv_dtype],
                             check=True, capture_output=True, text=True, env=env).stdout
        ids = json.loads(out)["prompt_ids"]
        ours = np.load(npy).astype(np.float64)
    ref = LlamaRef(args.model).logits(ids)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)

    rel = np.abs(ours - ref).max(axis=1) / np.abs(ref).max(axis=1)
    top2 = np.sort(ref, axis=1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 4 * np.abs(ours - ref).max(axis=1)
    argmax_ok = (ours.argmax(axis=1) == ref.argmax(axis=1)) | ~clear
    print(f"{os.path.basename(args.model)}: {len(ids)} positions, relative error max {rel.max():.3e} "
          f"(mean {rel.mean():.3e}, tolerance {args.tol:g}); argmax agrees at "
          f"{int((ours.argmax(1) == ref.argmax(1)).sum())}/{len(ids)} positions")
    bad = np.nonzero(rel > args.tol)[0]
    for i in bad[:10]:
        print(f"  position {i}: relative error {rel[i]:.3e}", file=sys.stderr)
    if len(bad) or not argmax_ok.all():
        print("FAILED", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
