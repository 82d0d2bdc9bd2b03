#!/usr/bin/env bash
# decode attention (src/backend/cuda/paged_attention_decode.cuh) and the
# GEMMs, in one call on a fresh machine: the GPU op tests and stories260K CPU vs GPU; decode
# attention in the op benchmark under split-plan overrides (ATTN_CONFIGS), and a reference build
# (devbin/*_itemwise, when carried) for comparison; batch-1 and batch-64 decode of the 8B-shaped
# model (B1_CONFIGS, B64_CONFIGS: environment settings per run, "itemwise" meaning the reference
# build), prefill and an op profile. STAGES picks parts (default "tests attn e2e profile").
# Carry: devbin (kestrel, kestrel_tests, kestrel_cuda_bench, the .so files kestrel needs,
# stories260K.gguf, tokenizer.model).
set -uo pipefail
source scripts/device/device_env.sh
STAGES="${STAGES:-tests attn e2e profile}"
begin_run
[[ $STAGES == *tests* ]] && op_tests
if [[ $STAGES == *attn* ]]; then
  if [ -x $BIN/kestrel_cuda_bench_itemwise ] || chmod +x $BIN/kestrel_cuda_bench_itemwise 2>/dev/null; then
    # A reference build for the same-run comparison (commit 4aacb88, whose
    # KESTREL_ATTN_PERSISTENT=0 gives one block per item).
    echo "== decode attention: reference build (KESTREL_ATTN_PERSISTENT=0, 2 items per block)"
    KESTREL_ATTN_PERSISTENT=0 KESTREL_ATTN_ITEMS_PER_BLOCK=2 timeout 120 $BIN/kestrel_cuda_bench_itemwise \
      "attention decode" 2>&1 | grep "^attention" | grep -v SIMT
  fi
  for cfg in ${ATTN_CONFIGS:-defaults --attn-items-per-block=1 --attn-items-per-block=2}; do
    echo "== decode attention: $cfg"
    timeout 120 $BIN/kestrel_cuda_bench $(cfg_flags "$cfg") "attention decode" 2>&1 | grep "^attention" | grep -v SIMT \
      | tee -a "$OUT/attn_$cfg.txt"
  done
fi
if [[ $STAGES == *e2e* ]]; then
  [ -f "$M8/config.json" ] || python3 scripts/device/make_llama8b.py "$M8"
  for cfg in ${B1_CONFIGS:-itemwise defaults}; do
    echo "== batch-1 decode: $cfg"
    kb="$K"; envs=""; flags=$(cfg_flags "$cfg")
    # The reference build read its switches from the environment.
    [ "$cfg" = itemwise ] && { kb="$K"_itemwise; chmod +x "$kb"; flags=""; envs="KESTREL_ATTN_PERSISTENT=0 KESTREL_ATTN_ITEMS_PER_BLOCK=2"; }
    env $envs timeout 200 "$kb" bench -m "$M8" --device cuda -p 128 -n 256 -r 3 $flags 2>&1 | tail -1 \
      | tee /tmp/kestrel/b1.txt
    note "batch-1 [$cfg]: $(tail -1 /tmp/kestrel/b1.txt)"
  done
  for cfg in ${B64_CONFIGS:-itemwise defaults}; do
    echo "== batch-64 decode at 512: $cfg"
    kb="$K"; envs=""; flags=$(cfg_flags "$cfg")
    [ "$cfg" = itemwise ] && { kb="$K"_itemwise; chmod +x "$kb"; flags=""; envs="KESTREL_ATTN_PERSISTENT=0 KESTREL_ATTN_ITEMS_PER_BLOCK=2"; }
    env $envs timeout 200 "$kb" bench -m "$M8" --device cuda --parallel 64 -p 512 -n 128 -r 2 \
      --max-num-batched-tokens 8192 $flags 2>&1 | tee /tmp/kestrel/b64_full.txt | tail -1 | tee /tmp/kestrel/b64.txt
    grep "gemm tune" /tmp/kestrel/b64_full.txt | grep -E "^gemm tune: (1|64) x" | head -10
    note "batch-64 [$cfg]: $(tail -1 /tmp/kestrel/b64.txt)"
  done
  echo "== prefill 8 x 2048"
  timeout 200 "$K" bench -m "$M8" --device cuda --parallel 8 -p 2048 -n 2 -r 3 --max-num-batched-tokens 16384 2>&1 \
    | tail -1 | tee /tmp/kestrel/pp.txt
  note "prefill 8x2048: $(tail -1 /tmp/kestrel/pp.txt)"
fi
if [[ $STAGES == *profile* ]]; then
  echo "== op profile (eager, CUDA events): batch-64 decode"
  timeout 200 "$K" bench -m "$M8" --device cuda --parallel 64 -p 512 -n 64 -r 1 \
    --max-num-batched-tokens 8192 --cuda-profile-ops 2>&1 | grep -A24 "op profile"
fi
echo "== summary"
cat "$SUMMARY"
