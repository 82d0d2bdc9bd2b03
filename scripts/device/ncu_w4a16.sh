#!/usr/bin/env bash
# Nsight Compute on the W4A16 streaming GEMV (stream_gemv_w4a16.cuh) at the 8B's gate|up shape,
# one token (kestrel_cuda_bench int4: the 801st launch of the one-token kernel): speed of light,
# occupancy, scheduler statistics and the warp stall reasons per issued instruction.
# Carry: devbin (kestrel_cuda_bench of a -DKESTREL_CUDA=ON build, plain or .xz, and its .so files).
set -uo pipefail
source scripts/device/device_env.sh
[ -f $BIN/kestrel_cuda_bench.xz ] && xz -dkf $BIN/kestrel_cuda_bench.xz
chmod +x $BIN/kestrel_cuda_bench
stalls=""
for r in barrier long_scoreboard short_scoreboard mio_throttle math_pipe_throttle wait not_selected selected \
  dispatch_stall lg_throttle no_instruction branch_resolving drain imc_miss misc membar sleeping tex_throttle; do
  stalls="$stalls${stalls:+,}smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio"
done
ncu --kernel-name-base demangled --kernel-name regex:"w4a16_kernel<\\(int\\)1," --launch-skip 800 --launch-count 1 \
  --section SpeedOfLight --section Occupancy --section SchedulerStats --metrics "$stalls" --clock-control none \
  $BIN/kestrel_cuda_bench int4 > $OUT/ncu_w4a16.txt 2>&1
grep -E "Duration|DRAM Throughput|Issued Warp|Eligible Warps|Registers|stalled" $OUT/ncu_w4a16.txt
