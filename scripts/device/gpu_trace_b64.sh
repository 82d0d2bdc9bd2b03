#!/usr/bin/env bash
# Batch-64 decode at 4,096 context (the FP8 KV goal's shape; FP8 weights) on a kernel timeline,
# FP8 and bf16 KV (kernel_trace_run of device_env.sh; carry devbin/libkestrel_kernel_trace.so): the
# per-kernel tables into $OUT/trace_b64_{fp8,bf16}.txt. The bench runs twice (warm-up, timed), each
# 16 prefill passes and 48 decode steps: --skip 64 --decode-only keeps the timed run's decode steps.
set -uo pipefail
source scripts/device/device_env.sh
for kv in fp8 bf16; do
  echo "== $kv KV"
  kernel_trace_run "b64_$kv" "--skip 64 --decode-only" -m "$PWD/scripts/device/configs/llama-3.1-8b" \
    --quantization fp8 -r 1 --parallel 64 -p 4096 -n 48 --max-num-batched-tokens 16384 --kv-cache-dtype $kv
done
