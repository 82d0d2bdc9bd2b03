#!/usr/bin/env python3
"""Beam search against greedy decoding on the same requests, through `kestrel batch`.

N requests (distinct prompts of about P tokens: a different opening sentence before a shared
story text) are run once greedy and once with use_beam_search (beam width B, the best beam
returned), each generating exactly T tokens (ignore_eos, so both runs emit the same token count).
Printed per run, from --stats-json: output tok/s (returned tokens: one per request and step),
wall time, peak KV blocks in use; then beam/greedy ratios of both. Runs alternate R times.

    python3 scripts/bench_beam.py --kestrel build/kestrel -m models/SmolLM2-135M-Instruct.Q4_1.gguf
"""
import argparse
import json
import subprocess
import tempfile
from pathlib import Path

OPENINGS = ["Once upon a time", "One sunny morning", "Long ago", "In a small village", "On a rainy day",
            "Far away", "One cold night", "In the big city", "Near the sea", "At the old farm",
            "In a quiet forest", "On a tall mountain", "By the river", "In a busy school", "Under the bridge",
            "At the end of the road"]
STORY = ("a little girl named Lily lived with her mother, her father and a small brown dog called Max. "
         "Every day Lily and Max walked to the park, where they played with a red ball, watched the ducks "
         "on the pond and talked to the old man who sold ice cream by the gate. Lily liked to ask him "
         "about the places he had seen when he was young, and he liked to tell her long stories about "
         "ships, mountains and cities full of lights. ")


def requests(n, beam, tokens, repeat):
    for i in range(n):
        r = {"id": i, "prompt": f"{OPENINGS[i % len(OPENINGS)]}, " + STORY * repeat, "max_tokens": tokens,
             "ignore_eos": True, "temperature": 0}
        if beam:
            r.update({"use_beam_search": True, "n": 1, "best_of": beam})
        yield json.dumps(r)


def run(args, beam, tmp):
    inp, out, stats = tmp / f"in{beam}.jsonl", tmp / f"out{beam}.jsonl", tmp / f"stats{beam}.json"
    inp.write_text("\n".join(requests(args.requests, beam, args.tokens, args.repeat)) + "\n")
    subprocess.run([args.kestrel, "batch", "-m", args.model, "-i", str(inp), "-o", str(out), "--stats-json", str(stats),
                    "--max-num-seqs", str(args.requests * max(beam, 1)), "--max-num-batched-tokens", "2048",
                    "-t", str(args.threads)], check=True, capture_output=True)
    return json.loads(stats.read_text())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kestrel", default="build/kestrel")
    ap.add_argument("-m", "--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--beam", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3, help="copies of the story text in each prompt (about 80 tokens each)")
    ap.add_argument("-t", "--threads", type=int, default=0)
    ap.add_argument("-r", "--rounds", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for _ in range(args.rounds):
            g = run(args, 0, tmp)
            b = run(args, args.beam, tmp)
            for name, s in (("greedy", g), (f"beam-{args.beam}", b)):
                print(f"{name}: {s['output_tokens_per_s']:.1f} output tok/s, {s['wall_s']:.2f} s, "
                      f"peak KV blocks {s['peak_kv_blocks_used']}, prompt tokens {s['prompt_tokens']}, "
                      f"prefill computed {s['prefill_tokens_computed']}, preemptions {s['preemptions']}")
            print(f"beam/greedy: tok/s {b['output_tokens_per_s'] / g['output_tokens_per_s']:.2f}, peak KV blocks "
                  f"{b['peak_kv_blocks_used'] / g['peak_kv_blocks_used']:.2f}")


if __name__ == "__main__":
    main()
