#!/usr/bin/env bash
# Batch-64 decode at 4,096 context (the FP8 KV goal's shape; FP8 weights) on a kernel timeline,
# FP8 and bf16 KV: tools/kernel_trace (carry devbin/libkestrel_kernel_trace.so), the per-kernel
# table of the decode steps into $OUT/trace4096_{fp8,bf16}.txt. The bench runs twice (warm-up,
# timed), each 16 prefill passes and 48 decode steps: --skip 64 --decode-only keeps the timed run's
# decode steps (those after the first graph captures).
set -uo pipefail
source scripts/device/device_env.sh
C=scripts/device/configs
for kv in fp8 bf16; do
  mkdir -p /tmp/kestrel/t_$kv
  (cd /tmp/kestrel/t_$kv && CUDA_INJECTION64_PATH=$BIN/libkestrel_kernel_trace.so timeout 150 $K bench --device cuda \
    --load-format dummy -m "$OLDPWD/$C/llama-3.1-8b" --quantization fp8 -r 1 --parallel 64 -p 4096 -n 48 \
    --max-num-batched-tokens 16384 --kv-cache-dtype $kv) > "$OUT/trace4096_$kv.log" 2>&1
  echo "== $kv KV"; tail -3 "$OUT/trace4096_$kv.log"
  python3 scripts/device/kernel_trace.py /tmp/kestrel/t_$kv/kernel_trace.csv --skip 64 --decode-only 2>&1 | head -40 | tee "$OUT/trace4096_$kv.txt"
done
