#!/usr/bin/env bash
# Changes to the FP8 (W8A8) and INT4 (W4A16) streaming GEMVs against the binary before them, in one
# call: the GPU tests of the streamed paths, the PDL audit, the per-block timeline of each carried
# diagnostic bench (`kestrel_cuda_bench_trace*`, -DKESTREL_STREAM_TRACE=ON builds:
# `kestrel_cuda_bench streamtrace`), the kernel rows of each carried `kestrel_cuda_bench*`
# (KBENCH, default int4), then batch-1 and batch-2 decode of the Llama-3.1-8B shape with random
# weights (--load-format dummy) for each binary of BINS, alternating, ROUNDS rounds.
# FORMATS: fp8 (configs/llama-3.1-8b --quantization fp8), int4 (configs/llama-3.1-8b-gptq, GPTQ
# 4-bit group 128) and/or bf16 (configs/llama-3.1-8b); BATCHES: 1 and/or 2 (--parallel).
# Carry: devbin (the binaries plain or .xz, kestrel_tests, the .so files; data/hf-tiny/<llama-gptq-tiny,
# llama-gptq-actorder-tiny, llama-awq-tiny> for the GPTQ / AWQ tests, data/stories260K).
# BINS entries: a binary, or binary@flag@value... for extra kestrel flags (e.g.
# kestrel@--cuda-stream-prefetch-kb@0).
# usage: BINS="kestrel_before kestrel" FORMATS="fp8 int4" scripts/device/gpu_compare_streamed.sh
set -uo pipefail
source scripts/device/device_env.sh
begin_run
[ -d $BIN/data ] && export KESTREL_DATA_DIR=$BIN/data
BINS="${BINS:-kestrel_before kestrel}"
chmod +x $BIN/kestrel* 2>/dev/null
TEST_FILTER="${TEST_FILTER:-CudaInt4*:CudaStreamGemv*:CudaFp8*:CudaHfTiny.Gptq*:CudaModelRunner*}"
echo "== GPU tests ($TEST_FILTER)"
timeout 240 $BIN/kestrel_tests --gtest_filter="$TEST_FILTER" --gtest_brief=1 2>&1 | tail -20 | tee /tmp/kestrel/tests.txt
note "op tests: $(grep -E '^\[  (PASSED|FAILED) ' /tmp/kestrel/tests.txt | tr '\n' ' ')"
note "$(python3 scripts/device/pdl_audit.py $BIN/kestrel 2>&1 | tail -2 | tr '\n' ' ')"
for b in $BIN/kestrel_cuda_bench_trace*; do
  [[ -x "$b" && $b != *.xz ]] || continue
  echo "== $(basename $b) streamtrace"
  timeout 120 "$b" streamtrace 2>&1 | tee "$OUT/streamtrace_$(basename $b).txt"
done
for b in $BIN/kestrel_cuda_bench $BIN/kestrel_cuda_bench_before; do
  [ -x "$b" ] || continue
  echo "== $(basename $b) ${KBENCH:-int4}"
  timeout 120 "$b" "${KBENCH:-int4}" 2>&1 | tee "$OUT/kbench_$(basename $b).txt" | grep -iE "stream" | head -20
done
for round in $(seq 1 "${ROUNDS:-2}"); do
  for fmt in ${FORMATS:-int4}; do
    case $fmt in
      fp8) model=(-m scripts/device/configs/llama-3.1-8b --quantization fp8) ;;
      int4) model=(-m scripts/device/configs/llama-3.1-8b-gptq) ;;
      bf16) model=(-m scripts/device/configs/llama-3.1-8b) ;;
    esac
    for cfg in $BINS; do
      bin=${cfg%%@*}
      flags=""
      [[ $cfg == *@* ]] && flags=$(echo "${cfg#*@}" | tr '@' ' ')
      for batch in ${BATCHES:-1 2}; do
        # shellcheck disable=SC2086
        timeout 150 $BIN/$bin bench "${model[@]}" --load-format dummy --device cuda --parallel $batch -p 128 -n 256 \
          -r 1 $flags 2>&1 | tail -1 > /tmp/kestrel/b.txt
        note "$fmt batch-$batch $cfg (round $round): $(cat /tmp/kestrel/b.txt)"
      done
    done
  done
done
echo "== summary"
cat "$SUMMARY"
cp "$SUMMARY" "$OUT/summary.txt"
