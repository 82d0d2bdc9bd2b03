#!/usr/bin/env bash
# Disaggregated prefill on the H200 (docs/architecture.md, "Disaggregated prefill"): the CUDA block
# transfer round trip test (read_kv_blocks / write_kv_blocks through host memory), then a producer
# and a consumer `kestrel serve --device cuda` (kv_transport "host": through host memory although
# both run on this GPU; gpu_disagg_ipc.sh runs the CUDA IPC path) behind `kestrel router`, 16 greedy stories260K
# requests through the router against one plain server: how many outputs are equal (on the GPU a
# different batch composition may change bits, so a count), and the blocks both sides still hold.
# Carry: devbin (kestrel, kestrel_tests, stories260K.gguf).
set -uo pipefail
source scripts/device/device_env.sh
echo "== CUDA KV transfer round trip (kestrel_tests)"
timeout 120 $BIN/kestrel_tests --gtest_filter='CudaModelRunner.TransferredBlocks*' --gtest_brief=1 2>&1 | tail -4 \
  | tee -a "$SUMMARY"

common=(-m $BIN/stories260K.gguf --device cuda --max-model-len 512 --block-size 16 --num-kv-blocks 512)
"$K" serve "${common[@]}" --port 8101 --kv-transfer-config '{"kv_role": "kv_producer"}' > /tmp/kestrel/p.log 2>&1 &
P=$!
"$K" serve "${common[@]}" --port 8102 \
  --kv-transfer-config '{"kv_role": "kv_consumer", "kv_connector_extra_config": {"kv_transport": "host"}}' \
  > /tmp/kestrel/c.log 2>&1 &
C=$!
"$K" serve "${common[@]}" --port 8103 > /tmp/kestrel/s.log 2>&1 &
S=$!
"$K" router --prefill http://127.0.0.1:8101 --decode http://127.0.0.1:8102 --port 8100 > /tmp/kestrel/r.log 2>&1 &
R=$!
for port in 8101 8102 8103; do
  for _ in $(seq 120); do curl -sf http://127.0.0.1:$port/health > /dev/null && break; sleep 0.5; done
done
python3 - <<'PY' | tee -a "$SUMMARY"
import json, urllib.request
from concurrent.futures import ThreadPoolExecutor
def post(port, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=120))["choices"][0]["text"]
def gauge(port, name):
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    return next(float(l.split()[-1]) for l in text.splitlines() if l.startswith(name + " "))
bodies = [{"prompt": f"Once upon a time there was a {w}", "max_tokens": 48, "temperature": 0}
          for w in ["cat", "dog", "girl", "boy", "king", "bird", "tree", "car", "fish", "frog", "duck",
                    "bear", "ship", "star", "moon", "ball"]]
with ThreadPoolExecutor(8) as pool:
    want = list(pool.map(lambda b: post(8103, b), bodies))
    got = list(pool.map(lambda b: post(8100, b), bodies))
same = sum(a == b for a, b in zip(want, got))
print(f"disagg on cuda: {same}/{len(bodies)} outputs equal to one server's; blocks used after: producer "
      f"{gauge(8101, 'kestrel_kv_blocks_used'):.0f} (held {gauge(8101, 'kestrel_kv_transfer_held_requests'):.0f}), "
      f"consumer {gauge(8102, 'kestrel_kv_blocks_used'):.0f}")
PY
kill $R $P $C $S 2>/dev/null
wait 2>/dev/null
tail -n 2 /tmp/kestrel/p.log /tmp/kestrel/c.log
