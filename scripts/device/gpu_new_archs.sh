#!/usr/bin/env bash
# Device calls for the architectures beyond Llama (mixture of experts, multi-head latent
# attention, sliding windows, Gemma 3), on one warm machine (/tmp survives between its calls):
#   scripts/device/gpu_new_archs.sh tests      carry devbin (kestrel, kestrel_tests built with
#                                              -DKESTREL_CUDA=ON, their .so files, data/hf-tiny;
#                                              copied to /tmp for the later calls): the GPU tests
#                                              (kernels; the hf-tiny folders against transformers)
#   scripts/device/gpu_new_archs.sh stage N    carry devgN: part N of Gemma 3 270M's GGUF (split
#                                              here with `split -b 52M -d -a 1`, five parts, since a
#                                              call carries 64 MiB at most) into /tmp/kestrel/gemma
#   scripts/device/gpu_new_archs.sh gemma      after the five parts: the GGUF reassembled and
#                                              checked, its transcripts against transformers' on
#                                              the GPU, its speed
#   scripts/device/gpu_new_archs.sh bench NAME [kestrel|hf]
#                                              NAME = deepseek-v2-lite | mixtral-8x7b: kestrel
#                                              with --load-format dummy (random weights from
#                                              scripts/device/configs/NAME/config.json alone), or
#                                              HF transformers on random weights of the same
#                                              config: batch-1 decode and batch 64 at 512 tokens
#   scripts/device/gpu_new_archs.sh profile NAME  kestrel's per-op GPU times (--cuda-profile-ops,
#                                              eager) for NAME at batch 1 and batch 64 at 512
#   scripts/device/gpu_new_archs.sh trace NAME [ARGS]  Nsight Compute's duration of every kernel of
#                                              a short batch-1 run (default -p 128 -n 8; graphs
#                                              profiled node by node, caches and clocks left
#                                              alone): $OUT/NAME_trace.csv for ncu_steps.py
#   scripts/device/gpu_new_archs.sh kernels    kestrel_cuda_bench (in devbin, built with
#                                              -DKESTREL_BENCH=ON): the grouped expert GEMMs, MLA
#                                              decode per split count, the MoE routing kernels
# A stage and a bench share one call: `... stage 1 && ... bench deepseek-v2-lite`.
set -uo pipefail
source scripts/device/device_env.sh
G=/tmp/kestrel/gemma
mkdir -p "$G"
case "${1:-}" in
  stage)
    cp devg"$2"/part* "$G"/ && ls -la "$G" ;;
  tests)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    export KESTREL_DATA_DIR=$BIN/data
    echo "== GPU tests"
    timeout 500 $BIN/kestrel_tests --gtest_filter="${TEST_FILTER:-Cuda*}" 2>&1 |
      grep -E "^\[  (PASSED|FAILED|  OK|SKIPPED)|Failure|equal|worst|first difference|rror" | tee "$OUT/tests.txt" | tail -70
    note "tests: $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/tests.txt" | tr '\n' ' ')" ;;
  gemma)
    cat "$G"/part0 "$G"/part1 "$G"/part2 "$G"/part3 "$G"/part4 > "$G/gemma-3-270m-q4_k_m.gguf" &&
      rm -f "$G"/part*
    echo "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818  $G/gemma-3-270m-q4_k_m.gguf" |
      sha256sum -c - | tee -a "$SUMMARY"
    export KESTREL_DATA_DIR=$BIN/data KESTREL_MODEL_DIR=$G
    timeout 300 $BIN/kestrel_tests --gtest_filter='Gemma3_270m.*' 2>&1 |
      grep -E "^\[  (PASSED|FAILED|  OK|SKIPPED)|Failure|equal|first difference|rror" | tee "$OUT/gemma_tests.txt"
    note "gemma3-270m tests: $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/gemma_tests.txt" | tr '\n' ' ')"
    echo "== Gemma 3 270M, CUDA: batch-1 decode (-p 128 -n 256) and batch 64 at 512"
    timeout 120 "$K" bench -m "$G/gemma-3-270m-q4_k_m.gguf" --device cuda -p 128 -n 256 -r 3 2>&1 | tail -3 |
      tee "$OUT/gemma_b1.txt"
    note "gemma3-270m batch-1: $(tail -1 "$OUT/gemma_b1.txt")"
    timeout 120 "$K" bench -m "$G/gemma-3-270m-q4_k_m.gguf" --device cuda --parallel 64 -p 512 -n 128 -r 2 \
      --max-num-batched-tokens 8192 2>&1 | tail -3 | tee "$OUT/gemma_b64.txt"
    note "gemma3-270m batch-64 @512: $(tail -1 "$OUT/gemma_b64.txt")"
    cat "$SUMMARY" ;;
  bench)
    M=scripts/device/configs/$2
    if [ "${3:-kestrel}" = kestrel ]; then
      echo "== kestrel $2 (dummy weights): batch-1 decode -p 128 -n 256"
      timeout 240 "$K" bench -m "$M" --load-format dummy --device cuda -p 128 -n 256 -r 3 2>&1 | tail -4 |
        tee "$OUT/$2_b1.txt"
      note "$2 kestrel batch-1: $(tail -1 "$OUT/$2_b1.txt")"
      echo "== kestrel $2: batch 64 at 512-token contexts"
      timeout 240 "$K" bench -m "$M" --load-format dummy --device cuda --parallel 64 -p 512 -n 128 -r 2 \
        --max-num-batched-tokens 8192 2>&1 | tail -3 | tee "$OUT/$2_b64.txt"
      note "$2 kestrel batch-64 @512: $(tail -1 "$OUT/$2_b64.txt")"
    else
      echo "== HF transformers $2 (random weights)"
      timeout 540 python3 scripts/device/hf_bench.py -m "$M" --random --skip prefill --batch1-cache dynamic 2>&1 |
        grep -E "^HF|Error|error" | tee "$OUT/$2_hf.txt"
      while read -r l; do note "$2 $l"; done < "$OUT/$2_hf.txt"
    fi
    cat "$SUMMARY" ;;
  profile)
    M=scripts/device/configs/$2
    echo "== kestrel $2 per-op profile: batch-1 decode -p 128 -n 64"
    timeout 200 "$K" bench -m "$M" --load-format dummy --device cuda -p 128 -n 64 -r 1 --cuda-profile-ops 2>&1 |
      tail -45 | tee "$OUT/$2_prof_b1.txt"
    echo "== kestrel $2 per-op profile: batch 64 at 512"
    timeout 200 "$K" bench -m "$M" --load-format dummy --device cuda --parallel 64 -p 512 -n 32 -r 1 \
      --max-num-batched-tokens 8192 --cuda-profile-ops 2>&1 | tail -60 | tee "$OUT/$2_prof_b64.txt" ;;
  trace)
    M=scripts/device/configs/$2
    shift 2
    timeout 500 ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv \
      "$K" bench -m "$M" --load-format dummy --device cuda -r 1 ${@:--p 128 -n 8} > "$OUT/trace.csv" 2>"$OUT/trace.err"
    echo "rc $?; $(grep -c gpu__time_duration "$OUT/trace.csv") kernels"; tail -3 "$OUT/trace.err"
    python3 scripts/device/ncu_steps.py "$OUT/trace.csv" | tail -50 ;;
  kernels)
    chmod +x $BIN/kestrel_cuda_bench
    for f in moe mla; do timeout 200 $BIN/kestrel_cuda_bench "$f" 2>&1 | tee "$OUT/kernels_$f.txt"; done ;;
  *)
    echo "usage: $0 tests | stage N | gemma | bench NAME [kestrel|hf] | profile NAME | trace NAME [ARGS] | kernels" >&2
    exit 2 ;;
esac
