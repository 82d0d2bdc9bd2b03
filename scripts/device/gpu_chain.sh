#!/usr/bin/env bash
# Chained streaming GEMVs (--cuda-stream-chain: O, gate|up, down and the next layer's QKV in one
# launch, grid barriers between them) in one device call: the GPU tests of the streamed paths and
# of the chains (CudaStreamGemvNarrow.*ChainIsItsLinksOneByOne on a real grid,
# CudaModelRunner.ChainedProjectionsGiveTheUnchainedOutputs) and the PDL audit, then decode of the
# Llama-3.1-8B shape (random weights, --load-format dummy; FP8 by --quantization fp8, INT4 GPTQ
# g128) at batch 1 (chain off and on alternating in ROUNDS rounds) and 2, and the FP8 kernel
# timeline with the chain when libkestrel_kernel_trace.so was carried. Carry: devbin (kestrel, kestrel_tests, the .so files,
# stories260K.gguf).
set -uo pipefail
source scripts/device/device_env.sh
begin_run
C=scripts/device/configs
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$SUMMARY"
if [ -n "${TESTS-CudaStream*:CudaFp8*:CudaModelRunner.*:CudaPdl*}" ]; then
  timeout 300 $BIN/kestrel_tests --gtest_filter="${TESTS-CudaStream*:CudaFp8*:CudaModelRunner.*:CudaPdl*}" \
    --gtest_brief=1 2>&1 | tail -12 | tee /tmp/kestrel/tests.txt
  note "tests: $(grep -E '^\[  (PASSED|FAILED) ' /tmp/kestrel/tests.txt | tr '\n' ' ')"
  note "$(python3 scripts/device/pdl_audit.py $K 2>&1 | tail -2 | tr '\n' ' ')"
fi
row() {  # LABEL ARGS...
  local label=$1
  shift
  local file="$OUT/$(echo "$label" | tr " @" "__").txt"
  timeout 200 "$K" bench --device cuda --load-format dummy -r 1 -p 128 -n 256 "$@" > "$file" 2>&1 || tail -3 "$file"
  note "$label: $(grep -E 'tg[0-9]' "$file" | tail -1)"
}
for round in $(seq 1 "${ROUNDS:-3}"); do
  for chain in off on; do
    row "fp8 b1 chain-$chain r$round" -m $C/llama-3.1-8b --quantization fp8 --cuda-stream-chain $chain
    row "int4 b1 chain-$chain r$round" -m $C/llama-3.1-8b-gptq --cuda-stream-chain $chain
  done
done
for chain in ${B2-off on}; do
  row "fp8 b2 chain-$chain" -m $C/llama-3.1-8b --quantization fp8 --parallel 2 --cuda-stream-chain $chain
  row "int4 b2 chain-$chain" -m $C/llama-3.1-8b-gptq --parallel 2 --cuda-stream-chain $chain
done
if [ -n "${TRACE-1}" ] && [ -f $BIN/libkestrel_kernel_trace.so ]; then
  mkdir -p /tmp/kestrel/trace_chain
  (cd /tmp/kestrel/trace_chain && CUDA_INJECTION64_PATH=$BIN/libkestrel_kernel_trace.so timeout 200 $K bench \
    --device cuda --load-format dummy -m "$OLDPWD/$C/llama-3.1-8b" --quantization fp8 --cuda-stream-chain on -r 1 \
    -p 128 -n 128) > "$OUT/trace_chain.log" 2>&1
  python3 scripts/device/kernel_trace.py /tmp/kestrel/trace_chain/kernel_trace.csv --skip 40 2>&1 | head -24 |
    tee "$OUT/trace_chain.txt"
fi
echo "== summary"
cat "$SUMMARY"
