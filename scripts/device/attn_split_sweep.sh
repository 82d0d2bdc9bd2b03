#!/usr/bin/env bash
# Decode attention at the batch-64 benchmark's shape under split-KV plans (paged_attention.cu's
# KESTREL_ATTN_* overrides: split-block target and minimum partition), then the GPU attention tests.
# Its 2026-11-30 run (with an even-split variant since removed) set kSplitTargetBlocks = 1024.
# Carry: devbin (kestrel_cuda_bench, kestrel_tests and the .so files).
set -uo pipefail
source scripts/device/issue4_common.sh
chmod +x $BIN/kestrel_cuda_bench $BIN/kestrel_tests
for cfg in KESTREL_DEFAULTS=1 KESTREL_ATTN_SPLIT_BLOCKS=512 KESTREL_ATTN_SPLIT_BLOCKS=1584 \
    KESTREL_ATTN_SPLIT_BLOCKS=4096,KESTREL_ATTN_MIN_PARTITION=128; do
  echo "== $cfg"
  for f in "decode 64 x ctx 576" "decode 64 x ctx 2048, 32/8"; do
    env ${cfg//,/ } timeout 60 $BIN/kestrel_cuda_bench "$f" 2>&1 | grep "^attention"
  done
done
timeout 120 $BIN/kestrel_tests --gtest_filter='CudaPagedAttention*' --gtest_brief=1 2>&1 \
  | grep -E "PASSED|FAILED|Failure" | head -5
