#!/usr/bin/env bash
# The streaming GEMVs' L2 prefetch of the next projection's weights (--cuda-stream-prefetch-kb) in
# one device call: the GPU tests of the streamed paths and the PDL audit with the prefetch on (the
# default), the kernel rows with and without it (kestrel_cuda_bench fp8 / int4, 16 back-to-back
# calls, each prefetching the next call's weights), then batch-1 decode of the Llama-3.1-8B shape
# (random weights, --load-format dummy; bf16, FP8, INT4 GPTQ g128) at each KB of PF_KB, alternating
# in ROUNDS rounds, and the FP8 kernel timeline at the default when libkestrel_kernel_trace.so was
# carried. Carry: devbin (kestrel, kestrel_tests, kestrel_cuda_bench, the .so files, stories260K.gguf).
set -uo pipefail
source scripts/device/device_env.sh
begin_run
C=scripts/device/configs
if [ -n "${TESTS-CudaStream*:CudaFp8*:CudaInt4*:CudaModelRunner.*:CudaPdl*}" ]; then
  timeout 240 $BIN/kestrel_tests --gtest_filter="${TESTS-CudaStream*:CudaFp8*:CudaInt4*:CudaModelRunner.*:CudaPdl*}" \
    --gtest_brief=1 2>&1 | tail -6 | tee /tmp/kestrel/tests.txt
  note "tests: $(grep -E '^\[  (PASSED|FAILED) ' /tmp/kestrel/tests.txt | tr '\n' ' ')"
  note "$(python3 scripts/device/pdl_audit.py $K 2>&1 | tail -2 | tr '\n' ' ')"
fi
for b in ${KBENCH-fp8 int4}; do
  timeout 120 $BIN/kestrel_cuda_bench "$b" 2>&1 | grep -E "stream.*M=(1|2) " | tee "$OUT/kbench_$b.txt"
done
row() {  # LABEL ARGS...
  local label=$1
  shift
  local file="$OUT/$(echo "$label" | tr " @" "__").txt"
  timeout 200 "$K" bench --device cuda --load-format dummy -r 1 -p 128 -n 256 "$@" > "$file" 2>&1 || tail -3 "$file"
  note "$label: $(grep -E 'tg[0-9]' "$file" | tail -1)"
}
for round in $(seq 1 "${ROUNDS:-2}"); do
  for kb in ${PF_KB-0 64 128}; do
    for w in ${WEIGHTS-fp8 int4 bf16}; do
      case $w in
        fp8) row "fp8 pf$kb r$round" -m $C/llama-3.1-8b --quantization fp8 --cuda-stream-prefetch-kb $kb ;;
        int4) row "int4 pf$kb r$round" -m $C/llama-3.1-8b-gptq --cuda-stream-prefetch-kb $kb ;;
        bf16) row "bf16 pf$kb r$round" -m $C/llama-3.1-8b --cuda-stream-prefetch-kb $kb ;;
      esac
    done
  done
done
[ -n "${TRACE-1}" ] && trace_b1_fp8
echo "== summary"
cat "$SUMMARY"
