#!/usr/bin/env bash
# The FP8 KV cache on the Llama-3.1-8B shape, in one device call: the attention op tests, the op
# benchmark's KV rows, whole-model batch-64 decode at 4,096 context with bf16 and FP8 KV, Nsight
# Compute on the FP8 decode kernel (NCU=1, last, when the call has time left), and (OFFLINE=1) the offline batch with FP8 weights and
# FP8 KV. With devbin/kestrel_main and devbin/kestrel_cuda_bench_main (another build, e.g. main's)
# their FP8 rows run in the same call for comparison.
# Carry: devbin (kestrel, kestrel_tests, kestrel_cuda_bench, libs, stories260K.gguf), and for the
# offline batch devdata/vocab (vocab.json + merges.txt: ../shared/data/llama3-bpe-vocab's
# encoder.json and vocab.bpe renamed).
set -uo pipefail
source scripts/device/device_env.sh
begin_run
chmod +x $BIN/* 2>/dev/null
CFG=scripts/device/configs/llama-3.1-8b
TEST_FILTER='CudaPagedAttention.*:CudaKvFp8.*' op_tests 2>&1 | grep -v "^  d\|^  stor" | tail -8
for b in kestrel_cuda_bench kestrel_cuda_bench_main; do
  [ -x $BIN/$b ] || continue
  echo "== $b: KV rows"
  $BIN/$b " KV" 2>&1 | tee "$OUT/kv_rows_$b.txt" | grep -E "KV" | head -14
done
model() {  # binary, KV dtype
  timeout 150 "$BIN/$1" bench --device cuda --load-format dummy -m $CFG -r 1 --max-num-batched-tokens 16384 \
    --parallel 64 -p 4096 -n 128 --kv-cache-dtype $2 2>&1 | tail -2 > "$OUT/b64_4096_$1_$2.txt"
  note "b64@4096 $1 $2 KV: $(tail -1 "$OUT/b64_4096_$1_$2.txt")"
}
echo "== kestrel_cuda_bench: FP8 rows with 3 stages forced"
$BIN/kestrel_cuda_bench --attn-fp8-decode-stages=3 "fp8 KV" 2>&1 | tee "$OUT/kv_rows_s3.txt" | grep -E "KV" | head -8
model kestrel bf16
model kestrel fp8
[ -x $BIN/kestrel_main ] && model kestrel_main fp8
if [ "${OFFLINE:-0}" = 1 ]; then
  # What is left of the call's limit (CALL_S: the device tool's limit for this call, 600 s at
  # most), less the summary.
  BATCH_TIMEOUT=$((${CALL_S:-600} - 30 - SECONDS)) VOCAB_DIR=devdata/vocab KESTREL_FLAGS="--quantization fp8 --kv-cache-dtype fp8" \
    bash scripts/device/gpu_offline_batch.sh \
    2>&1 | tail -6
  cp /tmp/kestrel/offline_stats.json "$OUT/" 2>/dev/null
fi
if [ "${NCU:-1}" = 1 ] && [ $SECONDS -lt $((${CALL_S:-600} - 100)) ]; then  # after the rest, if the call has time left
  echo "== ncu: decode 64 x ctx 4096, fp8 KV"
  timeout $((${CALL_S:-600} - 15 - SECONDS)) ncu --kernel-name regex:attention_decode --launch-skip 5 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats --section SchedulerStats \
    $BIN/kestrel_cuda_bench "decode 64 x ctx 4096, 32/8, d128, fp8 KV" > "$OUT/ncu_fp8.txt" 2>&1
  grep -E "Duration|DRAM Throughput|Registers Per|Achieved Occ|Issued Warp|Eligible Warps|Stall|Block Limit|Waves" "$OUT/ncu_fp8.txt" | head -24
fi
echo "== summary"
cat "$SUMMARY"
