#!/usr/bin/env python3
"""xgrammar (PyPI) on the schemas and vocabularies of kestrel_grammar_bench, measured the same way,
for the comparison table in docs/performance.md.

Per vocabulary: compile time per schema (the median of 9 compile_json_schema calls, compact
separators and no free whitespace, as kestrel's default grammar), then per schema `--walks` random
walks timed per token (fill_next_token_bitmask; then a token drawn from the mask, half the time
among the allowed tokens of at most two bytes; a walk ends when the mask allows the stop token, as
kestrel's ends when the grammar can end, or after 256 tokens). "Cold" is the first pass over a
freshly compiled grammar, "warm" the same walks again on it. One thread. The times include one
Python-to-C++ call per mask (about 1 us).

  xgrammar_bench.py --schemas bench/data/schemas --gguf models/SmolLM2-135M-Instruct.Q4_1.gguf \
                    --bpe ../shared/data/llama3-bpe-vocab [--walks 4]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import time

from importlib.metadata import version

import numpy as np
import torch
import xgrammar as xgr


def pct(v: list[float], p: float) -> float:
    if not v:
        return 0.0
    s = sorted(v)
    return s[min(len(s) - 1, int(p / 100.0 * len(s)))]


def byte_decoder() -> dict[str, int]:
    # GPT-2's byte-to-unicode table, inverted.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def token_byte_lengths(tokens: list[str], special: set[int]) -> list[int]:
    dec = byte_decoder()
    return [len(t.encode()) if i in special else sum(1 for c in t if c in dec) for i, t in enumerate(tokens)]


def bench_vocab(label: str, tokens: list[str], stop_id: int, special: set[int], schemas: list[str], walks: int) -> None:
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo(tokens, vocab_type=xgr.VocabType.BYTE_LEVEL, stop_token_ids=[stop_id])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    vocab_ms = (time.perf_counter() - t0) * 1e3
    n_vocab = len(tokens)
    blen = np.array(token_byte_lengths(tokens, special))
    compile_us, cold, warm = [], [], []
    for path in schemas:
        schema = json.load(open(path, encoding="utf-8"))
        text = json.dumps(schema)
        c = []
        for _ in range(9):
            t = time.perf_counter()
            cg = compiler.compile_json_schema(text, any_whitespace=False, separators=(",", ":"), strict_mode=True)
            c.append((time.perf_counter() - t) * 1e6)
        compile_us.append(pct(c, 50))
        bitmask = xgr.allocate_token_bitmask(1, n_vocab)
        for w in range(2 * walks):
            first_pass = w < walks
            rng = random.Random(1234 + w % walks)
            m = xgr.GrammarMatcher(cg)
            for _ in range(256):
                if m.is_terminated():
                    break
                t = time.perf_counter()
                m.fill_next_token_bitmask(bitmask)
                (cold if first_pass else warm).append((time.perf_counter() - t) * 1e6)
                words = bitmask[0].numpy().view(np.uint32)
                allowed = np.nonzero((words[np.arange(n_vocab) // 32] >> (np.arange(n_vocab) % 32)) & 1)[0]
                if stop_id in set(allowed.tolist()):
                    break
                if allowed.size == 0:
                    print(f"{label}: {os.path.basename(path)}: empty mask")
                    break
                short = allowed[blen[allowed] <= 2]
                pool = short if (rng.randrange(2) == 0 and short.size) else allowed
                tok = int(pool[rng.randrange(pool.size)])
                if not m.accept_token(tok):
                    print(f"{label}: {os.path.basename(path)}: masked token {tok} not accepted")
                    break
    print(f"{label} ({n_vocab} tokens; tokenizer info + compiler {vocab_ms:.1f} ms) xgrammar {version('xgrammar')}")
    print(f"  compile per schema: p50 {pct(compile_us, 50):.0f} us, max {pct(compile_us, 100):.0f} us")
    print(f"  mask, cold grammar: {len(cold)} tokens, p50 {pct(cold, 50):.1f} us, p99 {pct(cold, 99):.1f} us, "
          f"max {pct(cold, 100):.1f} us")
    print(f"  mask, warm grammar: {len(warm)} tokens, p50 {pct(warm, 50):.1f} us, p99 {pct(warm, 99):.1f} us, "
          f"max {pct(warm, 100):.1f} us")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--schemas", default="bench/data/schemas")
    ap.add_argument("--gguf")
    ap.add_argument("--bpe")
    ap.add_argument("--walks", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(1)
    schemas = sorted(glob.glob(os.path.join(args.schemas, "*.json")))
    print(f"{len(schemas)} schemas from {args.schemas}, {args.walks} walks each, cold then warm")
    if args.gguf:
        from gguf import GGUFReader

        r = GGUFReader(args.gguf)
        f = r.fields["tokenizer.ggml.tokens"]
        tokens = [bytes(f.parts[i]).decode("utf-8") for i in f.data]
        types = r.fields["tokenizer.ggml.token_type"]
        special = {i for i, d in enumerate(types.data) if int(types.parts[d][0]) == 3}
        eos = int(r.fields["tokenizer.ggml.eos_token_id"].parts[-1][0])
        bench_vocab(args.gguf, tokens, eos, special, schemas, args.walks)
    if args.bpe:
        enc = json.load(open(os.path.join(args.bpe, "encoder.json"), encoding="utf-8"))
        tokens = [""] * len(enc)
        for t, i in enc.items():
            tokens[i] = t
        tokens += ["<|begin_of_text|>", "<|end_of_text|>"]
        bench_vocab(args.bpe, tokens, 128001, {128000, 128001}, schemas, args.walks)


if __name__ == "__main__":
    main()
