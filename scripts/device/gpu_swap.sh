#!/usr/bin/env bash
# Preemption by swap on the H200 (--swap-space, --preemption-mode; docs/architecture.md, "Many
# requests, traced"): the CUDA swap round trip test (pinned host pool, side-stream copies), then
# kestrel batch in a KV pool too small for its requests, recompute against swap against auto:
# preemptions, blocks swapped, prefill tokens computed, wall time, and how many outputs equal the
# recompute run's (on the GPU a different batch composition may change bits, so this is a count,
# not a pass/fail). With the 8B-shaped model of gpu_bench_8b.sh ($M8) present, the same on it.
# Carry: devbin (kestrel, kestrel_tests, stories260K.gguf).
set -uo pipefail
source scripts/device/device_env.sh
echo "== CUDA swap round trip (kestrel_tests)"
timeout 120 $BIN/kestrel_tests --gtest_filter='CudaModelRunner.SwappedBlocks*' --gtest_brief=1 2>&1 | tail -4 \
  | tee -a "$SUMMARY"

# run_modes MODEL JSONL FLAGS...: one kestrel batch per mode, then the comparison.
run_modes() {
  local model=$1 jsonl=$2
  shift 2
  for mode in recompute swap auto; do
    local swap=0
    [ "$mode" != recompute ] && swap=${SWAP_GIB:-8}
    timeout 280 "$K" batch -m "$model" --device cuda -i "$jsonl" -o /tmp/kestrel/swap_$mode.jsonl \
      --stats-json /tmp/kestrel/swap_$mode.stats.json --preemption-mode $mode --swap-space $swap "$@" 2>&1 | tail -2
  done
  python3 - <<'PY' | tee -a "$SUMMARY"
import json
def outs(mode):
    return {json.loads(l)["id"]: json.loads(l).get("output_ids") for l in open(f"/tmp/kestrel/swap_{mode}.jsonl")}
ref = outs("recompute")
for mode in ("recompute", "swap", "auto"):
    s = json.load(open(f"/tmp/kestrel/swap_{mode}.stats.json"))
    same = sum(1 for k, v in outs(mode).items() if ref.get(k) == v)
    print(f"{mode}: {s['preemptions']} preemptions ({s['swap_preemptions']} by swap), "
          f"{s['swapped_out_blocks']} blocks out / {s['swapped_in_blocks']} in, "
          f"{s['prefill_tokens_computed']} prefill tokens, {s['wall_s']:.2f} s, "
          f"{s['output_tokens_per_s']:.0f} output tok/s, {same}/{len(ref)} outputs equal to recompute's")
PY
}

echo "== stories260K: 64 requests (greedy and seeded), 24 blocks of 16 tokens"
python3 - <<'PY'
import json
starts = ["Once upon a time", "One day, a little", "Tom and Sue went", "The big dog"]
with open("/tmp/kestrel/swap_stories.jsonl", "w") as f:
    for i in range(64):
        r = {"id": i, "prompt": starts[i % 4] + f" number {i}", "max_tokens": 200, "ignore_eos": True}
        r.update({"temperature": 0} if i % 2 == 0 else {"temperature": 0.8, "seed": i})
        f.write(json.dumps(r) + "\n")
PY
run_modes $BIN/stories260K.gguf /tmp/kestrel/swap_stories.jsonl --num-kv-blocks 24 --max-model-len 256 \
  --max-num-seqs 32

if [ -d "$M8" ]; then
  echo "== 8B-shaped: 128 requests of 1000 prompt ids and 500 output tokens, 4000 blocks of 16"
  python3 - <<'PY'
import json, random
random.seed(1)
with open("/tmp/kestrel/swap_8b.jsonl", "w") as f:
    for i in range(128):
        f.write(json.dumps({"id": i, "prompt": [random.randrange(128256) for _ in range(1000)], "max_tokens": 500,
                            "ignore_eos": True, "temperature": 0}) + "\n")
PY
  SWAP_GIB=${SWAP_GIB:-32} run_modes "$M8" /tmp/kestrel/swap_8b.jsonl --num-kv-blocks 4000 --max-model-len 2048 \
    --max-num-seqs 128 --max-num-batched-tokens 8192
fi
echo "== summary"
cat "$SUMMARY"
