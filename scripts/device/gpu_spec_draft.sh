#!/usr/bin/env bash
# Speculative decoding with a draft model on the GPU in one device call.
#  1. SmolLM2-135M-Instruct (Q4_1 GGUF) as its own draft (perfect: every greedy draft accepted) and
#     as an RTN INT4 copy of itself ("quantization": "rtn", imperfect and cheaper), batch-1 greedy
#     decode of the input-grounded and chat prompts, speculation off then on in one process
#     (`kestrel bench --prompts`: decode tok/s, speed-up, acceptance, outputs as off).
#  2. The cost of verification on a large target: the Llama-3.1-8B shape (configs/llama-3.1-8b,
#     random weights, --load-format dummy) with a 4-layer random draft of the same vocabulary
#     (configs/llama-3.1-8b-draft-tiny), batch 1, greedy. Random models almost never agree, so with
#     k = 4 every step drafts 4 tokens and verifies 1 + 4: TPOT on = draft (a catch-up pass and 3
#     one-token passes) + the 1 + 4-token verify step. The draft alone as target gives its
#     one-token step, so verify(1 + 4) ~= TPOT on - 4 x TPOT draft, against TPOT off (one token).
# usage: gpu_spec_draft.sh DIR MODEL
#   DIR holds kestrel (plain or .xz, built with KESTREL_CUDA=ON), libpcre2-8.so.0, libxxhash.so.0;
#   MODEL the SmolLM2 GGUF file. Results in $OUT (one log per row and summary.txt).
set -uo pipefail
D=$(realpath "$1")
M=$(realpath "$2")
cd "$(dirname "$0")/../.." || exit 1
OUT="${OUT:-/tmp/kestrel_spec_draft}"
mkdir -p "$OUT"
[ -f "$D/kestrel.xz" ] && xz -dkf "$D/kestrel.xz"
chmod +x "$D/kestrel"
export LD_LIBRARY_PATH="$D:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
S="$OUT/summary.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$S"
row() {  # LABEL PROMPTS CONFIG
  echo "== $1 $3" | tee -a "$S"
  timeout 300 "$D/kestrel" bench -m "$M" --device cuda --prompts "bench/data/$2" -n 128 -r 1 \
    --speculative-config "$3" > "$OUT/$1.txt" 2>&1 || echo "FAILED rc=$?" | tee -a "$S"
  tail -4 "$OUT/$1.txt" | tee -a "$S"
}
SAME="{\"method\": \"draft_model\", \"model\": \"$M\""
row grounded_same_k4 spec_grounded_prompts.jsonl "$SAME, \"num_speculative_tokens\": 4}"
row grounded_rtn_k4 spec_grounded_prompts.jsonl "$SAME, \"quantization\": \"rtn\", \"num_speculative_tokens\": 4}"
row grounded_rtn_k8 spec_grounded_prompts.jsonl "$SAME, \"quantization\": \"rtn\", \"num_speculative_tokens\": 8}"
row chat_rtn_k4 spec_chat_prompts.jsonl "$SAME, \"quantization\": \"rtn\", \"num_speculative_tokens\": 4}"

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
b1 8b_draft_k4 "$T" --speculative-config "{\"method\": \"draft_model\", \"model\": \"$DR\", \"num_speculative_tokens\": 4}"
b1 8b_draft_k1 "$T" --speculative-config "{\"method\": \"draft_model\", \"model\": \"$DR\", \"num_speculative_tokens\": 1}"
b1 draft_alone "$DR"
echo "== summary" && cat "$S"
