#!/usr/bin/env bash
# Decode speed of devbin/kestrel against devbin/kestrel_before on the Llama-3.1-8B shape with random
# weights made in memory (--load-format dummy, configs/), alternating the two binaries in one call.
# STAGE=b1 (default): the GPU tests of TESTS (a gtest filter; none when empty) and the PDL audit,
# then batch-1 decode (-p 128 -n 256) with bf16, FP8 (--quantization fp8) and INT4 (GPTQ 4-bit
# group 128) weights, ROUNDS rounds (2), and the batch-1 FP8 kernel timeline of devbin/kestrel when
# libkestrel_kernel_trace.so was carried.
# STAGE=b64: batch-64 FP8 decode at 512 context for both binaries, then at 4,096 context with an FP8
# and a bf16 KV cache (the FP8 KV goal's ratio) for devbin/kestrel.
# STAGE=offline: gpu_offline_batch.sh with FP8 weights and KV (VOCAB_DIR must be set).
# Carry: devbin (kestrel, kestrel_before, kestrel_tests, the .so files, stories260K.gguf).
set -uo pipefail
source scripts/device/device_env.sh
begin_run
chmod +x $BIN/kestrel_before 2>/dev/null
C=scripts/device/configs
row() {  # LABEL BINARY ARGS...
  local label=$1 bin=$2
  shift 2
  local file="$OUT/$(echo "$label" | tr " @" "__").txt"
  timeout 200 "$BIN/$bin" bench --device cuda --load-format dummy -r 1 "$@" > "$file" 2>&1 || tail -3 "$file"
  note "$label: $(grep -E 'tg[0-9]' "$file" | tail -1)"
}
case "${STAGE:-b1}" in
  b1)
    if [ -n "${TESTS-Cuda*}" ]; then
      timeout 200 $BIN/kestrel_tests --gtest_filter="${TESTS-Cuda*}" --gtest_brief=1 2>&1 | tail -6 | tee /tmp/kestrel/tests.txt
      note "tests: $(grep -E '^\[  (PASSED|FAILED) ' /tmp/kestrel/tests.txt | tr '\n' ' ')"
    fi
    note "$(python3 scripts/device/pdl_audit.py $K 2>&1 | tail -2 | tr '\n' ' ')"
    for round in $(seq 1 "${ROUNDS:-2}"); do
      for bin in kestrel_before kestrel; do
        row "$bin bf16 b1 r$round" $bin -m $C/llama-3.1-8b -p 128 -n 256
        row "$bin fp8 b1 r$round" $bin -m $C/llama-3.1-8b --quantization fp8 -p 128 -n 256
        row "$bin int4 b1 r$round" $bin -m $C/llama-3.1-8b-gptq -p 128 -n 256
      done
    done
    trace_b1_fp8
    ;;
  b64)
    for bin in kestrel_before kestrel; do
      row "$bin fp8 b64@512" $bin -m $C/llama-3.1-8b --quantization fp8 --parallel 64 -p 512 -n 128 \
        --max-num-batched-tokens 8192
    done
    for kv in fp8 bf16; do
      row "kestrel fp8 b64@4096 $kv KV" kestrel -m $C/llama-3.1-8b --quantization fp8 --parallel 64 -p 4096 -n 32 \
        --max-num-batched-tokens 16384 --kv-cache-dtype $kv
    done
    ;;
  offline)
    KESTREL_FLAGS="--quantization fp8 --kv-cache-dtype fp8" bash scripts/device/gpu_offline_batch.sh
    ;;
esac
echo "== summary"
cat "$SUMMARY"
