#!/usr/bin/env bash
# Where a speculative verify step's time goes on the Llama-3.1-8B shape (random bf16 weights,
# --load-format dummy): the op profile (--cuda-profile-ops: eager, CUDA events between ops, per-op
# totals at exit) of batch-1 greedy decode with speculation off, and with the 4-layer random draft
# (configs/llama-3.1-8b-draft-tiny) proposing 4 tokens, each step verifying 1 + 4 (random models
# almost never agree, so each step drafts, verifies and emits one token). Logs in $OUT/prof_*.txt.
# Carry: devbin (kestrel of a -DKESTREL_CUDA=ON build, plain or .xz, and its .so files).
set -uo pipefail
source scripts/device/device_env.sh
T=scripts/device/configs/llama-3.1-8b
DR=scripts/device/configs/llama-3.1-8b-draft-tiny
for run in off draft_k4; do
  extra=()
  [ $run = draft_k4 ] && extra=(--speculative-config "{\"method\": \"draft_model\", \"model\": \"$DR\", \"num_speculative_tokens\": 4}")
  echo "== 8B $run"
  timeout 200 "$K" bench -m $T --load-format dummy --device cuda --parallel 1 -p 128 -n 32 -r 1 --cuda-profile-ops \
    "${extra[@]}" > "$OUT/prof_$run.txt" 2>&1 || echo "FAILED rc=$?"
  tail -n 45 "$OUT/prof_$run.txt"
done
