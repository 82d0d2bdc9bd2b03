#!/usr/bin/env bash
# On one fresh machine after a fix: call 1 (tests, stories260K, the 8B model, benchmarks),
# the 8B logits check against transformers, and the offline run of call 3. Carry: devbin.
set -uo pipefail
bash scripts/device/gpu_bench_8b.sh
source scripts/device/device_env.sh
if command -v nsys >/dev/null; then
  echo "== nsys: batch-64 decode kernels"
  timeout 120 nsys profile -o /tmp/kestrel/b64 --force-overwrite true "$K" bench -m "$M8" --device cuda --parallel 64 -p 512 \
    -n 64 -r 1 --max-num-batched-tokens 8192 >/dev/null 2>&1
  nsys stats -q --report cuda_gpu_kern_sum --format csv /tmp/kestrel/b64.nsys-rep 2>/dev/null | head -16 | cut -c1-200
fi
echo "== 8B-shaped random model vs transformers"
timeout 300 python3 scripts/device/logits_check.py --kestrel "$K" -m "$M8" --name llama8b 2>&1 | tail -6 \
  | tee /tmp/kestrel/l8.log
note "$(grep -E 'argmax agreement|vs transformers f32|top-2|RESULT' /tmp/kestrel/l8.log | tr '\n' ' ')"
bash scripts/device/gpu_offline_batch.sh
