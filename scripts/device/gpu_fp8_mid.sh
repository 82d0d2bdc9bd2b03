#!/usr/bin/env bash
# FP8 weights at 16-128 tokens a GEMM (Gemm::run_fp8: cuBLASLt's unscaled FP8 product, then
# scale_fp8_product), in one call: the FP8 GPU tests and the PDL audit, then the 8B shape with
# random FP8 weights (--load-format dummy, configs/llama-3.1-8b) at batch 64, devbin/kestrel_before
# against devbin/kestrel (512 context), and the batch-64 decode at 4,096 context with an FP8 and a
# bf16 KV cache (the FP8 KV goal's ratio), kernel timelines of batch-1 and of that FP8 KV row when
# devbin holds libkestrel_kernel_trace.so (and libcupti.so.13), then kestrel_cuda_bench fp8scalar when it was carried.
# Carry: devbin (kestrel, kestrel_before, kestrel_tests, kestrel_cuda_bench optional, the .so files,
# stories260K.gguf). About 6 minutes on an H100.
set -uo pipefail
source scripts/device/device_env.sh
begin_run
chmod +x $BIN/kestrel_before 2>/dev/null
timeout 150 $BIN/kestrel_tests --gtest_filter="${TESTS:-CudaFp8*:CudaModelRunner.Fp8*:CudaHfTiny.Fp8*}" --gtest_brief=1 2>&1 |
  tail -4 | tee /tmp/kestrel/tests.txt
note "fp8 tests: $(grep -E '^\[  (PASSED|FAILED) ' /tmp/kestrel/tests.txt | tr '\n' ' ')"
note "$(python3 scripts/device/pdl_audit.py $K 2>&1 | tail -2 | tr '\n' ' ')"
C=scripts/device/configs/llama-3.1-8b
row() {  # LABEL BINARY ARGS...
  local label=$1 bin=$2
  shift 2
  timeout 200 "$bin" bench --device cuda --load-format dummy -m $C --quantization fp8 -r 1 "$@" > "$OUT/$label.txt" 2>&1 ||
    echo "FAILED $label"
  note "$label: $(grep -E '^\| [0-9]' "$OUT/$label.txt" | tail -1)"
}
# BINS: the binaries of devbin to compare (default: kestrel_before and kestrel); B4096: those that
# also run the 4,096-context rows (default: kestrel), with FP8 and bf16 KV each.
for bin in ${BINS:-kestrel_before kestrel}; do
  chmod +x "$BIN/$bin" 2>/dev/null
  [ -x "$BIN/$bin" ] && row "$bin b64@512" "$BIN/$bin" --parallel 64 -p 512 -n 128 --max-num-batched-tokens 8192
done
for bin in ${B4096:-kestrel}; do
  for kv in fp8 bf16; do
    row "$bin b64@4096 $kv KV" "$BIN/$bin" --parallel 64 -p 4096 -n 32 --max-num-batched-tokens 16384 --kv-cache-dtype $kv
  done
done
if [ -f $BIN/libkestrel_kernel_trace.so ]; then
  # Kernel timelines (tools/kernel_trace, CUPTI; graphs traced per node): batch-1 FP8 decode, and
  # the batch-64 decode at 4,096 context with FP8 KV; per kernel the time a decode step.
  trace() {  # LABEL SKIP ARGS...
    local label=$1 skip=$2
    shift 2
    mkdir -p /tmp/kestrel/trace_$label
    (cd /tmp/kestrel/trace_$label && CUDA_INJECTION64_PATH=$BIN/libkestrel_kernel_trace.so \
      timeout 200 $K bench --device cuda --load-format dummy -m "$OLDPWD/$C" --quantization fp8 -r 1 "$@") > "$OUT/trace_$label.log" 2>&1
    echo "== kernel trace: $label"
    python3 scripts/device/kernel_trace.py /tmp/kestrel/trace_$label/kernel_trace.csv --skip "$skip" 2>&1 | head -40 |
      tee "$OUT/trace_$label.txt"
    gzip -c /tmp/kestrel/trace_$label/kernel_trace.csv > "$OUT/trace_$label.csv.gz"
  }
  # TRACES: which of the two (default both).
  [[ ${TRACES:-b1 b64} == *b1* ]] && trace b1 40 -p 128 -n 128
  [[ ${TRACES:-b1 b64} == *b64* ]] &&
    trace b64_4096 24 --parallel 64 -p 4096 -n 48 --max-num-batched-tokens 16384 --kv-cache-dtype fp8
fi
[ -z "${SKIP_BENCH:-}" ] && [ -x $BIN/kestrel_cuda_bench ] && timeout 150 $BIN/kestrel_cuda_bench fp8scalar 2>&1 | grep -v "heuristic status"
echo "== summary"
cat "$SUMMARY"
