#!/usr/bin/env bash
# Nsight Compute on the decode attention kernel at the batch-64 benchmark's shape (64 sequences,
# 576-token contexts, 32/8 heads, d128): speed of light, memory, occupancy and warp stalls.
# Carry: devbin (kestrel_cuda_bench).
set -uo pipefail
source scripts/device/device_env.sh
chmod +x $BIN/kestrel_cuda_bench
$BIN/kestrel_cuda_bench "decode 64 x ctx 576"
ncu --kernel-name regex:attention_decode --launch-skip 5 --launch-count 1 \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
  --section LaunchStats --section SchedulerStats \
  $BIN/kestrel_cuda_bench "decode 64 x ctx 576" 2>&1 | grep -v "^==PROF==" | grep -E "Throughput|Issued Warp|Eligible|Registers|Achieved Occ|Duration|Executed Ipc|Memory Throughput"
