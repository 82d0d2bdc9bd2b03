"""Summarises Nsight Compute's per-kernel durations of kestrel steps (CSV from `ncu --csv --metrics
gpu__time_duration.sum`, one row per kernel launch, graph nodes included): steps are told apart by
the sampling kernel that ends each one; the first `--skip` steps (prefill, warm-up) are dropped.
Prints, per step, the sum of kernel durations by kernel name (ncu serialises kernels, so launch
gaps and the overlap that programmatic dependent launch allows are not in these figures), and the
kernels of one step in launch order from `--from` for `--count` launches, with grid and block.
Usage: python3 ncu_steps.py trace.csv [--skip 2] [--from 0] [--count 40]"""
import argparse
import collections
import csv
import re

ap = argparse.ArgumentParser()
ap.add_argument("csv")
ap.add_argument("--skip", type=int, default=2)
ap.add_argument("--from", type=int, default=0, dest="first")
ap.add_argument("--count", type=int, default=40)
args = ap.parse_args()

with open(args.csv) as f:
    lines = [l for l in f if l.startswith('"')]
rows = []
for r in csv.DictReader(lines):
    if r.get("Metric Name") != "gpu__time_duration.sum":
        continue
    unit = r.get("Metric Unit", "nsecond")
    v = float(r["Metric Value"].replace(",", ""))
    ns = v * {"nsecond": 1, "usecond": 1e3, "msecond": 1e6}.get(unit, 1)
    name = re.sub(r"\(.*", "", re.sub(r"<.*", "", re.sub(r"^void ", "", r["Kernel Name"])))
    rows.append((int(r["ID"]), name[:60], ns, r.get("Grid Size", ""), r.get("Block Size", "")))
rows.sort()
steps, cur = [], []
for row in rows:
    cur.append(row)
    if "sample" in row[1]:
        steps.append(cur)
        cur = []
print(f"{len(rows)} kernels, {len(steps)} steps")
steps = steps[args.skip:]
if not steps:
    raise SystemExit("no decode steps found")
per = collections.defaultdict(float)
cnt = collections.defaultdict(int)
for st in steps:
    for _, n, d, _, _ in st:
        per[n] += d
        cnt[n] += 1
n = len(steps)
total = sum(per.values()) / n
print(f"{n} steps: {total / 1e3:.1f} us of kernels per step, {sum(cnt.values()) / n:.0f} launches per step")
for name, t in sorted(per.items(), key=lambda kv: -kv[1]):
    print(f"  {t / n / 1e3:9.1f} us/step  {cnt[name] / n:6.0f} x {t / cnt[name] / 1e3:7.2f} us  {name}")
st = steps[len(steps) // 2]
print(f"one step, launches {args.first}..{args.first + args.count}:")
for _, nm, d, g, b in st[args.first:args.first + args.count]:
    print(f"  {d / 1e3:8.2f} us  {nm:60s} grid {g} block {b}")
