#!/usr/bin/env bash
# Structured output on the GPU: JSON-Schema requests against the same requests unconstrained, at 64
# concurrent sequences on SmolLM2-135M-Instruct (Q4_1 GGUF), in `kestrel batch`.
#   N requests (default 128: two waves of 64, so that grammar compilation and the first use of each
#   token split are a small part of the run), chat messages asking for a JSON document for one of
#   the 20 schemas of bench/data/schemas (cycled), temperature 1, a seed each, max_tokens 256,
#   --max-num-seqs 64:
#   constrained   response_format json_schema: masks computed on the host while the GPU runs the
#                 layers, applied by the GPU sampler (no logits copy)
#   constrained_host  as constrained with "logprobs": true, "top_logprobs": 0, which sends every step
#                 to the host path (logits copied back, masks applied and sampled on the host, plus
#                 one logprob per token): the path grammar requests took before the device masks
#   free_matched  the same requests without response_format, each generating exactly as many
#                 tokens as its constrained run did ("ignore_eos", max_tokens = that count): the
#                 same work unconstrained, so output tok/s compare directly
#   free          the same requests without response_format and max_tokens 256 (their natural
#                 lengths; output tok/s then weighs prefill differently, compare mean TPOT)
# Prints each run's output tok/s and mean TPOT and the ratios constrained / free_matched
# (goal >= 0.95). ROUNDS=R (default 1) then runs constrained and free_matched R more times,
# alternating, and prints the ratio of their summed wall times: one machine's runs drift by more
# than the gap (free_matched alone 18-24k tok/s on one H100), so single pairs mislead.
# usage: gpu_grammar.sh DIR MODEL
#   DIR holds kestrel (plain or .xz, built with KESTREL_CUDA=ON), libpcre2-8.so.0, libxxhash.so.0;
#   MODEL the SmolLM2 GGUF file. Results in $OUT (inputs, outputs, logs and summary.txt).
# KESTREL_FLAGS: more kestrel flags for every run.
set -uo pipefail
D=$(realpath "$1")
M=$(realpath "$2")
cd "$(dirname "$0")/../.." || exit 1
OUT="${OUT:-/tmp/kestrel_grammar}"
N="${N:-128}"
mkdir -p "$OUT"
[ -f "$D/kestrel.xz" ] && xz -dkf "$D/kestrel.xz"
chmod +x "$D/kestrel"
export LD_LIBRARY_PATH="$D:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
S="$OUT/summary.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$S"
python3 - "$N" "$OUT" <<'PY'
import glob, json, os, sys
n, out = int(sys.argv[1]), sys.argv[2]
schemas = [(os.path.basename(p)[:-5], json.load(open(p))) for p in sorted(glob.glob("bench/data/schemas/*.json"))]
files = {k: open(os.path.join(out, k + ".jsonl"), "w") for k in ("constrained", "free", "constrained_host")}
# free_matched.jsonl is written after the constrained run (it takes that run's output lengths).
for i in range(n):
    name, schema = schemas[i % len(schemas)]
    base = {"id": i, "messages": [{"role": "user", "content": "Reply with a JSON document for this schema:\n" +
                                   json.dumps(schema)}],
            "temperature": 1.0, "seed": 1000 + i, "max_tokens": 256}
    rf = {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}
    files["free"].write(json.dumps(base) + "\n")
    files["constrained"].write(json.dumps(dict(base, response_format=rf)) + "\n")
    files["constrained_host"].write(json.dumps(dict(base, response_format=rf, logprobs=True, top_logprobs=0)) + "\n")
PY
run() {  # LABEL
  echo "== $1: $N requests, --max-num-seqs 64" | tee -a "$S"
  timeout 500 "$D/kestrel" batch -m "$M" --device cuda -i "$OUT/$1.jsonl" -o "$OUT/$1_out.jsonl" \
    --stats-json "$OUT/$1_stats.json" --max-num-seqs 64 ${KESTREL_FLAGS:-} > "$OUT/$1.log" 2>&1 ||
    echo "FAILED rc=$?" | tee -a "$S"
  tail -3 "$OUT/$1.log" | tee -a "$S"
}
run constrained
run constrained_host
python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
n_out = {}
for line in open(os.path.join(out, "constrained_out.jsonl")):
    r = json.loads(line)
    if "usage" in r:
        n_out[r["id"]] = r["usage"]["completion_tokens"]
with open(os.path.join(out, "free_matched.jsonl"), "w") as f:
    for line in open(os.path.join(out, "free.jsonl")):
        r = json.loads(line)
        if n_out.get(r["id"], 0) > 0:
            f.write(json.dumps(dict(r, max_tokens=n_out[r["id"]], ignore_eos=True)) + "\n")
PY
run free_matched
run free
python3 - "$OUT" <<'PY' | tee -a "$S"
import json, os, sys
out = sys.argv[1]
st = {}
for k in ("constrained", "constrained_host", "free_matched", "free"):
    try:
        st[k] = json.load(open(os.path.join(out, k + "_stats.json")))
    except (OSError, ValueError):
        print(k, "no stats")
for k, s in st.items():
    print(f"{k:17s} output {s['output_tokens_per_s']:8.1f} tok/s  mean TPOT {s['mean_tpot_ms']:6.2f} ms  "
          f"{s['output_tokens']} tokens in {s['wall_s']:.2f} s, {s['steps']} steps, errors {s['errors']}")
if "free_matched" in st and "constrained" in st:
    f, c = st["free_matched"], st["constrained"]
    print(f"constrained / free_matched: output tok/s {c['output_tokens_per_s'] / f['output_tokens_per_s']:.3f} "
          f"(goal >= 0.95), 1 / TPOT {f['mean_tpot_ms'] / c['mean_tpot_ms']:.3f}")
if "free" in st and "constrained" in st:
    f, c = st["free"], st["constrained"]
    print(f"constrained / free (natural lengths): 1 / TPOT {f['mean_tpot_ms'] / c['mean_tpot_ms']:.3f}")
if "constrained_host" in st and "constrained" in st:
    h, c = st["constrained_host"], st["constrained"]
    print(f"constrained device masks / host path: output tok/s {c['output_tokens_per_s'] / h['output_tokens_per_s']:.3f}")
# Every constrained output parses as JSON (the schemas' own checks: tests/reference/check_structured_outputs.py).
for k in ("constrained", "constrained_host"):
    bad = n = 0
    for line in open(os.path.join(out, k + "_out.jsonl")):
        r = json.loads(line)
        if r.get("finish_reason") != "stop":
            continue
        n += 1
        try:
            json.loads(r.get("text", ""))
        except ValueError:
            bad += 1
    print(f"{k}: {n} outputs ended with stop, {bad} of them not JSON")
PY
ROUNDS="${ROUNDS:-1}"
if [ "$ROUNDS" -gt 1 ]; then
  for r in $(seq 2 "$ROUNDS"); do
    for k in constrained free_matched; do
      timeout 500 "$D/kestrel" batch -m "$M" --device cuda -i "$OUT/$k.jsonl" -o "$OUT/${k}_r$r.out" \
        --stats-json "$OUT/${k}_stats_r$r.json" --max-num-seqs 64 ${KESTREL_FLAGS:-} > "$OUT/${k}_r$r.log" 2>&1 ||
        echo "FAILED $k round $r rc=$?" | tee -a "$S"
    done
  done
  python3 - "$OUT" "$ROUNDS" <<'PY' | tee -a "$S"
import json, os, sys
out, rounds = sys.argv[1], int(sys.argv[2])
def stats(k, r):
    return json.load(open(os.path.join(out, f"{k}_stats.json" if r == 1 else f"{k}_stats_r{r}.json")))
pairs = [(stats("constrained", r), stats("free_matched", r)) for r in range(1, rounds + 1)]
for r, (c, f) in enumerate(pairs, 1):
    print(f"round {r}: constrained {c['wall_s']:.3f} s, free_matched {f['wall_s']:.3f} s, "
          f"ratio {f['wall_s'] / c['wall_s']:.3f}; host s {c['host_seconds']:.3f} / {f['host_seconds']:.3f}, "
          f"mask fill s {c['mask_fill_seconds']:.3f}, device waiting for masks s {c.get('mask_wait_seconds', 0):.3f}")
c_s, f_s = sum(c["wall_s"] for c, _ in pairs), sum(f["wall_s"] for _, f in pairs)
print(f"{rounds} rounds: constrained / free_matched output tok/s (summed wall times) {f_s / c_s:.3f} (goal >= 0.95)")
PY
fi
echo "== summary" && cat "$S"
