#!/usr/bin/env python3
"""kestrel --device cuda against Hugging Face transformers on the same weights (device machine).

For an HF folder (-m DIR) or a GGUF file (--gguf FILE, dequantized by transformers' GGUF loader,
which needs the `gguf` package), runs `kestrel generate --dump-logits` on one prompt of at least
--min-positions tokens and compares the logits of every prompt position with transformers in
float32 on the GPU (TF32 off: the reference) and with transformers in bf16 (the peer's own
rounding, for scale). Prints one line per figure and RESULT PASS/FAIL: PASS needs argmax agreement
with the reference >= --min-agree and mean relative L2 error <= --tol.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
from transformers import AutoModelForCausalLM

STORY = ("Once upon a time, in a small village by the sea, there lived an old fisherman who told stories to the "
         "children every evening. He spoke of storms that lasted for weeks, of fish as large as boats, and of a "
         "lighthouse keeper who never slept. The children listened with wide eyes, and when the sun went down they "
         "walked home along the beach, counting the stars and arguing about which story was true. ")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kestrel", required=True)
    ap.add_argument("-m", "--model", help="HF model folder")
    ap.add_argument("--gguf", help="GGUF file (kestrel loads it directly; transformers through gguf_file)")
    ap.add_argument("--name", default="model")
    ap.add_argument("--min-positions", type=int, default=256)
    ap.add_argument("--tol", type=float, default=2e-2, help="max mean relative L2 error of kestrel cuda")
    ap.add_argument("--min-agree", type=float, default=0.99)
    ap.add_argument("--chat", action="store_true", help="no BOS games: the text is used as is")
    ap.add_argument("--prefill-chunk", type=int, default=256,
                    help="kestrel's prompt tokens per forward pass: 1 gives every position's logits from a "
                         "one-token decode step (teacher-forced decode)")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    path = args.gguf if args.gguf else args.model
    text = STORY
    while len(text) < 6 * args.min_positions:
        text += STORY
    npy = os.path.join(tempfile.mkdtemp(), "logits.npy")
    t = time.time()
    out = subprocess.run([args.kestrel, "generate", "-m", path, "-p", text, "-n", "1", "--temperature", "0",
                          "--json", "--dump-logits", npy, "--device", "cuda", "--prefill-chunk",
                          str(args.prefill_chunk)], check=True, capture_output=True,
                         text=True)
    ids = json.loads(out.stdout)["prompt_ids"]
    print(f"[{args.name}] kestrel cuda (prefill chunk {args.prefill_chunk}): {len(ids)} prompt positions in {time.time() - t:.1f} s "
          f"({' | '.join(out.stderr.strip().splitlines()[-2:])})")
    ours = np.load(npy).astype(np.float64)
    x = torch.tensor([ids], device="cuda")
    kw = {"gguf_file": os.path.basename(args.gguf)} if args.gguf else {}
    folder = os.path.dirname(os.path.abspath(args.gguf)) if args.gguf else args.model
    with torch.no_grad():
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kw).cuda().eval()
        ref = model(x).logits[0].double().cpu().numpy()
        model = model.to(torch.bfloat16)
        # .to(bf16) also rounds the non-persistent RoPE inv_freq buffer: recompute it in float32.
        for mod in model.modules():
            if hasattr(mod, "inv_freq") and hasattr(mod, "original_inv_freq"):
                mod.inv_freq = mod.original_inv_freq.to(device=mod.inv_freq.device, dtype=torch.float32)
        hf16 = model(x).logits[0].double().cpu().numpy()
        del model
        torch.cuda.empty_cache()

    def rel_max(a, b):
        return float((np.abs(a - b).max(axis=1) / np.abs(b).max(axis=1)).max())

    def rel_l2(a, b):
        return float((np.linalg.norm(a - b, axis=1) / np.linalg.norm(b, axis=1)).mean())

    def agree(a, b):
        return float((a.argmax(1) == b.argmax(1)).mean())

    # How decisive the reference's argmax is: the top-2 logit gap (random weights give flat logits).
    top2 = np.sort(ref, axis=1)[:, -2:]
    gap = top2[:, 1] - top2[:, 0]
    print(f"[{args.name}] reference top-2 logit gap: median {np.median(gap):.3e}, min {gap.min():.3e}; "
          f"logit std {ref.std(axis=1).mean():.3e}")
    print(f"[{args.name}] vs transformers f32: kestrel cuda mean rel L2 {rel_l2(ours, ref):.3e} "
          f"(max rel {rel_max(ours, ref):.3e}), transformers bf16 {rel_l2(hf16, ref):.3e} "
          f"(max rel {rel_max(hf16, ref):.3e})")
    a_ours, a_hf = agree(ours, ref), agree(hf16, ref)
    print(f"[{args.name}] argmax agreement over {len(ids)} positions: kestrel cuda {a_ours:.4f}, "
          f"transformers bf16 {a_hf:.4f}; kestrel vs transformers bf16 {agree(ours, hf16):.4f}")
    ok = a_ours >= args.min_agree and rel_l2(ours, ref) <= args.tol
    print(f"[{args.name}] RESULT", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
