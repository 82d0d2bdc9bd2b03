#!/usr/bin/env python3
"""Sanity check of llama_ref.py on SmolLM2-135M-Instruct (Q4_1 weights, Q8_0 tied embeddings).

There are no upstream logits for this model in the repo, so the check is semantic: for the
prompt below, the reference's argmax after "France is", "Germany is" and "Italy is" must be
" Paris", " Berlin" and " Rome". The prompt is tokenized with a minimal byte-level BPE written
here (GPT-2 byte-to-unicode map + the GGUF's merge ranks; enough for plain ASCII words), and
the ids are checked by decoding them back through the GGUF's token list.
Exits 1 on a mismatch, 77 (ctest's "skipped") when the model file is missing.

Usage: check_smollm2.py [--model PATH]   (default: models/SmolLM2-135M-Instruct.Q4_1.gguf)
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama_ref import LlamaRef, _field  # noqa: E402
from gguf import GGUFReader  # noqa: E402

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PROMPT = ("The capital of France is Paris. The capital of Germany is Berlin. "
          "The capital of Italy is")
# (prompt prefix whose last token's logits are checked, expected argmax piece)
EXPECT = [("The capital of France is", " Paris"),
          ("The capital of France is Paris. The capital of Germany is", " Berlin"),
          (PROMPT, " Rome")]


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters: printable Latin-1 bytes stand
    for themselves, the other 68 take code points 256, 257, ... in byte order."""
    keep = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
            + list(range(ord("®"), ord("ÿ") + 1)))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def bpe_encode(text: str, vocab: dict[str, int], ranks: dict[tuple[str, str], int]) -> list[int]:
    b2u = byte_to_unicode()
    ids = []
    # Words with their leading space, single digits, runs of punctuation, whitespace.
    for word in re.findall(r" ?[A-Za-z]+| ?[0-9]| ?[^\sA-Za-z0-9]+|\s+", text):
        parts = [b2u[b] for b in word.encode("utf-8")]
        while len(parts) > 1:
            pairs = [(ranks.get((a, b), 1 << 30), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
            rank, i = min(pairs)
            if rank == 1 << 30:
                break
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        ids.extend(vocab[p] for p in parts)
    return ids


def decode(ids: list[int], tokens: list[str]) -> str:
    u2b = {u: b for b, u in byte_to_unicode().items()}
    return bytes(u2b[c] for i in ids for c in tokens[i]).decode("utf-8")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.path.join(REPO, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    args = ap.parse_args()
    if not os.path.exists(args.model):
        print(f"skipped: missing {args.model}", file=sys.stderr)
        return 77
    reader = GGUFReader(args.model)
    tokens = [str(t) for t in _field(reader, "tokenizer.ggml.tokens")]
    merges = [str(m) for m in _field(reader, "tokenizer.ggml.merges")]
    vocab = {t: i for i, t in enumerate(tokens)}
    ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(merges)}

    ids = bpe_encode(PROMPT, vocab, ranks)
    assert decode(ids, tokens) == PROMPT, "tokenization does not round-trip"
    print(f"prompt {PROMPT!r}\n  {len(ids)} ids: {','.join(map(str, ids))}")
    t0 = time.perf_counter()
    model = LlamaRef(args.model)
    t1 = time.perf_counter()
    logits = model.logits(ids)
    t2 = time.perf_counter()
    print(f"  load+dequantize {t1 - t0:.1f} s, forward of {len(ids)} tokens {t2 - t1:.2f} s")

    failed = 0
    for prefix, want in EXPECT:
        pos = len(bpe_encode(prefix, vocab, ranks)) - 1
        row = logits[pos]
        logprobs = row - (row.max() + np.log(np.exp(row - row.max()).sum()))
        top = np.argsort(-row, kind="stable")[:5]
        got = decode([int(top[0])], tokens)
        ok = got == want
        failed += not ok
        shown = ", ".join(f"{decode([int(t)], tokens)!r} {int(t)} p={np.exp(logprobs[t]):.3f}" for t in top)
        print(f"{'ok  ' if ok else 'FAIL'} after {prefix[-20:]!r} (pos {pos}): want {want!r}; top-5: {shown}")
    print(f"{'FAILED' if failed else 'PASSED'}: {failed} failure(s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
