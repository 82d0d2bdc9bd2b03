#!/usr/bin/env python3
"""An independent float64 forward pass for Llama-family GGUF models (test reference only).

Kestrel's own kernels are checked against the logits this script writes, so it shares no code
with them: it reads the GGUF through the `gguf` package (container parsing only), dequantizes
the weights with its own code below, and runs the plain textbook computation in float64 with
numpy. Nothing here is tuned for speed beyond vectorising; a 16-token forward of the 135M
SmolLM2 model takes a few seconds, most of it dequantization.

Usage:
  llama_ref.py --model M.gguf --ids 1,2,3 --out logits.npy   # logits [n_tokens, n_vocab], float64
  llama_ref.py --model M.gguf --ids 1,2,3 --json             # argmax + top tokens per position
  llama_ref.py --model M.gguf --ids 1,2,3 --greedy 20 --json # also greedy continuation ids
  llama_ref.py --model M.gguf --check-dequant                # compare with gguf.quants

The model (Llama: Touvron et al. 2023, arXiv:2302.13971; as llama.cpp's "llama" GGUF arch):
  x = token_embd[ids]
  per layer: h = rmsnorm(x) * attn_norm; q, k, v = h Wq^T, h Wk^T, h Wv^T
             RoPE on q and k, rotating adjacent pairs (x[2i], x[2i+1]) by pos * theta^(-2i/n_rot)
             (the GGUF converter permutes HF's q/k rows into this layout);
             causal softmax(q k^T / sqrt(head_dim)) v, query head h reading KV head
             h // (n_head / n_head_kv) (GQA); x += attn Wo^T
             h = rmsnorm(x) * ffn_norm; x += (silu(h Wgate^T) * (h Wup^T)) Wdown^T
  logits = (rmsnorm(x) * output_norm) Wout^T, Wout = output.weight or, when absent, token_embd.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass

import numpy as np
from gguf import GGUFReader

# ggml type ids (ggml.h, enum ggml_type) of the formats this script can dequantize.
GGML_F32, GGML_F16, GGML_Q4_0, GGML_Q4_1, GGML_Q8_0 = 0, 1, 2, 3, 8
TYPE_NAMES = {GGML_F32: "F32", GGML_F16: "F16", GGML_Q4_0: "Q4_0", GGML_Q4_1: "Q4_1",
              GGML_Q8_0: "Q8_0"}
QK = 32  # values per block in Q4_0 / Q4_1 / Q8_0


def _f16_column(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The little-endian fp16 at byte `offset` of every block, as a float64 column [n_blocks, 1]."""
    return np.ascontiguousarray(blocks[:, offset:offset + 2]).view("<f2").astype(np.float64)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n_blocks, 16] bytes -> [n_blocks, 32] 4-bit values: byte j holds value j in its low
    nibble and value j + 16 in its high nibble (ggml's Q4 layout)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float64)


def dequantize(raw: np.ndarray, ggml_type: int, n_elements: int) -> np.ndarray:
    """Raw tensor bytes -> flat float64 array of n_elements values.

    Block layouts (ggml-common.h), each covering QK = 32 consecutive values of a row:
      Q4_0: fp16 d, 16 bytes of nibbles q;       x = (q - 8) * d           (18 bytes)
      Q4_1: fp16 d, fp16 m, 16 bytes of nibbles; x = q * d + m             (20 bytes)
      Q8_0: fp16 d, 32 int8 q;                   x = q * d                 (34 bytes)
    F32 / F16 are plain little-endian arrays.
    """
    raw = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if ggml_type == GGML_F32:
        out = raw.view("<f4").astype(np.float64)
    elif ggml_type == GGML_F16:
        out = raw.view("<f2").astype(np.float64)
    elif ggml_type == GGML_Q4_0:
        blocks = raw.reshape(-1, 18)
        out = (_nibbles(blocks[:, 2:]) - 8.0) * _f16_column(blocks, 0)
    elif ggml_type == GGML_Q4_1:
        blocks = raw.reshape(-1, 20)
        out = _nibbles(blocks[:, 4:]) * _f16_column(blocks, 0) + _f16_column(blocks, 2)
    elif ggml_type == GGML_Q8_0:
        blocks = raw.reshape(-1, 34)
        q = np.ascontiguousarray(blocks[:, 2:]).view(np.int8).astype(np.float64)
        out = q * _f16_column(blocks, 0)
    else:
        raise NotImplementedError(f"ggml type {ggml_type} is not supported by llama_ref.py")
    out = out.reshape(-1)
    if out.size != n_elements:
        raise ValueError(f"dequantized {out.size} values, expected {n_elements}")
    return out


def _field(reader: GGUFReader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise KeyError(f"GGUF metadata key {key} is missing")
        return default
    return field.contents()


@dataclass
class Hparams:
    arch: str
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    rope_theta: float
    rms_eps: float


class LlamaRef:
    """Dequantized float64 weights of one model, plus a forward pass with a simple KV cache."""

    def __init__(self, path: str):
        reader = GGUFReader(path)
        arch = _field(reader, "general.architecture")
        self.tensors = {t.name: t for t in reader.tensors}
        n_embd = int(_field(reader, f"{arch}.embedding_length"))
        n_head = int(_field(reader, f"{arch}.attention.head_count"))
        head_dim = int(_field(reader, f"{arch}.attention.key_length", n_embd // n_head))
        self.hp = Hparams(
            arch=arch,
            n_vocab=int(self.tensors["token_embd.weight"].shape[1]),
            n_embd=n_embd,
            n_layer=int(_field(reader, f"{arch}.block_count")),
            n_head=n_head,
            n_head_kv=int(_field(reader, f"{arch}.attention.head_count_kv", n_head)),
            head_dim=head_dim,
            n_rot=int(_field(reader, f"{arch}.rope.dimension_count", head_dim)),
            rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
            rms_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        )
        if "rope_freqs.weight" in self.tensors:
            raise NotImplementedError("Llama 3.1 RoPE frequency factors are not implemented")
        self.tokens = [str(t) for t in _field(reader, "tokenizer.ggml.tokens", [])]
        self.w = {}
        for name in self.tensors:
            self.w[name] = self._load(name)
        if "output.weight" not in self.w:  # tied embeddings
            self.w["output.weight"] = self.w["token_embd.weight"]
        self.reset()

    def _load(self, name: str) -> np.ndarray:
        t = self.tensors[name]
        # GGUF lists dimensions fastest-first (ne0 = row length); numpy wants them the other way.
        shape = [int(d) for d in reversed(t.shape)]
        return dequantize(t.data, int(t.tensor_type), int(t.n_elements)).reshape(shape)

    def reset(self) -> None:
        """Forgets the KV cache: the next forward() starts at position 0."""
        self.k_cache = [np.zeros((0, self.hp.n_head_kv, self.hp.head_dim))
                        for _ in range(self.hp.n_layer)]
        self.v_cache = [np.zeros((0, self.hp.n_head_kv, self.hp.head_dim))
                        for _ in range(self.hp.n_layer)]

    @property
    def n_past(self) -> int:
        return self.k_cache[0].shape[0]

    def _rms_norm(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.hp.rms_eps) * weight

    def _rope(self, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """x: [n_tokens, n_heads, head_dim]; rotates pairs (2i, 2i+1) of the first n_rot dims."""
        n_rot = self.hp.n_rot
        inv_freq = self.hp.rope_theta ** (-np.arange(0, n_rot, 2, dtype=np.float64) / n_rot)
        angle = pos[:, None, None].astype(np.float64) * inv_freq[None, None, :]
        cos, sin = np.cos(angle), np.sin(angle)
        out = x.copy()
        even, odd = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
        out[..., 0:n_rot:2] = even * cos - odd * sin
        out[..., 1:n_rot:2] = even * sin + odd * cos
        return out

    def forward(self, ids: list[int]) -> np.ndarray:
        """Appends `ids` after the cached positions; returns logits [len(ids), n_vocab] float64."""
        hp, w = self.hp, self.w
        n_new, start = len(ids), self.n_past
        pos = np.arange(start, start + n_new)
        x = w["token_embd.weight"][np.asarray(ids)]  # [n_new, n_embd]
        group = hp.n_head // hp.n_head_kv
        # Query i (absolute position start + i) sees keys 0 .. start + i.
        causal = np.arange(start + n_new)[None, :] <= pos[:, None]  # [n_new, n_ctx]
        for il in range(hp.n_layer):
            p = f"blk.{il}."
            h = self._rms_norm(x, w[p + "attn_norm.weight"])
            q = (h @ w[p + "attn_q.weight"].T).reshape(n_new, hp.n_head, hp.head_dim)
            k = (h @ w[p + "attn_k.weight"].T).reshape(n_new, hp.n_head_kv, hp.head_dim)
            v = (h @ w[p + "attn_v.weight"].T).reshape(n_new, hp.n_head_kv, hp.head_dim)
            q, k = self._rope(q, pos), self._rope(k, pos)
            self.k_cache[il] = k_all = np.concatenate([self.k_cache[il], k])
            self.v_cache[il] = v_all = np.concatenate([self.v_cache[il], v])
            # GQA: query head hq reads KV head hq // group.
            k_rep = np.repeat(k_all, group, axis=1)  # [n_ctx, n_head, head_dim]
            v_rep = np.repeat(v_all, group, axis=1)
            scores = np.einsum("qhd,khd->hqk", q, k_rep) / np.sqrt(hp.head_dim)
            scores = np.where(causal[None], scores, -np.inf)
            scores -= scores.max(axis=-1, keepdims=True)
            probs = np.exp(scores)
            probs /= probs.sum(axis=-1, keepdims=True)
            attn = np.einsum("hqk,khd->qhd", probs, v_rep).reshape(n_new, hp.n_head * hp.head_dim)
            x = x + attn @ w[p + "attn_output.weight"].T
            h = self._rms_norm(x, w[p + "ffn_norm.weight"])
            gate = h @ w[p + "ffn_gate.weight"].T
            up = h @ w[p + "ffn_up.weight"].T
            x = x + (gate / (1.0 + np.exp(-gate)) * up) @ w[p + "ffn_down.weight"].T
        x = self._rms_norm(x, w["output_norm.weight"])
        return x @ w["output.weight"].T

    def logits(self, ids: list[int]) -> np.ndarray:
        """Logits for every position of `ids` from an empty cache: [len(ids), n_vocab]."""
        self.reset()
        return self.forward(ids)

    def greedy(self, ids: list[int], n_new: int, stop: set[int] = frozenset()) -> list[int]:
        """Argmax continuation of `ids` (ties: lowest id), up to n_new tokens or a stop id."""
        out: list[int] = []
        logits = self.logits(ids)[-1]
        while len(out) < n_new:
            nxt = int(np.argmax(logits))
            out.append(nxt)
            if nxt in stop:
                break
            logits = self.forward([nxt])[-1]
        return out

    def piece(self, token_id: int) -> str:
        return self.tokens[token_id] if 0 <= token_id < len(self.tokens) else f"<{token_id}>"


def check_dequant(path: str) -> bool:
    """Compares this file's dequantization with gguf.quants.dequantize, one tensor per type."""
    from gguf import quants  # only for this cross-check; the forward never uses it

    reader = GGUFReader(path)
    seen, ok = set(), True
    for t in reader.tensors:
        ggml_type = int(t.tensor_type)
        if ggml_type in seen:
            continue
        seen.add(ggml_type)
        mine = dequantize(t.data, ggml_type, int(t.n_elements))
        theirs = np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float64).reshape(-1)
        # gguf computes in float32, we in float64: allow float32 rounding of the result.
        err = np.max(np.abs(mine - theirs) / (np.abs(theirs) + 1e-30)) if mine.size else 0.0
        good = mine.shape == theirs.shape and np.allclose(mine, theirs, rtol=1e-6, atol=1e-7)
        ok &= good
        print(f"{TYPE_NAMES.get(ggml_type, ggml_type):5s} {t.name}: "
              f"{'ok' if good else 'MISMATCH'} (max rel err {err:.2e})")
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="Llama-family GGUF file")
    ap.add_argument("--ids", help="comma-separated prompt token ids, e.g. 1,2,3")
    ap.add_argument("--out", help="write logits [n_tokens, n_vocab] float64 to this .npy file")
    ap.add_argument("--json", action="store_true", help="print argmax and top tokens as JSON")
    ap.add_argument("--top", type=int, default=5, help="top tokens per position in --json")
    ap.add_argument("--greedy", type=int, default=0, help="also generate N greedy tokens")
    ap.add_argument("--check-dequant", action="store_true",
                    help="compare the dequantization with gguf.quants and exit")
    args = ap.parse_args(argv)

    if args.check_dequant:
        return 0 if check_dequant(args.model) else 1
    if not args.ids:
        ap.error("--ids is required")
    ids = [int(s) for s in args.ids.split(",") if s.strip()]

    t0 = time.perf_counter()
    model = LlamaRef(args.model)
    t1 = time.perf_counter()
    if any(i < 0 or i >= model.hp.n_vocab for i in ids):
        ap.error(f"--ids must be in [0, {model.hp.n_vocab})")
    logits = model.logits(ids)
    t2 = time.perf_counter()
    print(f"load+dequantize {t1 - t0:.2f} s, forward of {len(ids)} tokens {t2 - t1:.2f} s",
          file=sys.stderr)
    if args.out:
        np.save(args.out, logits)
    if args.json or not args.out:
        m = logits.max(axis=-1, keepdims=True)
        logprobs = logits - (m + np.log(np.exp(logits - m).sum(axis=-1, keepdims=True)))
        report = {"model": args.model, "ids": ids, "n_vocab": model.hp.n_vocab,
                  "argmax": [int(a) for a in logits.argmax(axis=-1)], "top": []}
        for row, lp in zip(logits, logprobs):
            best = np.argsort(-row, kind="stable")[:args.top]
            report["top"].append([{"id": int(b), "piece": model.piece(int(b)),
                                   "logit": float(row[b]), "logprob": float(lp[b])}
                                  for b in best])
        if args.greedy:
            report["greedy"] = model.greedy(ids, args.greedy)
        print(json.dumps(report, indent=1, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
