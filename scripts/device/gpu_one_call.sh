#!/usr/bin/env bash
# One device call for the CUDA backend: the op tests and op timings, then kestrel built on
# the CPU machine (carried in devbin/, see below) against HF transformers on a random Llama, then a
# decode benchmark. Run from the repo root on the GPU machine:
#   scripts/device/gpu_one_call.sh
# devbin/ (ignored; list it in .git/info/exclude) holds: kestrel (built here with -DKESTREL_CUDA=ON),
# libpcre2-8.so.0 and libxxhash.so.0 (in case the machine lacks them), tokenizer.model (Llama 2).
set -uo pipefail
OUT="${OUT:-/tmp/kestrel_out}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
echo "== op tests"
KESTREL_CUDA_BENCH="${KESTREL_CUDA_BENCH:-1}" KESTREL_CUDA_REPORT=1 scripts/device/cuda_tests.sh 2>&1 | tail -40
cublas_dir=$(python3 -c 'import nvidia.cublas as m; print(list(m.__path__)[0] + "/lib")' 2>/dev/null || true)
export LD_LIBRARY_PATH="$PWD/devbin:/usr/local/cuda/lib64:${cublas_dir}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
chmod +x devbin/kestrel
echo "== kestrel vs transformers (random Llama, head_dim 64)"
PYTHONUNBUFFERED=1 python3 scripts/device/e2e_check.py --kestrel devbin/kestrel --tokenizer-model devbin/tokenizer.model \
  --out "$OUT" 2>&1 | tee "$OUT/e2e.log" | tail -20
echo "== done"
