#!/usr/bin/env bash
# Where speculative drafts are verified, on the GPU in one device call: --speculative-verify host
# (the 1 + k logits rows copied back, verify_drafts on the host) against device (each row sampled
# by the CUDA sampler, inside the verify step's decode graph, only token ids copied back), one
# binary.
#  1. The cost of verification on a large target: the Llama-3.1-8B shape (configs/llama-3.1-8b,
#     random weights, --load-format dummy) with a 4-layer random draft of the same vocabulary
#     (configs/llama-3.1-8b-draft-tiny), batch 1, greedy. Random models almost never agree, so each
#     step drafts k tokens, verifies 1 + k and emits one: verify(1 + k) ~= TPOT on - k x TPOT of
#     the draft alone, against TPOT off (one-token steps), as in gpu_spec_draft.sh.
#  2. SmolLM2-135M-Instruct (Q4_1 GGUF, bf16 on the GPU) with n-gram drafts on the input-grounded
#     and chat prompts, batch-1 greedy, speculation off then on in one process (`kestrel bench
#     --prompts`: decode tok/s, speed-up, acceptance), as in gpu_spec.sh.
# usage: gpu_spec_verify.sh DIR MODEL
#   DIR holds kestrel (plain or .xz, built with KESTREL_CUDA=ON), libpcre2-8.so.0, libxxhash.so.0;
#   MODEL the SmolLM2 GGUF file. Results in $OUT (one log per row and summary.txt).
set -uo pipefail
D=$(realpath "$1")
M=$(realpath "$2")
cd "$(dirname "$0")/../.." || exit 1
OUT="${OUT:-/tmp/kestrel_spec_verify}"
mkdir -p "$OUT"
[ -f "$D/kestrel.xz" ] && xz -dkf "$D/kestrel.xz"
chmod +x "$D/kestrel"
export LD_LIBRARY_PATH="$D:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
S="$OUT/summary.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$S"

T=scripts/device/configs/llama-3.1-8b
DR=scripts/device/configs/llama-3.1-8b-draft-tiny
b1() {  # LABEL MODEL [FLAGS...]: batch-1 decode, 128-token prompt, 128 tokens
  local label=$1 model=$2
  shift 2
  echo "== $label" | tee -a "$S"
  timeout 300 "$D/kestrel" bench -m "$model" --load-format dummy --device cuda --parallel 1 -p 128 -n 128 -r 3 \
    "$@" > "$OUT/$label.txt" 2>&1 || echo "FAILED rc=$?" | tee -a "$S"
  tail -2 "$OUT/$label.txt" | tee -a "$S"
}
b1 8b_off "$T"
b1 draft_alone "$DR"
for k in 1 4; do
  for v in host device; do
    b1 "8b_draft_k${k}_$v" "$T" --speculative-verify "$v" \
      --speculative-config "{\"method\": \"draft_model\", \"model\": \"$DR\", \"num_speculative_tokens\": $k}"
  done
done

row() {  # LABEL PROMPTS VERIFY CONFIG
  echo "== $1 $3 $4" | tee -a "$S"
  timeout 240 "$D/kestrel" bench -m "$M" --device cuda --prompts "bench/data/$2" -n 128 -r 1 \
    --speculative-verify "$3" --speculative-config "$4" > "$OUT/$1.txt" 2>&1 || echo "FAILED rc=$?" | tee -a "$S"
  tail -6 "$OUT/$1.txt" | tee -a "$S"
}
for v in host device; do
  row "grounded_k4_$v" spec_grounded_prompts.jsonl "$v" '{"method": "ngram", "num_speculative_tokens": 4}'
  row "grounded_k8_$v" spec_grounded_prompts.jsonl "$v" \
    '{"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 3}'
  row "chat_k4_$v" spec_chat_prompts.jsonl "$v" '{"method": "ngram", "num_speculative_tokens": 4}'
done
echo "== summary" && cat "$S"
