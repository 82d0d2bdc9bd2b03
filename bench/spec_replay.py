#!/usr/bin/env python3
"""Replays draft policies of n-gram (prompt lookup) speculative decoding against recorded greedy
outputs, to bound what a policy can give at a measured verify cost.

Input: `kestrel bench --prompts FILE --output-ids IDS` (JSON lines of prompt_ids / output_ids; greedy,
so speculation does not change the outputs). A step drafts d tokens, keeps the prefix that equals
the output and emits one more token, and costs r(d) one-token steps; the first output token comes
from the prompt pass and is not counted. The speed-up is (output tokens - 1) / sum of step costs.

Policies:
  fixed      K drafts whenever the last n tokens (n from max_n down to min_n) occurred before
             (vLLM's ngram proposer; kestrel's "draft_length": "fixed").
  adaptive   the same lookup under a per-sequence draft limit, as NgramDrafter keeps it: after a
             cut draft one past what was kept, after a whole one doubled, up to K (kestrel's default).
  oracle     the same lookup, but only the drafts that will be accepted, cut where another one is
             not worth its cost: a bound for any policy over this lookup.
  oracle-any every earlier occurrence of the last n tokens (any n in [min_n, max_n]) tried, the
             longest accepted continuation kept, then cut as above: a bound for prompt lookup.

Costs: --cost r1,r2,...,rK (r(d) for d = 1..K; r(0) = 1), e.g. step times over the one-token time
from `kestrel_microbench --benchmark_filter=BM_Smollm2Matmuls`; or --linear C for r(d) = 1 + C d.
"""
import argparse
import json
import sys


def lookup(tokens, max_drafts, min_n, max_n, every=False):
    """The continuation(s) after earlier occurrences of the last n tokens, longest n first, most
    recent first; one (the first found) unless every. Past the end of tokens a continuation goes
    on with its own proposal, as NgramDrafter::lookup does."""
    found = []
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        for start in range(length - n - 1, -1, -1):
            if tokens[start:start + n] != suffix:
                continue
            out = []
            for i in range(max_drafts):
                src = start + n + i
                out.append(tokens[src] if src < length else out[src - length])
            if not every:
                return [out]
            found.append(out)
    return found


def accepted(draft, output, at):
    a = 0
    while a < len(draft) and at + a < len(output) and draft[a] == output[at + a]:
        a += 1
    return a


def worth(n_accepted, cost):
    """The draft length <= n_accepted that gives the most tokens per unit of cost."""
    best, best_rate = 0, 1.0
    for d in range(1, n_accepted + 1):
        rate = (d + 1) / cost(d)
        if rate > best_rate:
            best, best_rate = d, rate
    return best


def replay(prompt, output, policy, k, min_n, max_n, cost):
    """Cost (in one-token steps) of decoding output[1:] under the policy."""
    total, i, limit = 0.0, 1, k
    while i < len(output):
        context = prompt + output[:i]
        remaining = len(output) - i
        if policy in ("fixed", "adaptive", "oracle"):
            cap = min(limit if policy == "adaptive" else k, remaining)
            drafts = lookup(context, cap, min_n, max_n)
            draft = drafts[0] if drafts else []
            if policy == "oracle":
                draft = draft[:worth(accepted(draft, output, i), cost)]
        else:  # oracle-any
            best = []
            for d in lookup(context, min(k, remaining), min_n, max_n, every=True):
                if accepted(d, output, i) > accepted(best, output, i):
                    best = d
            draft = best[:worth(accepted(best, output, i), cost)]
        a = accepted(draft, output, i)
        total += cost(len(draft))
        i += min(a + 1, remaining)
        if policy == "adaptive" and draft:
            limit = min(2 * limit, k) if a >= len(draft) else a + 1
    return total


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ids", help="JSON lines written by kestrel bench --prompts ... --output-ids")
    ap.add_argument("--policy", default="fixed,adaptive,oracle,oracle-any")
    ap.add_argument("-k", type=int, default=4, help="most drafts a step (num_speculative_tokens)")
    ap.add_argument("--min-n", type=int, default=2, help="prompt_lookup_min")
    ap.add_argument("--max-n", type=int, default=5, help="prompt_lookup_max")
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument("--cost", help="r(1),...,r(K): a 1 + d token step's cost in one-token steps")
    group.add_argument("--linear", type=float, help="r(d) = 1 + LINEAR x d")
    args = ap.parse_args()

    if args.cost:
        table = [1.0] + [float(x) for x in args.cost.split(",")]
        if len(table) <= args.k:
            sys.exit(f"spec_replay: --cost gives r(d) for d <= {len(table) - 1}, -k is {args.k}")
        cost = lambda d: table[d]
    else:
        cost = lambda d: 1.0 + args.linear * d
    records = [json.loads(line) for line in open(args.ids) if line.strip()]
    if not records:
        sys.exit(f"spec_replay: {args.ids} holds no record")
    tokens = sum(len(r["output_ids"]) - 1 for r in records)
    for policy in args.policy.split(","):
        if policy not in ("fixed", "adaptive", "oracle", "oracle-any"):
            sys.exit(f"spec_replay: unknown policy {policy}")
        steps = sum(replay(r["prompt_ids"], r["output_ids"], policy, args.k, args.min_n, args.max_n, cost)
                    for r in records)
        print(f"{policy:10s} k={args.k} n={args.min_n}..{args.max_n}: speed-up {tokens / steps:.3f}x "
              f"({tokens} tokens, {steps:.1f} step costs)")


if __name__ == "__main__":
    main()
