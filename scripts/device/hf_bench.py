#!/usr/bin/env python3
"""The peer for the CUDA backend's benchmarks: HF transformers on the same model folder, same GPU, same run.

  batch-1 decode: 128-token prompt, 256 new tokens, greedy, static cache (transformers compiles
                  the decode step for it), after one warm-up generation;
  batch-64 decode: 64 x 512-token prompts, 128 new tokens, eager with the default dynamic cache;
                  decode rate = (64 x 127 tokens) / (time of 128 new - time of 1 new);
  prefill: one forward pass over 8 x 2048 tokens (logits of the last position only).
Prints one "HF <what>: <figure>" line each; --skip to leave some out.
--random: the model folder holds a config.json alone; the weights are transformers' random
initialisation, made on the GPU in bf16 (the shapes of a real model without its checkpoint, as
kestrel's --load-format dummy). --batch1-cache dynamic: batch-1 decode with the default dynamic
cache when the static cache's compile does not serve the architecture.
"""
import argparse
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM


def timed(fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t, out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--skip", default="", help="comma list of batch1,batch64,prefill")
    ap.add_argument("--random", action="store_true", help="random weights from the folder's config.json")
    ap.add_argument("--batch1-cache", default="static", choices=["static", "dynamic"])
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    torch.manual_seed(0)
    if args.random:
        config = AutoConfig.from_pretrained(args.model)
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).cuda().eval()
    V = model.config.vocab_size
    gen_kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        if "prefill" not in skip:
            x = torch.randint(0, V, (8, 2048), device="cuda")
            timed(lambda: model(x, logits_to_keep=1))
            dt = min(timed(lambda: model(x, logits_to_keep=1))[0] for _ in range(3))
            print(f"HF prefill 8x2048: {8 * 2048 / dt:.0f} tok/s ({dt * 1e3:.1f} ms)", flush=True)
        if "batch64" not in skip:
            x = torch.randint(0, V, (64, 512), device="cuda")
            timed(lambda: model.generate(x, max_new_tokens=2, min_new_tokens=2, **gen_kw))
            t1, _ = timed(lambda: model.generate(x, max_new_tokens=1, min_new_tokens=1, **gen_kw))
            tn, out = timed(lambda: model.generate(x, max_new_tokens=128, min_new_tokens=128, **gen_kw))
            print(f"HF batch-64 decode (eager, dynamic cache): {64 * 127 / (tn - t1):.0f} tok/s "
                  f"(TPOT {(tn - t1) / 127 * 1e3:.1f} ms)", flush=True)
        if "batch1" not in skip:
            x = torch.randint(0, V, (1, 128), device="cuda")
            kw = dict(gen_kw, cache_implementation="static") if args.batch1_cache == "static" else dict(gen_kw)
            t = time.perf_counter()
            timed(lambda: model.generate(x, max_new_tokens=256, min_new_tokens=256, **kw))  # compiles
            print(f"HF {args.batch1_cache}-cache warm-up: {time.perf_counter() - t:.0f} s", flush=True)
            t1 = min(timed(lambda: model.generate(x, max_new_tokens=1, min_new_tokens=1, **kw))[0] for _ in range(2))
            tn = min(timed(lambda: model.generate(x, max_new_tokens=256, min_new_tokens=256, **kw))[0]
                     for _ in range(2))
            print(f"HF batch-1 decode ({args.batch1_cache} cache): {255 / (tn - t1):.1f} tok/s", flush=True)


if __name__ == "__main__":
    main()
