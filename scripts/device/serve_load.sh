#!/usr/bin/env bash
# The OpenAI server on the GPU: `kestrel serve --device cuda` with the default SmolLM2 weights under the same
# load as docs/performance.md's CPU run (bench/serve_bench.py, 512 streaming requests, 256 at once,
# 32 in / 32 out). The GGUF travels in two calls (the device tool carries 64 MiB a call):
#   call 1: STAGE=1 scripts/device/serve_load.sh   (carry devbin, devdata/a: first part -> /tmp)
#   call 2: scripts/device/serve_load.sh           (carry devdata/b: second part, then the run)
set -uo pipefail
mkdir -p /tmp/kestrel_serve
if [ "${STAGE:-0}" = 1 ]; then
  cp -r devbin /tmp/kestrel_serve/ && cp devdata/a/smol.part /tmp/kestrel_serve/smol.part1 && echo staged && exit 0
fi
BIN=/tmp/kestrel_serve/devbin
cublas_dir=$(python3 -c 'import nvidia.cublas as m; print(list(m.__path__)[0] + "/lib")' 2>/dev/null || true)
export LD_LIBRARY_PATH="$BIN:/usr/local/cuda/lib64:${cublas_dir}"
chmod +x $BIN/kestrel
M=/tmp/kestrel_serve/SmolLM2-135M-Instruct.Q4_1.gguf
cat /tmp/kestrel_serve/smol.part1 devdata/b/smol.part > $M
echo "$(cat devdata/b/smol.sha256)  $M" | sha256sum -c || exit 1
$BIN/kestrel serve -m $M --device cuda --port 8392 > /tmp/kestrel_serve/serve.log 2>&1 &
pid=$!
for i in $(seq 60); do curl -sf localhost:8392/health >/dev/null && break; sleep 0.5; done
head -3 /tmp/kestrel_serve/serve.log
PYTHONUNBUFFERED=1 timeout 240 python3 bench/serve_bench.py --url http://127.0.0.1:8392 --rate inf --num-requests 512 \
  --max-concurrency 256 --input-len 32 --output-len 32 2>&1 | tail -25
curl -s localhost:8392/metrics | grep -E "^kestrel_(requests_total|kv_blocks_used|num_preemptions|preemptions)" 
kill -TERM $pid; wait $pid; tail -2 /tmp/kestrel_serve/serve.log
