#!/usr/bin/env bash
# Pipeline parallelism on the CUDA backend (--pipeline-parallel-size; docs/architecture.md,
# "Pipeline parallelism"): the CudaPipelineParallel tests on the GPU (stories260K in 2 and 3
# stages, every stage on device 0, against one stage: each logits row within 2% of its largest
# magnitude, the worst difference printed; greedy tokens equal) and the hand-off's add
# (CudaAddRmsNorm.AddResidual...), the one-GPU runner's tests
# (CudaModelRunner.*), then the CLI: with one GPU, --pipeline-parallel-size 2 is
# refused naming the flag; with two or more, stories260K greedy through 2 stages on GPUs 0 and 1
# against one stage. Under 4 minutes of device time.
# Carry: devbin (kestrel, kestrel_tests, their .so files, stories260K.gguf).
set -uo pipefail
source scripts/device/device_env.sh
begin_run
echo "== CudaPipelineParallel, CudaAddRmsNorm (kestrel_tests)"
timeout 150 $BIN/kestrel_tests --gtest_filter='CudaPipelineParallel.*:CudaAddRmsNorm.*' 2>&1 \
  | grep -E "worst difference|^\[ +(OK|FAILED|PASSED|SKIPPED) |Failure|Expected|Which is|actual" | head -40 \
  | tee /tmp/kestrel/pp_tests.txt
note "pp tests: $(grep -E '^\[  (PASSED|FAILED) ' /tmp/kestrel/pp_tests.txt | tr '\n' ' ')"
echo "== CudaModelRunner (kestrel_tests)"
timeout 120 $BIN/kestrel_tests --gtest_filter='CudaModelRunner.*' --gtest_brief=1 2>&1 | tail -6 \
  | tee /tmp/kestrel/runner_tests.txt
note "runner tests: $(grep -E '^\[  (PASSED|FAILED) ' /tmp/kestrel/runner_tests.txt | tr '\n' ' ')"

echo "== CLI: --device cuda --pipeline-parallel-size 2"
n_gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
gen() {  # gen PP: stories260K greedy, 32 tokens, output ids to /tmp/kestrel/pp_$1.json
  timeout 60 "$K" generate -m $BIN/stories260K.gguf -p "Once upon a time" -n 32 --temperature 0 --json \
    --device cuda --pipeline-parallel-size "$1" > /tmp/kestrel/pp_$1.json 2>/tmp/kestrel/pp_$1.err
}
gen 1 || tail -3 /tmp/kestrel/pp_1.err
if [ "$n_gpus" -lt 2 ]; then
  if gen 2; then note "cli pp 2 on $n_gpus GPU: ran (expected a refusal) FAIL"
  else note "cli pp 2 on $n_gpus GPU: $(grep -o 'pipeline-parallel-size.*' /tmp/kestrel/pp_2.err | head -1)"; fi
else
  gen 2 || tail -3 /tmp/kestrel/pp_2.err
  python3 - <<'PY' | tee -a "$SUMMARY"
import json
a = json.load(open("/tmp/kestrel/pp_1.json"))["output_ids"]
b = json.load(open("/tmp/kestrel/pp_2.json"))["output_ids"]
print(f"cli pp 2 on GPUs 0, 1: {sum(x == y for x, y in zip(a, b))} of {len(a)} greedy tokens equal to pp 1",
      "PASS" if a == b else "FAIL")
PY
fi
echo "== summary"
cat "$SUMMARY"
