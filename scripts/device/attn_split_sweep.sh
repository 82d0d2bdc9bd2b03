#!/usr/bin/env bash
# Decode attention under the split-KV plan's overrides (kestrel_cuda_bench --attn-items-per-block,
# --attn-min-split-tiles; AttentionParams in paged_attention.cu), then the GPU attention tests: the attn
# stage of gpu_decode_attention.sh. Results: docs/performance.md, "H200: decode attention kernels".
# Carry: devbin.
set -uo pipefail
STAGES=attn bash scripts/device/gpu_decode_attention.sh
source scripts/device/device_env.sh
timeout 120 $BIN/kestrel_tests --gtest_filter='CudaPagedAttention*' --gtest_brief=1 2>&1 \
  | grep -E "PASSED|FAILED|Failure" | head -5
