#!/usr/bin/env bash
# Device call 1 of 3 (then gpu_compare_hf.sh, gpu_offline_batch.sh on the same warm machine):
# GPU op tests, CPU-vs-GPU greedy on stories260K, the Llama-3.1-8B-shaped random model, and kestrel's benchmarks on it.
# Carry: devbin (kestrel, kestrel_tests, libpcre2-8.so.0, libxxhash.so.0, tokenizer.model,
# stories260K.gguf) and devdata/a (first part of the SmolLM2 GGUF, kept in /tmp for call 2).
set -uo pipefail
source scripts/device/device_env.sh
: > "$SUMMARY"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
[ -f devdata/a/smol.part ] && cp devdata/a/smol.part /tmp/kestrel/smol.part1

echo "== GPU op tests (kestrel_tests, Cuda*)"
timeout 300 $BIN/kestrel_tests --gtest_filter='Cuda*' --gtest_brief=1 2>&1 | tail -15
note "op tests: $($BIN/kestrel_tests --gtest_filter='Cuda*' --gtest_brief=1 2>&1 | grep -E '^\[  (PASSED|FAILED) ' | tr '\n' ' ')"

stories_check

echo "== Llama-3.1-8B-shaped random model"
[ -f "$M8/config.json" ] || python3 scripts/device/make_llama8b.py "$M8"
du -sh "$M8"
echo "== load (weights upload), page cache warm"
timeout 120 "$K" generate -m "$M8" --device cuda -p "Hello" -n 1 2>&1 >/dev/null | grep -E "ready in" | tee /tmp/kestrel/load.txt
note "load 8B (warm page cache): $(grep -oE 'ready in [0-9.]+ s' /tmp/kestrel/load.txt)"
echo "== batch-1 decode: -p 128 -n 256"
timeout 200 "$K" bench -m "$M8" --device cuda -p 128 -n 256 -r 3 2>&1 | tail -4 | tee /tmp/kestrel/b1.txt
note "batch-1: $(tail -1 /tmp/kestrel/b1.txt)"
echo "== batch-64 decode at 512-token contexts; prefill 8 x 2048"
timeout 200 "$K" bench -m "$M8" --device cuda --parallel 64 -p 512 -n 128 -r 2 --max-num-batched-tokens 8192 2>&1 \
  | tail -3 | tee /tmp/kestrel/b64.txt
note "batch-64 @512: $(tail -1 /tmp/kestrel/b64.txt)"
timeout 200 "$K" bench -m "$M8" --device cuda --parallel 8 -p 2048 -n 2 -r 3 --max-num-batched-tokens 16384 2>&1 \
  | tail -3 | tee /tmp/kestrel/pp.txt
note "prefill 8x2048: $(tail -1 /tmp/kestrel/pp.txt)"
echo "== summary (call 1)"
cat "$SUMMARY"
