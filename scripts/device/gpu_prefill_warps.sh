#!/usr/bin/env bash
# Prefill attention with blocks of 4 and 8 warps (--attn-prefill-warps / --cuda-attn-prefill-warps):
# the GPU tests of the two block sizes, kestrel_cuda_bench's prefill rows (bf16 and FP8 caches)
# alternating the two twice, then a prefill of 4 x 8,000 tokens in one pass of the Llama-3.1-8B
# shape with random weights, where attention is a large part of the work.
# Carry: devbin (kestrel, kestrel_tests, kestrel_cuda_bench and the .so files).
set -uo pipefail
source scripts/device/device_env.sh
begin_run
chmod +x $BIN/kestrel_tests 2>/dev/null
timeout 120 $BIN/kestrel_tests --gtest_filter='CudaPagedAttention.EachPrefillBlockSize*:CudaPagedAttention.Rejects*' \
  --gtest_brief=1 > $OUT/prefill_warps_tests.txt 2>&1
note "tests: $(grep -E '^\[  (PASSED|FAILED) ' $OUT/prefill_warps_tests.txt | tr '\n' ' ')"
for w in 0 8 0 8; do
  timeout 60 $BIN/kestrel_cuda_bench --attn-prefill-warps=$w "attention prefill" 2>&1 | grep -E "32/8|9/3" |
    sed "s/^/warps $w: /" | tee -a $OUT/prefill_warps_bench.txt
done
for w in 0 8; do
  timeout 120 $K bench --device cuda --load-format dummy -m scripts/device/configs/llama-3.1-8b --parallel 4 -p 8000 \
    -n 1 -r 1 --max-num-batched-tokens 32768 --cuda-attn-prefill-warps $w > $OUT/prefill_warps_model_$w.txt 2>&1
  note "4 x 8000 prefill, warps $w: $(tail -1 $OUT/prefill_warps_model_$w.txt)"
done
echo "== summary"
cat "$SUMMARY"
