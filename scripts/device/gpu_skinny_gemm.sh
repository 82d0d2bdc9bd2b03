#!/usr/bin/env bash
# the skinny decode GEMM (src/backend/cuda/skinny_gemm.cuh), in one call on a fresh
# machine: the GPU op tests, the projection microbenchmark (cuBLASLt against the skinny kernel's
# variants at 1..64 tokens), then batch-1 and batch-64 decode of the 8B-shaped model with the
# skinny GEMM and PDL off and on ("-" is the defaults). Set STAGES to skip parts (default "tests
# micro e2e").
# Carry: devbin (kestrel, kestrel_tests, kestrel_cuda_bench, the .so files kestrel needs,
# stories260K.gguf, tokenizer.model).
set -uo pipefail
source scripts/device/device_env.sh
STAGES="${STAGES:-tests micro e2e profile}"
begin_run
[[ $STAGES == *tests* ]] && op_tests
if [[ $STAGES == *micro* ]]; then
  echo "== projections at few tokens: cuBLASLt vs skinny_gemm"
  timeout 300 $BIN/kestrel_cuda_bench skinny 2>&1 | tee "$OUT/skinny.txt"
fi
if [[ $STAGES == *e2e* ]]; then
  [ -f "$M8/config.json" ] || python3 scripts/device/make_llama8b.py "$M8"
  # Each configuration is a comma-separated list of kestrel flags (defaults: none).
  for cfg in ${B1_CONFIGS:---cuda-skinny-max-tokens=0,--cuda-pdl=off,--cuda-gemm-tune=off defaults}; do
    echo "== batch-1 decode: $cfg"
    timeout 200 "$K" bench -m "$M8" --device cuda -p 128 -n 256 -r 3 $(cfg_flags "$cfg") 2>&1 | tail -1 \
      | tee /tmp/kestrel/b1.txt
    note "batch-1 [$cfg]: $(tail -1 /tmp/kestrel/b1.txt)"
  done
  for cfg in ${B64_CONFIGS:---cuda-gemm-tune=off defaults}; do
    echo "== batch-64 decode at 512: $cfg"
    timeout 200 "$K" bench -m "$M8" --device cuda --parallel 64 -p 512 -n 128 -r 2 \
      --max-num-batched-tokens 8192 $(cfg_flags "$cfg") 2>&1 | tail -1 | tee /tmp/kestrel/b64.txt
    note "batch-64 [$cfg]: $(tail -1 /tmp/kestrel/b64.txt)"
  done
  echo "== prefill 8 x 2048"
  timeout 200 "$K" bench -m "$M8" --device cuda --parallel 8 -p 2048 -n 2 -r 3 --max-num-batched-tokens 16384 2>&1 \
    | tail -1 | tee /tmp/kestrel/pp.txt
  note "prefill 8x2048: $(tail -1 /tmp/kestrel/pp.txt)"
  echo "== load (weights upload), page cache warm"
  timeout 120 "$K" generate -m "$M8" --device cuda -p "Hello" -n 1 2>&1 >/dev/null | grep -E "ready in" | tee /tmp/kestrel/load.txt
  note "load 8B (warm page cache): $(grep -oE 'ready in [0-9.]+ s' /tmp/kestrel/load.txt)"
  [[ $STAGES == *profile* ]] || { echo "== summary"; cat "$SUMMARY"; exit 0; }
  echo "== op profile (eager, CUDA events): batch-1 and batch-64 decode, skinny at the default"
  timeout 200 "$K" bench -m "$M8" --device cuda -p 128 -n 64 -r 1 --cuda-profile-ops 2>&1 | grep -A24 "op profile"
  timeout 200 "$K" bench -m "$M8" --device cuda --parallel 64 -p 512 -n 64 -r 1 \
    --max-num-batched-tokens 8192 --cuda-profile-ops 2>&1 | grep -A24 "op profile"
fi
echo "== summary"
cat "$SUMMARY"
