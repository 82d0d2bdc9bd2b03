#!/usr/bin/env bash
# The narrow-weight streaming GEMV (FP8 and INT4 at one and two tokens) on the GPU in one device
# call: its op tests and the tests of the paths around it, the kernel benchmarks (kestrel_cuda_bench
# fp8 and int4: the streaming GEMVs beside the skinny kernels and bf16 of the same shapes), then
# batch-1 decode of the Llama-3.1-8B shape with random weights (--load-format dummy): bf16 and
# --quantization fp8 (configs/llama-3.1-8b), GPTQ 4-bit group 128 (configs/llama-3.1-8b-gptq) on its
# default streaming GEMV and on stream_gemv_narrow (--cuda-stream-gemv-stages 4), and FP8 and GPTQ
# again with --cuda-stream-gemv off (their skinny kernels; SKIP_SKINNY=1 leaves those out).
# usage: gpu_stream.sh DIR [configs-dir]
#   DIR holds kestrel, kestrel_tests, kestrel_cuda_bench (plain or .xz), libpcre2-8.so.0,
#   libxxhash.so.0 and optionally data/hf-tiny/...; configs-dir (default scripts/device/configs)
#   the config folders. Results in $OUT.
set -uo pipefail
D=$(realpath "$1")
C=$(realpath "${2:-scripts/device/configs}")
OUT="${OUT:-/tmp/kestrel_stream}"
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

if [ "${SKIP_TESTS:-0}" != 1 ]; then
  echo "== GPU tests"
  timeout "${TEST_TIMEOUT:-120}" "$D/kestrel_tests" \
    --gtest_filter="${TEST_FILTER:-CudaStreamGemv*:CudaInt4*:CudaFp8*:CudaHfTiny.Gptq*:CudaHfTiny.Fp8*:CudaSkinny*}" 2>&1 |
    grep -E "^\[  (PASSED|FAILED|  OK|SKIPPED)|Failure|Expected|Which is|equal|against|rror" | tee "$OUT/tests.txt" | tail -40
  note "tests: $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/tests.txt" | tr '\n' ' ')"
fi

for b in ${KBENCH:-fp8 int4}; do
  echo "== kestrel_cuda_bench $b"
  timeout "${KBENCH_TIMEOUT:-90}" "$D/kestrel_cuda_bench" "$b" 2>&1 | grep -E "M=(1|2) " | tee "$OUT/kbench_$b.txt"
done

run() {  # name, config, extra flags...
  local name=$1 cfg=$2
  shift 2
  echo "== $name: batch-1 decode -p 128 -n 256 -r 2 $*"
  timeout 150 "$D/kestrel" bench -m "$C/$cfg" --load-format dummy --device cuda -p 128 -n 256 -r 2 "$@" 2>&1 |
    tail -4 | tee "$OUT/${name}_b1.txt"
  note "$name batch-1: $(tail -1 "$OUT/${name}_b1.txt")"
}
run bf16 llama-3.1-8b
run fp8 llama-3.1-8b --quantization fp8
run gptq llama-3.1-8b-gptq
# INT4 on the other streaming GEMV (stream_gemv_narrow.cuh: 4 stages of 32 KB).
run gptq_narrow llama-3.1-8b-gptq --cuda-stream-gemv-stages 4
if [ "${SKIP_SKINNY:-0}" != 1 ]; then
  # The same without any streaming GEMV: FP8 and INT4 on their skinny kernels, as before.
  run fp8_skinny llama-3.1-8b --quantization fp8 --cuda-stream-gemv off
  run gptq_skinny llama-3.1-8b-gptq --cuda-stream-gemv off
fi
[ -n "${EXTRA:-}" ] && eval "$EXTRA"
echo "== summary"
cat "$S"
[ -f "$OUT/tests.txt" ] && grep -v "  OK \]" "$OUT/tests.txt" | tail -30
