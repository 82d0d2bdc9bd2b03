#!/usr/bin/env python3
"""kestrel on a Hugging Face folder against kestrel on the GGUF it was converted from.

Converts --gguf into an HF folder with gguf_to_hf.py (single file, shards, bf16; see there for the
q/k row un-permutation), then runs `kestrel generate` greedily on both with an f32 KV cache and
requires:
  - the same prompt ids (the folder's tokenizer.model + tokenizer_config.json against the GGUF
    vocabulary),
  - the same greedy output ids (-n tokens) unless --argmax-only,
  - at every prompt position, relative logit error max_v |hf - gguf| / max_v |gguf| <= --tol,
  - and the same argmax at every prompt position.
The two runs share kestrel's kernels but not its loaders, tokenizer files or RoPE pairing, so this
checks the safetensors reader, the HF config and name mapping, and rotate-half RoPE against the
GGUF path. Exits 1 on a failure, 77 (ctest's "skipped") when numpy, gguf, safetensors, the binary
or the model is missing, unless KESTREL_REQUIRE_REFERENCE=1.

Usage: check_hf_folder.py --kestrel build/kestrel --gguf M.gguf --out build/hf/m [--shards 2]
                          [--dtype bf16] [--tie] [--tol 1e-5] [-n 32] [--argmax-only]
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
    from gguf_to_hf import convert
except ImportError as e:  # pip install numpy gguf safetensors
    skip(str(e))

DEFAULT_PROMPT = "Once upon a time, there was a little girl named Lily. She loved to play outside"


def run(kestrel: str, model: str, prompt: str, n: int, npy: str) -> dict:
    cmd = [kestrel, "generate", "-m", model, "-p", prompt, "-n", str(n), "--temperature", "0", "--json",
           "--dump-logits", npy, "--kv-dtype", "f32"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        print(out.stderr, file=sys.stderr)
        raise SystemExit(f"FAILED: {' '.join(cmd)} exited {out.returncode}")
    return json.loads(out.stdout)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kestrel", required=True)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--out", required=True, help="folder to write the HF model into")
    ap.add_argument("--shards", type=int, default=1)
    ap.add_argument("--dtype", choices=("keep", "bf16"), default="keep")
    ap.add_argument("--tie", action="store_true")
    ap.add_argument("--prompt", default=DEFAULT_PROMPT)
    ap.add_argument("-n", type=int, default=32)
    ap.add_argument("--tol", type=float, default=1e-5)
    ap.add_argument("--argmax-only", action="store_true",
                    help="require argmax agreement at the prompt positions, not equal greedy ids")
    args = ap.parse_args()
    for path in (args.kestrel, args.gguf):
        if not os.path.exists(path):
            skip(f"missing {path}")
    if args.shards == 1 or args.dtype == "keep":
        try:
            import safetensors  # noqa: F401  (the writer of the non-bf16 variants)
        except ImportError as e:
            skip(str(e))

    convert(args.gguf, args.out, args.shards, args.dtype, args.tie)
    with tempfile.TemporaryDirectory() as tmp:
        ref = run(args.kestrel, args.gguf, args.prompt, args.n, os.path.join(tmp, "gguf.npy"))
        got = run(args.kestrel, args.out, args.prompt, args.n, os.path.join(tmp, "hf.npy"))
        ref_logits = np.load(os.path.join(tmp, "gguf.npy")).astype(np.float64)
        hf_logits = np.load(os.path.join(tmp, "hf.npy")).astype(np.float64)

    ok = True
    if got["prompt_ids"] != ref["prompt_ids"]:
        print(f"prompt ids differ:\n  gguf {ref['prompt_ids']}\n  hf   {got['prompt_ids']}", file=sys.stderr)
        return 1
    rel = np.abs(hf_logits - ref_logits).max(axis=1) / np.abs(ref_logits).max(axis=1)
    argmax_same = hf_logits.argmax(axis=1) == ref_logits.argmax(axis=1)
    same_ids = got["output_ids"] == ref["output_ids"]
    name = os.path.basename(os.path.normpath(args.out))
    print(f"{name}: {len(ref['prompt_ids'])} prompt positions, relative logit error max {rel.max():.3e} "
          f"(mean {rel.mean():.3e}, tolerance {args.tol:g}); argmax agrees at {int(argmax_same.sum())}/"
          f"{len(argmax_same)}; greedy ids ({len(ref['output_ids'])}) {'equal' if same_ids else 'DIFFER'}")
    for i in np.nonzero(rel > args.tol)[0][:10]:
        print(f"  position {i}: relative error {rel[i]:.3e}", file=sys.stderr)
        ok = False
    if not argmax_same.all():
        print(f"  argmax differs at positions {np.nonzero(~argmax_same)[0].tolist()}", file=sys.stderr)
        ok = False
    if not same_ids and not args.argmax_only:
        print(f"  greedy ids differ:\n    gguf {ref['output_ids']}\n    hf   {got['output_ids']}", file=sys.stderr)
        ok = False
    if len(ref["output_ids"]) != args.n and not args.argmax_only:
        print(f"  expected {args.n} generated ids, got {len(ref['output_ids'])}", file=sys.stderr)
        ok = False
    if not ok:
        print("FAILED", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
