#!/usr/bin/env bash
# offline throughput through batch mode, 1,000 requests of 1,000
# random prompt ids and 1,000 output tokens (EOS ignored, greedy) on the 8B-shaped model.
# KESTREL_FLAGS: more kestrel flags for the run (e.g. --cuda-gemm-tune=off, or --quantization fp8
# --kv-cache-dtype fp8). BATCH_TIMEOUT: seconds the batch may take (540).
# VOCAB_DIR: a folder with the Llama 3 vocabulary as vocab.json + merges.txt (from
# ../shared/data/llama3-bpe-vocab: encoder.json and vocab.bpe, renamed; carried): the weights are then
# random ones made in memory from configs/llama-3.1-8b (--load-format dummy; `kestrel batch` needs a
# tokenizer for its text output even with token-id prompts), else the saved model of
# gpu_bench_8b.sh ($M8).
set -uo pipefail
source scripts/device/device_env.sh
N="${N:-1000}"
LOAD=()
if [ -n "${VOCAB_DIR:-}" ]; then
  M8=/tmp/kestrel/llama8b_dummy
  mkdir -p "$M8"
  cp scripts/device/configs/llama-3.1-8b/config.json "$VOCAB_DIR/vocab.json" "$VOCAB_DIR/merges.txt" "$M8/"
  LOAD=(--load-format dummy)
fi
python3 - "$N" <<'PY'
import json, random, sys
n = int(sys.argv[1])
random.seed(0)
with open("/tmp/kestrel/offline.jsonl", "w") as f:
    for i in range(n):
        f.write(json.dumps({"id": i, "prompt": [random.randrange(128256) for _ in range(1000)], "max_tokens": 1000,
                            "ignore_eos": True, "temperature": 0}) + "\n")
PY
echo "== kestrel batch: $N x (1000 in, 1000 out)"
timeout "${BATCH_TIMEOUT:-540}" "$K" batch -m "$M8" "${LOAD[@]}" --device cuda -i /tmp/kestrel/offline.jsonl -o /tmp/kestrel/offline_out.jsonl \
  --stats-json /tmp/kestrel/offline_stats.json --max-num-seqs "${MAX_SEQS:-512}" --max-num-batched-tokens 8192 \
  --max-model-len 2048 ${KESTREL_FLAGS:-} > "$OUT/offline_log.txt" 2>&1
tail -12 "$OUT/offline_log.txt"
python3 - <<'PY' | tee -a "$SUMMARY"
import json
s = json.load(open("/tmp/kestrel/offline_stats.json"))
print("offline:", json.dumps(s))
PY
echo "== summary (calls 1-3)"
cat "$SUMMARY"
