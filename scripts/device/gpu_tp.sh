#!/usr/bin/env bash
# Tensor parallelism on the CUDA backend (--tensor-parallel-size; docs/architecture.md, "Tensor
# parallelism") on the 2- and 4-GPU kinds (nvidia-h200-x2 / -x4): the CudaTensorParallel tests on
# GPUs 0 .. N-1 (stories260K and mistral-swa-tiny over 2 and 4 ranks against one: each logits row
# within 2% of its largest magnitude, worst printed; stories260K greedy tokens equal; skipped
# beyond the visible GPUs), the CLI's stories260K greedy over 2 ranks against 1, then the
# Llama-3.1-8B shape (random weights, --load-format dummy, made on the host and split there) at
# batch 1 and 64 on 1, 2 (and 4) GPUs, and the Llama-3.1-70B shape on 2 (and 4). On one GPU the
# tests skip and the CLI refuses --tensor-parallel-size 2 naming the flag.
# NCCL: the nvidia-nccl wheel PyTorch installs (libnccl.so.2 is loaded with dlopen); NVLink
# multicast off (NCCL_NVLS_ENABLE=0). Under 10 minutes on 2 GPUs; the 70B runs may take most.
# Carry: devbin (kestrel.xz, kestrel_tests.xz, their .so files, stories260K.gguf) and devdata
# holding hf-tiny/mistral-swa-tiny (KESTREL_DATA_DIR below).
set -uo pipefail
source scripts/device/device_env.sh
begin_run
nccl_dir=$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0] + "/lib")' 2>/dev/null || true)
export LD_LIBRARY_PATH="${nccl_dir:+$nccl_dir:}$LD_LIBRARY_PATH"
export NCCL_NVLS_ENABLE=0
[ -d devdata/hf-tiny ] && mkdir -p /tmp/kestrel/data && cp -r devdata/hf-tiny /tmp/kestrel/data/
n_gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
note "GPUs: $n_gpus; NCCL from ${nccl_dir:-the system}"

echo "== CudaTensorParallel, CudaEmbedding (kestrel_tests)"
timeout 240 $BIN/kestrel_tests --gtest_filter='CudaTensorParallel.*:CudaEmbedding.*' 2>&1 \
  | grep -E "worst difference|^\[ +(OK|FAILED|PASSED|SKIPPED) |Failure|Expected|Which is|actual|NCCL" | head -60 \
  | tee /tmp/kestrel/tp_tests.txt
note "tp tests: $(grep -E '^\[  (PASSED|FAILED) ' /tmp/kestrel/tp_tests.txt | tr '\n' ' ')"

echo "== CLI: --device cuda --tensor-parallel-size 2"
gen() {  # gen TP: stories260K greedy, 32 tokens, output ids to /tmp/kestrel/tp_$1.json
  timeout 60 "$K" generate -m $BIN/stories260K.gguf -p "Once upon a time" -n 32 --temperature 0 --json \
    --device cuda --tensor-parallel-size "$1" > /tmp/kestrel/tp_$1.json 2>/tmp/kestrel/tp_$1.err
}
gen 1 || tail -3 /tmp/kestrel/tp_1.err
if [ "$n_gpus" -lt 2 ]; then
  if gen 2; then note "cli tp 2 on $n_gpus GPU: ran (expected a refusal) FAIL"
  else note "cli tp 2 on $n_gpus GPU: $(grep -o 'tensor-parallel-size.*' /tmp/kestrel/tp_2.err | head -1)"; fi
  cat "$SUMMARY"
  exit 0
fi
gen 2 || tail -3 /tmp/kestrel/tp_2.err
python3 - <<'PY' | tee -a "$SUMMARY"
import json
a = json.load(open("/tmp/kestrel/tp_1.json"))["output_ids"]
b = json.load(open("/tmp/kestrel/tp_2.json"))["output_ids"]
print(f"cli tp 2 on GPUs 0, 1: {sum(x == y for x, y in zip(a, b))} of {len(a)} greedy tokens equal to tp 1",
      "PASS" if a == b else "FAIL")
PY

# bench SHAPE TP ARGS...: one bench line into the summary.
bench() {
  local shape=$1 tp=$2; shift 2
  timeout 280 "$K" bench -m scripts/device/configs/$shape --load-format dummy --device cuda \
    --tensor-parallel-size "$tp" "$@" 2>&1 | tail -3 | tee /tmp/kestrel/bench.txt
  note "$shape tp $tp $*: $(tail -1 /tmp/kestrel/bench.txt)"
}
echo "== Llama-3.1-8B shape: batch-1 decode (-p 128 -n 256) and batch 64 (-p 512 -n 128)"
for tp in 1 2 4; do
  [ "$tp" -le "$n_gpus" ] || continue
  bench llama-3.1-8b $tp -p 128 -n 256 -r 2
  bench llama-3.1-8b $tp --parallel 64 -p 512 -n 128 -r 2 --max-num-batched-tokens 8192
done
echo "== Llama-3.1-70B shape (140 GB of bf16): batch 1 and 64"
for tp in 2 4; do
  [ "$tp" -le "$n_gpus" ] || continue
  bench llama-3.1-70b $tp -p 128 -n 128 -r 1
  bench llama-3.1-70b $tp --parallel 64 -p 512 -n 64 -r 1 --max-num-batched-tokens 8192
done
echo "== summary"
cat "$SUMMARY"
