#!/usr/bin/env bash
# INT4 W4A16 (GPTQ / AWQ 4-bit) on the GPU in one device call: the CUDA op tests (int4, the
# hf-tiny GPTQ / AWQ Llamas against transformers, and the projection and runner tests around
# them), the PDL audit of the kernels, the kernel benchmark (kestrel_cuda_bench int4), then the
# Llama-3.1-8B shape with random weights (--load-format dummy), bf16 (configs/llama-3.1-8b) against
# GPTQ 4-bit group 128 (configs/llama-3.1-8b-gptq): batch-1 decode, batch-64 decode, prefill.
# usage: gpu_int4.sh DIR [configs-dir]
#   DIR holds kestrel, kestrel_tests, kestrel_cuda_bench (plain or .xz), libpcre2-8.so.0,
#   libxxhash.so.0 and data/hf-tiny/{llama-awq-tiny,llama-gptq-tiny,llama-gptq-actorder-tiny};
#   configs-dir (default scripts/device/configs) the two config folders. Results in $OUT.
set -uo pipefail
D=$(realpath "$1")
C=$(realpath "${2:-scripts/device/configs}")
OUT="${OUT:-/tmp/kestrel_int4}"
mkdir -p "$OUT"
for f in kestrel kestrel_tests kestrel_cuda_bench; do
  [ -f "$D/$f.xz" ] && xz -dkf "$D/$f.xz"
  chmod +x "$D/$f"
done
cublas_dir=$(python3 -c 'import nvidia.cublas as m; print(list(m.__path__)[0] + "/lib")' 2>/dev/null || true)
export LD_LIBRARY_PATH="$D:/usr/local/cuda/lib64:${cublas_dir}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export KESTREL_DATA_DIR="$D/data"
S="$OUT/summary.txt"
: > "$S"
note() { echo "$*" | tee -a "$S"; }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader | tee -a "$S"

echo "== GPU tests"
timeout "${TEST_TIMEOUT:-150}" "$D/kestrel_tests" \
  --gtest_filter="${TEST_FILTER:-CudaInt4*:CudaHfTiny.Gptq*:CudaHfTiny.Fp8*:CudaFp8*:CudaSkinny*:CudaStreamGemv*:CudaModelRunner*}" 2>&1 |
  grep -E "^\[  (PASSED|FAILED|  OK|SKIPPED)|Failure|Expected|Which is|equal|worst|rror|t [0-9]+ n" | tee "$OUT/tests.txt" | tail -60
note "tests: $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/tests.txt" | tr '\n' ' ')"
[ -f scripts/device/pdl_audit.py ] && note "pdl audit: $(python3 scripts/device/pdl_audit.py "$D/kestrel" 2>&1 | tail -3 | tr '\n' ' ')"

echo "== kestrel_cuda_bench int4"
timeout "${KBENCH_TIMEOUT:-120}" "$D/kestrel_cuda_bench" int4 2>&1 | tee "$OUT/kbench.txt"

for cfg in llama-3.1-8b llama-3.1-8b-gptq; do
  M="$C/$cfg"
  echo "== $cfg: batch-1 decode -p 128 -n 256"
  timeout 150 "$D/kestrel" bench -m "$M" --load-format dummy --device cuda -p 128 -n 256 -r 2 2>&1 | tail -4 |
    tee "$OUT/${cfg}_b1.txt"
  note "$cfg batch-1: $(tail -1 "$OUT/${cfg}_b1.txt")"
  echo "== $cfg: --parallel 64 -p 128 -n 128"
  timeout 150 "$D/kestrel" bench -m "$M" --load-format dummy --device cuda --parallel 64 -p 128 -n 128 -r 2 2>&1 |
    tail -3 | tee "$OUT/${cfg}_b64.txt"
  note "$cfg batch-64: $(tail -1 "$OUT/${cfg}_b64.txt")"
  echo "== $cfg: prefill 8 x 2048"
  timeout 150 "$D/kestrel" bench -m "$M" --load-format dummy --device cuda --parallel 8 -p 2048 -n 2 -r 2 \
    --max-num-batched-tokens 16384 2>&1 | tail -3 | tee "$OUT/${cfg}_pp.txt"
  note "$cfg prefill 8x2048: $(tail -1 "$OUT/${cfg}_pp.txt")"
done
echo "== summary"
cat "$S"
