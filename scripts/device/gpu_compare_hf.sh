#!/usr/bin/env bash
# SmolLM2 (the real
# default weights, GGUF Q4_1) and the 8B-shaped model against transformers, then the peer's
# benchmarks (hf_bench.py). Carry: devdata/b (second part of the SmolLM2 GGUF, its sha256, the
# gguf wheel transformers' GGUF loader needs).
set -uo pipefail
source scripts/device/device_env.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site devdata/b/*.whl \
  && export PYTHONPATH=/tmp/site
mkdir -p /tmp/kestrel/smol
cat /tmp/kestrel/smol.part1 devdata/b/smol.part > /tmp/kestrel/smol/SmolLM2-135M-Instruct.Q4_1.gguf
echo "$(cat devdata/b/smol.sha256)  /tmp/kestrel/smol/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c
echo "== SmolLM2-135M-Instruct (GGUF Q4_1) vs transformers"
timeout 240 python3 scripts/device/logits_check.py --kestrel "$K" --gguf /tmp/kestrel/smol/SmolLM2-135M-Instruct.Q4_1.gguf \
  --name SmolLM2 2>&1 | grep -v Warning | tail -6 | tee /tmp/kestrel/smol.log
note "$(grep -E 'argmax agreement|vs transformers f32|RESULT' /tmp/kestrel/smol.log | tr '\n' ' ')"
echo "== 8B-shaped random model vs transformers"
timeout 300 python3 scripts/device/logits_check.py --kestrel "$K" -m "$M8" --name llama8b 2>&1 | tail -6 \
  | tee /tmp/kestrel/l8.log
note "$(grep -E 'argmax agreement|vs transformers f32|top-2|RESULT' /tmp/kestrel/l8.log | tr '\n' ' ')"
echo "== transformers benchmarks (same GPU, same run)"
timeout 300 python3 scripts/device/hf_bench.py -m "$M8" 2>&1 | grep -E "^HF" | tee /tmp/kestrel/hf.txt
cat /tmp/kestrel/hf.txt >> "$SUMMARY"
echo "== summary (calls 1-2)"
cat "$SUMMARY"
