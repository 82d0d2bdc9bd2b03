#!/usr/bin/env bash
# Dual-batch overlap (--enable-dbo) on the 8B shape with FP8 weights and KV: the
# offline run (gpu_offline_batch.sh) with and without it, alternating, how many of the requests'
# greedy outputs agree between them, then the two-stream kernel figures (`kestrel_cuda_bench overlap`).
# VOCAB_DIR as for gpu_offline_batch.sh. N: requests (1000). ROUNDS: pairs of runs (1).
# BENCH=0 skips the kernel figures.
set -uo pipefail
source scripts/device/device_env.sh
for r in $(seq "${ROUNDS:-1}"); do
  for mode in on off; do
    flags="--quantization fp8 --kv-cache-dtype fp8"
    [ "$mode" = on ] && flags="$flags --enable-dbo ${DBO_FLAGS:-}"
    echo "== offline, dbo $mode, round $r"
    KESTREL_FLAGS="$flags" scripts/device/gpu_offline_batch.sh > /dev/null 2>&1
    cp "$OUT/offline_log.txt" "$OUT/offline_log_${mode}_$r.txt"
    python3 -c "import json; s=json.load(open('/tmp/kestrel/offline_stats.json')); print('dbo $mode round $r:', json.dumps(s))" |
      tee -a "$OUT/dbo_summary.txt"
    cp /tmp/kestrel/offline_out.jsonl /tmp/kestrel/out_$mode.jsonl
  done
done
python3 - <<'PY'
import json
def load(p):
    return {json.loads(l)["id"]: json.loads(l) for l in open(p)}
a, b = load("/tmp/kestrel/out_off.jsonl"), load("/tmp/kestrel/out_on.jsonl")
def ids(r):
    return r.get("output_ids") or r.get("token_ids") or r.get("text")
same = sum(1 for k in a if k in b and ids(a[k]) == ids(b[k]))
print(f"greedy outputs identical with and without dbo: {same} of {len(a)}")
PY
if [ "${BENCH:-1}" = 1 ]; then
  echo "== kestrel_cuda_bench overlap"
  timeout 200 $BIN/kestrel_cuda_bench overlap 2>&1 | tee "$OUT/overlap.txt"
fi
