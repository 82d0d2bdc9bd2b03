#!/usr/bin/env python3
"""Converts a Llama GGUF with F32/F16 tensors into a Hugging Face model folder (test data only).

Written for kestrel's HF-loader check (check_hf_folder.py): the folder must hold the same model
as the GGUF, laid out as transformers' LlamaForCausalLM saves it, so that kestrel run on either
gives the same tokens and logits. It reads the GGUF through the `gguf` package and writes:

  config.json              LlamaConfig fields from the llama.* metadata
  model.safetensors        or, with --shards 2, model-0000{1,2}-of-00002.safetensors and
                           model.safetensors.index.json ({"metadata": {"total_size"}, "weight_map"})
  tokenizer.model          a SentencePiece ModelProto built from tokenizer.ggml.{tokens, scores,
                           token_type} (the GGUF "llama" tokenizer is a SentencePiece BPE model)
  tokenizer_config.json    bos/eos/unk tokens, add_bos_token / add_eos_token, tokenizer_class

Tensor layout. A GGUF tensor with ne = [n_in, n_out] is n_out rows of n_in values, the gguf
package's array shape (n_out, n_in): already PyTorch's Linear [out_features, in_features] layout.
Names: token_embd -> model.embed_tokens, blk.N.attn_{q,k,v,output} ->
model.layers.N.self_attn.{q,k,v,o}_proj, blk.N.ffn_{gate,up,down} -> mlp.{gate,up,down}_proj,
blk.N.attn_norm -> input_layernorm, blk.N.ffn_norm -> post_attention_layernorm, output_norm ->
model.norm, output -> lm_head (left out with --tie, where transformers reuses embed_tokens).

RoPE row order (the one real transformation). GGUF "llama" rotates adjacent pairs of a head,
(x[2i], x[2i+1]), by angle pos * theta^(-2i/d); HF rotates (x[i], x[i + d/2]) by the same angle
("rotate half"). llama.cpp's HF->GGUF converter makes the first from the second by permuting the
rows of each head of q_proj and k_proj:

    permute(W) = W.reshape(n_head, 2, d/2, n_in).swapaxes(1, 2).reshape(n_head * d, n_in)

that is, GGUF row 2i + j of a head = HF row j * d/2 + i (j in {0, 1}, i in [0, d/2)). Its inverse,
applied here, is

    unpermute(W) = W.reshape(n_head, d/2, 2, n_in).swapaxes(1, 2).reshape(n_head * d, n_in)

with n_head = head_count for q and head_count_kv for k. Both q and k get the same permutation
within each head, so q.k (the only place their dimensions meet) and therefore the attention are
unchanged; v, o and the MLP are not touched. (llama2.c's stories260K.gguf was never permuted:
llama2.c itself rotates adjacent pairs. Unpermuting it still gives the HF equivalent.)

--dtype bf16 rounds every tensor to bfloat16 (round to nearest even on the float32 bits). numpy
has no bfloat16, so that variant's safetensors files are written by write_safetensors() below;
the others with the `safetensors` package (safetensors.numpy.save_file), so kestrel's reader is
checked against two writers.

Usage: gguf_to_hf.py --gguf stories260K.gguf --out DIR [--shards 2] [--dtype keep|bf16] [--tie]
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys

import numpy as np
from gguf import GGUFReader


def field(reader: GGUFReader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """GGUF adjacent-pair rows of each head -> HF rotate-half rows (see the module docstring)."""
    n_out, n_in = w.shape
    half = n_out // n_head // 2
    return w.reshape(n_head, half, 2, n_in).swapaxes(1, 2).reshape(n_out, n_in)


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounding to nearest even."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def write_safetensors(path: str, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    """A safetensors file from {name: (dtype name, array of that dtype's bytes)}, by hand: u64 header
    length, the JSON header padded with spaces to a multiple of 8, then the tensors back to back."""
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, (dtype, arr) in tensors.items():
        blob = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)


def save_file(path: str, tensors: dict[str, np.ndarray], dtype: str) -> None:
    if dtype == "bf16":
        write_safetensors(path, {n: ("BF16", to_bf16_bits(a)) for n, a in tensors.items()})
    else:
        from safetensors.numpy import save_file as st_save  # pip install safetensors

        st_save(tensors, path, metadata={"format": "pt"})


# ---- SentencePiece ModelProto (protobuf wire format; field numbers of sentencepiece_model.proto) ----
def _varint(v: int) -> bytes:
    v &= (1 << 64) - 1  # negative int32 values are sign-extended to 64 bits
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        out.append(b | (0x80 if v else 0))
        if not v:
            return bytes(out)


def _key(field_no: int, wire: int) -> bytes:
    return _varint(field_no << 3 | wire)


def _len_field(field_no: int, payload: bytes) -> bytes:
    return _key(field_no, 2) + _varint(len(payload)) + payload


def _int_field(field_no: int, v: int) -> bytes:
    return _key(field_no, 0) + _varint(v)


def sentencepiece_model(tokens, scores, types, unk: int, bos: int, eos: int, pad: int) -> bytes:
    """ModelProto: 1 = pieces {1 piece, 2 score (fixed32 float), 3 type}, 2 = TrainerSpec
    {3 model_type (2 = BPE), 35 byte_fallback, 40 unk_id, 41 bos_id, 42 eos_id, 43 pad_id},
    3 = NormalizerSpec {1 name, 3 add_dummy_prefix, 4 remove_extra_whitespaces}. GGUF token types
    use SentencePiece's enum (1 normal, 2 unknown, 3 control, 4 user defined, 5 unused, 6 byte)."""
    out = bytearray()
    for text, score, ty in zip(tokens, scores, types):
        piece = _len_field(1, text.encode()) + _key(2, 5) + struct.pack("<f", float(score)) + _int_field(3, int(ty))
        out += _len_field(1, piece)
    trainer = (_int_field(3, 2) + _int_field(35, 1) + _int_field(40, unk) + _int_field(41, bos) +
               _int_field(42, eos) + _int_field(43, pad))
    out += _len_field(2, trainer)
    out += _len_field(3, _len_field(1, b"identity") + _int_field(3, 1) + _int_field(4, 0))
    return bytes(out)


def convert(gguf_path: str, out_dir: str, shards: int = 1, dtype: str = "keep", tie: bool = False) -> None:
    r = GGUFReader(gguf_path)
    arch = field(r, "general.architecture")
    if arch != "llama":
        raise SystemExit(f"{gguf_path}: general.architecture is {arch!r}; this converter handles llama")
    n_head = int(field(r, "llama.attention.head_count"))
    n_head_kv = int(field(r, "llama.attention.head_count_kv", n_head))
    n_embd = int(field(r, "llama.embedding_length"))
    tokens = field(r, "tokenizer.ggml.tokens")
    if int(field(r, "llama.rope.dimension_count", n_embd // n_head)) != n_embd // n_head:
        raise SystemExit(f"{gguf_path}: partial RoPE is not a LlamaConfig setting")

    hf: dict[str, np.ndarray] = {}
    for t in r.tensors:
        if t.tensor_type.name not in ("F32", "F16"):
            raise SystemExit(f"{gguf_path}: tensor {t.name} is {t.tensor_type.name}; only F32/F16 are converted")
        w = np.array(t.data)  # copy out of the memory map
        parts = t.name.split(".")
        if t.name == "token_embd.weight":
            hf["model.embed_tokens.weight"] = w
        elif t.name == "output_norm.weight":
            hf["model.norm.weight"] = w
        elif t.name == "output.weight":
            hf["lm_head.weight"] = w
        elif parts[0] == "blk":
            p = f"model.layers.{parts[1]}."
            name = {
                "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj",
            }[parts[2]]
            if parts[2] == "attn_q":
                w = unpermute(w, n_head)
            elif parts[2] == "attn_k":
                w = unpermute(w, n_head_kv)
            hf[p + name + ".weight"] = w
        else:
            raise SystemExit(f"{gguf_path}: no HF name for tensor {t.name}")
    if tie and "lm_head.weight" in hf:
        if not np.array_equal(hf.pop("lm_head.weight"), hf["model.embed_tokens.weight"]):
            raise SystemExit(f"{gguf_path}: --tie, but output.weight differs from token_embd.weight")

    os.makedirs(out_dir, exist_ok=True)
    for name in os.listdir(out_dir):  # a re-run may change the layout (single file <-> shards)
        if name.endswith(".safetensors") or name.endswith(".json") or name == "tokenizer.model":
            os.remove(os.path.join(out_dir, name))
    names = sorted(hf)
    if shards == 1:
        save_file(os.path.join(out_dir, "model.safetensors"), {n: hf[n] for n in names}, dtype)
    else:
        weight_map, total = {}, 0
        for s in range(shards):
            shard = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = names[s::shards]
            save_file(os.path.join(out_dir, shard), {n: hf[n] for n in part}, dtype)
            for n in part:
                weight_map[n] = shard
                total += hf[n].size * (2 if dtype == "bf16" else hf[n].dtype.itemsize)
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)

    torch_dtype = {"bf16": "bfloat16"}.get(dtype, "float16" if hf["model.embed_tokens.weight"].dtype == np.float16
                                           else "float32")
    bos = int(field(r, "tokenizer.ggml.bos_token_id", 1))
    eos = int(field(r, "tokenizer.ggml.eos_token_id", 2))
    unk = int(field(r, "tokenizer.ggml.unknown_token_id", 0))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": n_embd,
        "intermediate_size": int(field(r, "llama.feed_forward_length")),
        "num_hidden_layers": int(field(r, "llama.block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_head_kv,
        "max_position_embeddings": int(field(r, "llama.context_length", 2048)),
        "rms_norm_eps": float(np.float32(field(r, "llama.attention.layer_norm_rms_epsilon", 1e-5))),
        "rope_theta": float(field(r, "llama.rope.freq_base", 10000.0)),
        "vocab_size": int(hf["model.embed_tokens.weight"].shape[0]),
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": tie,
        "torch_dtype": torch_dtype,
        "bos_token_id": bos,
        "eos_token_id": eos,
    }
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)

    pad = int(field(r, "tokenizer.ggml.padding_token_id", -1))
    pad = -1 if pad >= len(tokens) else pad  # GGUF writes 2^32 - 1 for "none"
    with open(os.path.join(out_dir, "tokenizer.model"), "wb") as f:
        f.write(sentencepiece_model(tokens, field(r, "tokenizer.ggml.scores"), field(r, "tokenizer.ggml.token_type"),
                                    unk, bos, eos, pad))
    tok_config = {
        "tokenizer_class": "LlamaTokenizer",
        "add_bos_token": bool(field(r, "tokenizer.add_bos_token", True)),
        "add_eos_token": bool(field(r, "tokenizer.add_eos_token", False)),
        "bos_token": tokens[bos],
        "eos_token": tokens[eos],
        "unk_token": tokens[unk],
        "model_max_length": config["max_position_embeddings"],
    }
    template = field(r, "tokenizer.chat_template")
    if template is not None:
        tok_config["chat_template"] = template
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(tok_config, f, indent=2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--shards", type=int, default=1)
    ap.add_argument("--dtype", choices=("keep", "bf16"), default="keep",
                    help="keep: tensors as in the GGUF (F32 or F16); bf16: all rounded to bfloat16")
    ap.add_argument("--tie", action="store_true", help="tie_word_embeddings: no lm_head.weight")
    args = ap.parse_args()
    convert(args.gguf, args.out, args.shards, args.dtype, args.tie)
    return 0


if __name__ == "__main__":
    sys.exit(main())
