#!/usr/bin/env bash
# The host tier of the prefix cache (--cpu-offload-kv-gb; docs/architecture.md, "Many requests,
# traced") on the H200: the CUDA swap round trip tests (the pinned host pool and copy path the tier
# shares, with the host -> device byte count, and swap_out_in: blocks copied out and others copied
# into the same device blocks in one call, the two directions on two streams), then kestrel bench --shared-prefix on the Llama-3.1-8B
# shape with random weights (--load-format dummy): time to first token of a request whose 8k-token
# prefix is (c) on the device, (a) evicted and recomputed (no host tier), (b) evicted and copied
# back from the host tier, and the H2D rate of those copies (bytes / seconds between CUDA events
# around them). Goals: (a) / (b) >= 5 and H2D >= 40 GB/s; one PASS/FAIL line each.
# usage: bash scripts/device/gpu_offload.sh   (carry devbin: kestrel, kestrel_tests, stories260K.gguf)
# Knobs: PREFIX (7936: with the new tokens within the 8B config's 8192-token context), SUFFIX (128), OFFLOAD_GIB (8), REPS (3).
set -uo pipefail
source scripts/device/device_env.sh
begin_run
PREFIX=${PREFIX:-7936} SUFFIX=${SUFFIX:-128} OFFLOAD_GIB=${OFFLOAD_GIB:-8} REPS=${REPS:-3}
echo "== CUDA swap round trips (kestrel_tests)"
timeout 120 $BIN/kestrel_tests --gtest_filter='CudaModelRunner.SwappedBlocks*' --gtest_brief=1 \
  2>&1 | tail -4 | tee -a "$SUMMARY"

echo "== 8B shape (dummy weights): TTFT with a ${PREFIX}-token shared prefix, ${SUFFIX} new tokens"
timeout 500 "$K" bench -m scripts/device/configs/llama-3.1-8b --load-format dummy --device cuda \
  --shared-prefix "$PREFIX" -p "$SUFFIX" -n 1 -r "$REPS" --cpu-offload-kv-gb "$OFFLOAD_GIB" 2>&1 \
  | grep -E '^\|' | tee /tmp/kestrel/offload_table.txt | tee -a "$SUMMARY"
python3 - <<'PY' | tee -a "$SUMMARY"
rows = {}
for line in open("/tmp/kestrel/offload_table.txt"):
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) == 9 and cells[3].startswith("on"):
        rows[cells[3]] = (float(cells[4].split()[0]), cells[8])
dev = rows.get("on, on the device")
rec = rows.get("on, evicted: recomputed")
host = rows.get("on, evicted: host tier")
if not (dev and rec and host):
    print("offload bench: rows missing FAIL")
else:
    ratio = rec[0] / host[0]
    print(f"TTFT ms: device {dev[0]:.1f}, recomputed {rec[0]:.1f}, host tier {host[0]:.1f}: "
          f"host tier {ratio:.1f}x sooner than recomputing", "PASS" if ratio >= 5 else "FAIL")
    gbs = float(host[1]) if host[1] != "-" else 0.0
    print(f"H2D of the host tier copies: {gbs:.1f} GB/s", "PASS" if gbs >= 40 else "FAIL")
PY
echo "== summary"
cat "$SUMMARY"
