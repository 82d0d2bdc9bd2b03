#!/usr/bin/env bash
# A change measured against the binary before it, in one call: the GPU op tests, the CUDA engine
# tests (MultiTokenStepCuda, Engine*), the stories260K CPU-vs-GPU check, then the 8B-shaped model's
# benchmarks (batch-1 decode, batch-64 decode at 512, prefill 8 x 2048) for devbin/kestrel_before
# and devbin/kestrel, alternating.
# Carry: devbin (kestrel, kestrel_before, kestrel_tests, the .so files, stories260K.gguf,
# tokenizer.model).
set -uo pipefail
source scripts/device/device_env.sh
begin_run
# The tests read stories260K from the data folder they are pointed at.
mkdir -p /tmp/kestrel/data/stories260K && cp $BIN/stories260K.gguf /tmp/kestrel/data/stories260K/
export KESTREL_DATA_DIR=/tmp/kestrel/data
TEST_FILTER='Cuda*:MultiTokenStep*:Engine.*' op_tests
[ -f "$M8/config.json" ] || python3 scripts/device/make_llama8b.py "$M8"
chmod +x $BIN/kestrel_before 2>/dev/null
for round in 1 2; do
  for bin in kestrel_before kestrel; do
    echo "== $bin (round $round)"
    timeout 200 $BIN/$bin bench -m "$M8" --device cuda -p 128 -n 256 -r 3 2>&1 | tail -1 | tee /tmp/kestrel/b1.txt
    note "$bin batch-1 (round $round): $(tail -1 /tmp/kestrel/b1.txt)"
    [ $round = 2 ] && continue
    timeout 200 $BIN/$bin bench -m "$M8" --device cuda --parallel 64 -p 512 -n 128 -r 2 \
      --max-num-batched-tokens 8192 2>&1 | tail -1 | tee /tmp/kestrel/b64.txt
    note "$bin batch-64 @512: $(tail -1 /tmp/kestrel/b64.txt)"
    timeout 200 $BIN/$bin bench -m "$M8" --device cuda --parallel 8 -p 2048 -n 2 -r 3 \
      --max-num-batched-tokens 16384 2>&1 | tail -1 | tee /tmp/kestrel/pp.txt
    note "$bin prefill 8x2048: $(tail -1 /tmp/kestrel/pp.txt)"
  done
done
echo "== summary"
cat "$SUMMARY"
