"""Summarises a GPU kernel trace of kestrel decode steps (CSV from `nsys stats --report
cuda_gpu_trace --format csv`, or from tools/kernel_trace's CUPTI injection library): per kernel
name, the time per decode step, and how much of the steps' span the GPU ran no kernel (launch gaps).
With programmatic dependent launch a kernel starts before the one it waits for ends, so its own
duration counts its wait too; "advance" is what it adds to the step's span (its end past every
earlier kernel's end), which sums to the busy time. Decode steps are told apart by the sampling
kernel that ends each one; the first `--skip` steps (prefill, warm-up, graph capture) are dropped,
and with `--decode-only` every step that ran a prefill attention kernel (prompt chunks) too.
Usage: python3 kernel_trace.py trace.csv [--skip 8] [--decode-only]"""
import argparse
import collections
import csv
import re

ap = argparse.ArgumentParser()
ap.add_argument("csv")
ap.add_argument("--skip", type=int, default=8)
ap.add_argument("--decode-only", action="store_true", help="drop steps with a prefill attention kernel")
args = ap.parse_args()

rows = []
with open(args.csv) as f:
    lines = [l for l in f if l.strip() and not l.startswith("NOTICE") and not l.startswith("Processing")]
for r in csv.DictReader(lines):
    name = r.get("Name") or ""
    start = int(float(r.get("Start (ns)") or 0))
    dur = int(float(r.get("Duration (ns)") or 0))
    if "[CUDA mem" in name or dur <= 0:
        continue
    rows.append((start, dur, name))
rows.sort()
# Steps end with the sampling kernel.
steps, cur = [], []
for row in rows:
    cur.append(row)
    if "sample" in row[2]:
        steps.append(cur)
        cur = []
steps = steps[args.skip:]
if args.decode_only:
    steps = [st for st in steps if not any("attention_prefill" in name for _, _, name in st)]
if not steps:
    raise SystemExit("no decode steps found")
per_name = collections.defaultdict(float)
advance = collections.defaultdict(float)
count = collections.defaultdict(int)
busy = span = 0.0
for st in steps:
    s0 = st[0][0]
    s1 = max(a + d for a, d, _ in st)
    span += s1 - s0
    # busy: union of kernel intervals (PDL lets them overlap)
    end = s0
    for a, d, n in st:
        short = re.sub(r"<.*", "", re.sub(r"^void ", "", n))[:60]
        per_name[short] += d
        count[short] += 1
        if a + d > end:
            busy += a + d - max(a, end)
            advance[short] += a + d - max(a, end)
            end = a + d
n = len(steps)
# The wait before each step's sampling kernel: from the previous kernel's end to its start (long
# when the sampler waits for something the host prepares, such as grammar token masks).
pre_sample = sorted(st[-1][0] - max(a + d for a, d, _ in st[:-1]) for st in steps if len(st) > 1)
if pre_sample:
    print(f"gap before the sampling kernel: mean {sum(pre_sample) / len(pre_sample) / 1e3:.1f} us, "
          f"p50 {pre_sample[len(pre_sample) // 2] / 1e3:.1f} us, p90 {pre_sample[len(pre_sample) * 9 // 10] / 1e3:.1f} us")
period = (steps[-1][0][0] - steps[0][0][0]) / max(n - 1, 1)
print(f"step period (first kernel to first kernel, host time included): {period / 1e3:.1f} us")
print(f"{n} decode steps: span {span / n / 1e3:.1f} us per step, kernels busy {busy / n / 1e3:.1f} us "
      f"({100 * busy / span:.1f}%), gaps {(span - busy) / n / 1e3:.1f} us")
print(f"  {'us/step':>9} {'advance':>9} {'calls':>6}  kernel")
for name, t in sorted(per_name.items(), key=lambda kv: -advance[kv[0]]):
    print(f"  {t / n / 1e3:9.1f} {advance[name] / n / 1e3:9.1f} {count[name] / n:6.1f}  {name}")
