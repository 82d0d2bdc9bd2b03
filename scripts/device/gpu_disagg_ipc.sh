#!/usr/bin/env bash
# Disaggregated prefill on one H200 through CUDA IPC (docs/architecture.md, "Disaggregated
# prefill"): the IPC block copy tests, then
#  1. stories260K: a producer and a consumer `kestrel serve --device cuda` (kv_transport auto: both
#     on this GPU, so the blocks move device to device) behind `kestrel router`, 16 greedy requests
#     against one plain server: outputs equal, pulls by transport, blocks both sides still hold;
#  2. the Llama-3.1-8B shape (--load-format dummy, random bf16 weights): one producer, a consumer
#     with kv_transport auto (CUDA IPC) and one with "host", 3 hand-offs of a 7,900-token prompt to
#     each: the consumer's pull (HTTP exchange; IPC: with mapping the handles) and its copy into
#     its blocks (IPC: device to device; host: host to device), ms and GB/s, from /metrics.
# Carry: devbin (kestrel, kestrel_tests of a -DKESTREL_CUDA=ON build, plain or .xz, libpcre2-8.so.0,
# libxxhash.so.0, stories260K.gguf, llama3-bpe-vocab/ from the shared data: the 8B folder's tokenizer).
set -uo pipefail
source scripts/device/device_env.sh
for f in kestrel kestrel_tests; do [ -f $BIN/$f.xz ] && xz -dkf $BIN/$f.xz && chmod +x $BIN/$f; done
echo "== CUDA IPC block copy (kestrel_tests)"
timeout 120 $BIN/kestrel_tests --gtest_filter='CudaKvIpc*:CudaModelRunner.TransferredBlocks*' --gtest_brief=1 2>&1 |
  tail -6 | tee -a "$SUMMARY"

wait_up() {  # port log
  for _ in $(seq 240); do curl -sf http://127.0.0.1:$1/health > /dev/null && return 0; sleep 0.5; done
  echo "server on port $1 did not start:"; tail -5 "$2"; return 1
}
ipc='{"kv_role": "kv_consumer", "kv_connector_extra_config": {"kv_transport": "auto"}}'
host='{"kv_role": "kv_consumer", "kv_connector_extra_config": {"kv_transport": "host"}}'

echo "== stories260K: producer + consumer (CUDA IPC) + router, 16 greedy requests"
common=(-m $BIN/stories260K.gguf --device cuda --max-model-len 512 --block-size 16 --num-kv-blocks 512)
"$K" serve "${common[@]}" --port 8101 --kv-transfer-config '{"kv_role": "kv_producer"}' > /tmp/kestrel/p.log 2>&1 &
P=$!
"$K" serve "${common[@]}" --port 8102 --kv-transfer-config "$ipc" > /tmp/kestrel/c.log 2>&1 &
C=$!
"$K" serve "${common[@]}" --port 8103 > /tmp/kestrel/s.log 2>&1 &
S=$!
"$K" router --prefill http://127.0.0.1:8101 --decode http://127.0.0.1:8102 --port 8100 > /tmp/kestrel/r.log 2>&1 &
R=$!
wait_up 8101 /tmp/kestrel/p.log; wait_up 8102 /tmp/kestrel/c.log; wait_up 8103 /tmp/kestrel/s.log
python3 - <<'PY' | tee -a "$SUMMARY"
import json, urllib.request
from concurrent.futures import ThreadPoolExecutor
def post(port, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=120))["choices"][0]["text"]
def metric(port, name):
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    return next(float(l.split()[-1]) for l in text.splitlines() if l.startswith(name + " "))
bodies = [{"prompt": f"Once upon a time there was a {w}", "max_tokens": 48, "temperature": 0}
          for w in ["cat", "dog", "girl", "boy", "king", "bird", "tree", "car", "fish", "frog", "duck",
                    "bear", "ship", "star", "moon", "ball"]]
with ThreadPoolExecutor(8) as pool:
    want = list(pool.map(lambda b: post(8103, b), bodies))
    got = list(pool.map(lambda b: post(8100, b), bodies))
same = sum(a == b for a, b in zip(want, got))
pulls = {t: metric(8102, f'kestrel_kv_transfer_pulls_total{{kv_transport="{t}"}}') for t in ("cuda_ipc", "host")}
print(f"disagg cuda_ipc: {same}/{len(bodies)} outputs equal to one server's; consumer pulls: "
      f"cuda_ipc {pulls['cuda_ipc']:.0f}, host {pulls['host']:.0f}; blocks used after: producer "
      f"{metric(8101, 'kestrel_kv_blocks_used'):.0f} (held {metric(8101, 'kestrel_kv_transfer_held_requests'):.0f}), "
      f"consumer {metric(8102, 'kestrel_kv_blocks_used'):.0f}",
      "PASS" if same == len(bodies) and pulls["cuda_ipc"] == len(bodies) else "CHECK")
PY
kill $R $P $C $S 2>/dev/null
wait 2>/dev/null
grep -h "KV transfer\|IPC" /tmp/kestrel/c.log | head -3

echo "== 8B shape (dummy weights): hand-off of a 7,900-token prompt, CUDA IPC against host memory"
M=/tmp/kestrel/llama8b_serve
mkdir -p $M && cp scripts/device/configs/llama-3.1-8b/config.json $M/ &&
  cp $BIN/llama3-bpe-vocab/encoder.json $BIN/llama3-bpe-vocab/vocab.bpe $M/ 2>/dev/null ||
  [ -f $M/encoder.json ] || echo "no devbin/llama3-bpe-vocab: carry it"
big=(-m $M --load-format dummy --device cuda --max-model-len 8192 --block-size 16 --num-kv-blocks 2048
     --max-num-batched-tokens 8192)
"$K" serve "${big[@]}" --port 8111 --kv-transfer-config '{"kv_role": "kv_producer"}' > /tmp/kestrel/p8.log 2>&1 &
P=$!
"$K" serve "${big[@]}" --port 8112 --kv-transfer-config "$ipc" > /tmp/kestrel/c8.log 2>&1 &
C=$!
"$K" serve "${big[@]}" --port 8113 --kv-transfer-config "$host" > /tmp/kestrel/h8.log 2>&1 &
H=$!
wait_up 8111 /tmp/kestrel/p8.log && wait_up 8112 /tmp/kestrel/c8.log && wait_up 8113 /tmp/kestrel/h8.log &&
python3 - <<'PY' | tee -a "$SUMMARY"
import json, random, time, urllib.request
def post(port, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=300))
def metrics(port):
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    return {l.rsplit(" ", 1)[0]: float(l.rsplit(" ", 1)[1]) for l in text.splitlines() if l and l[0] != "#"}
rng = random.Random(0)
for port, t in ((8112, "cuda_ipc"), (8113, "host")):
    for i in range(4):  # the first warms up (graphs, handles), not counted
        prompt = [rng.randrange(1000, 100000) for _ in range(7900)]
        params = post(8111, {"prompt": prompt, "max_tokens": 1, "temperature": 0,
                             "kv_transfer_params": {"do_remote_decode": True}})["kv_transfer_params"]
        before = metrics(port)
        t0 = time.time()
        out = post(port, {"prompt": prompt, "max_tokens": 2, "temperature": 0, "kv_transfer_params": params})
        e2e = time.time() - t0
        after = metrics(port)
        d = lambda name: after[f'{name}{{kv_transport="{t}"}}'] - before.get(f'{name}{{kv_transport="{t}"}}', 0)
        pulls, nbytes = d("kestrel_kv_transfer_pulls_total"), d("kestrel_kv_transfer_import_bytes_total")
        pull_s, copy_s = d("kestrel_kv_transfer_pull_seconds_total"), d("kestrel_kv_transfer_import_seconds_total")
        if i == 0 or pulls != 1:
            print(f"  {t} warm-up: pulls {pulls:.0f}, {nbytes / 1e9:.3f} GB") if i == 0 else print(f"  {t}: pulls {pulls}")
            continue
        print(f"8B hand-off {t}: {nbytes / 1e9:.3f} GB ({params['num_computed_tokens']} tokens): pull "
              f"{pull_s * 1e3:.1f} ms, copy {copy_s * 1e3:.2f} ms = {nbytes / copy_s / 1e9:.0f} GB/s; "
              f"pull + copy {(pull_s + copy_s) * 1e3:.1f} ms = {nbytes / (pull_s + copy_s) / 1e9:.1f} GB/s; "
              f"consumer request {e2e * 1e3:.0f} ms")
m = metrics(8111)
print(f"8B producer after: blocks used {m['kestrel_kv_blocks_used']:.0f}, held {m['kestrel_kv_transfer_held_requests']:.0f}")
PY
kill $P $C $H 2>/dev/null
wait 2>/dev/null
tail -n 2 /tmp/kestrel/p8.log /tmp/kestrel/c8.log /tmp/kestrel/h8.log
