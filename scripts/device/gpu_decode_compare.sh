#!/usr/bin/env bash
# Decode speed of devbin/kestrel against devbin/kestrel_before on the Llama-3.1-8B shape with random
# weights made in memory (--load-format dummy, configs/), alternating the two binaries in one call.
# STAGE=b1 (default): the GPU tests of TESTS (a gtest filter; none when empty) and the PDL audit,
# then batch-1 decode (-p 128 -n 256) with bf16, FP8 (--quantization fp8) and INT4 (GPTQ 4-bit
# group 128) weights, ROUNDS rounds (2), and the batch-1 FP8 kernel timeline of devbin/kestrel when
# libkestrel_kernel_trace.so was carried.
# STAGE=b64: batch-64 FP8 decode at 512 context for both binaries, then at 4,096 context with an FP8
# and a bf16 KV cache (the FP8 KV goal's ratio) for devbin/kestrel.
# STAGE=sweep4096: batch-64 FP8-weight decode at 4,096 context of devbin/kestrel, bf16 and FP8 KV,
# under the split-KV plan's overrides and a larger KV block (SWEEP: "name|flags;..." to replace the
# list).
# STAGE=offline: gpu_offline_batch.sh with FP8 weights and KV (VOCAB_DIR must be set); PROFILE=1
# adds --cuda-profile-ops (eager, per-op totals at exit into $OUT/offline_ops.txt).
# STAGE=fp8gemm: kestrel_cuda_bench fp8scalar (the W8A8 GEMM at 16-2048 tokens, scaled and not).
# Carry: devbin (kestrel, kestrel_before, kestrel_tests, the .so files, stories260K.gguf).
set -uo pipefail
source scripts/device/device_env.sh
begin_run
chmod +x $BIN/kestrel_before 2>/dev/null
C=scripts/device/configs
row() {  # LABEL BINARY ARGS...
  local label=$1 bin=$2
  shift 2
  local file="$OUT/$(echo "$label" | tr -c 'A-Za-z0-9_.\n-' '_').txt"
  timeout 200 "$BIN/$bin" bench --device cuda --load-format dummy -r 1 "$@" > "$file" 2>&1 || tail -3 "$file"
  # batch 1: the tg row; --parallel: the table's last row (pp, aggregate tg, TTFT, TPOT)
  note "$label: $(grep -E 'tg[0-9]|^\| [0-9]+ \| [0-9]+ \|' "$file" | tail -1)"
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
  sweep4096)
    IFS=';' read -ra cfgs <<< "${SWEEP:-bf16 KV|--kv-cache-dtype bf16;fp8 KV|--kv-cache-dtype fp8;fp8 KV, 1 item a block|--kv-cache-dtype fp8 --cuda-attn-items-per-block 1;fp8 KV, 4 items a block|--kv-cache-dtype fp8 --cuda-attn-items-per-block 4;fp8 KV, block 32|--kv-cache-dtype fp8 --block-size 32;bf16 KV, block 32|--kv-cache-dtype bf16 --block-size 32}"
    for c in "${cfgs[@]}"; do
      # shellcheck disable=SC2086
      row "b64@4096 ${c%%|*}" kestrel -m $C/llama-3.1-8b --quantization fp8 --parallel 64 -p 4096 -n 32 \
        --max-num-batched-tokens 16384 ${c#*|}
    done
    ;;
  offline)
    KESTREL_FLAGS="--quantization fp8 --kv-cache-dtype fp8${PROFILE:+ --cuda-profile-ops}" \
      bash scripts/device/gpu_offline_batch.sh > "$OUT/offline.txt" 2>&1
    tail -20 "$OUT/offline.txt"
    ;;
  fp8gemm)
    timeout 300 $BIN/kestrel_cuda_bench fp8scalar > "$OUT/fp8scalar.txt" 2>&1
    grep -E "run_fp8|scalarbest bf16" "$OUT/fp8scalar.txt"
    ;;
esac
echo "== summary"
cat "$SUMMARY"
