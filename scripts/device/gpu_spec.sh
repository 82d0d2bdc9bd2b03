#!/usr/bin/env bash
# Speculative decoding on the GPU in one device call: batch-1 greedy decode of real prompts with
# speculation off and then on, in one process (`kestrel bench --prompts`, which also checks that
# the outputs are token-identical), for the n-gram drafter on the input-grounded prompts and on
# ordinary chat prompts, with SmolLM2-135M-Instruct (Q4_1 GGUF, weights dequantized to bf16).
# usage: gpu_spec.sh DIR MODEL
#   DIR holds kestrel (plain or .xz, built with KESTREL_CUDA=ON), libpcre2-8.so.0, libxxhash.so.0;
#   MODEL the GGUF file. Results in $OUT (one log per row and summary.txt).
set -uo pipefail
D=$(realpath "$1")
M=$(realpath "$2")
cd "$(dirname "$0")/../.." || exit 1
OUT="${OUT:-/tmp/kestrel_spec}"
mkdir -p "$OUT"
[ -f "$D/kestrel.xz" ] && xz -dkf "$D/kestrel.xz"
chmod +x "$D/kestrel"
export LD_LIBRARY_PATH="$D:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
S="$OUT/summary.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$S"
row() {  # LABEL PROMPTS CONFIG
  echo "== $1 $3" | tee -a "$S"
  timeout 240 "$D/kestrel" bench -m "$M" --device cuda --prompts "bench/data/$2" -n 128 -r 1 \
    --speculative-config "$3" > "$OUT/$1.txt" 2>&1 || echo "FAILED rc=$?" | tee -a "$S"
  tail -12 "$OUT/$1.txt" | tee -a "$S"
}
# ROWS picks rows by label (all by default). k6_fixed: drafts of 6 tokens every step, the lookup
# matching 1 to 8 tokens (on the GPU a verify step of 1 + 6 costs about a one-token step).
K6_FIXED='{"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_min": 1, "prompt_lookup_max": 8, "draft_length": "fixed"}'
for r in ${ROWS-grounded_k4 grounded_k8 grounded_k6_fixed chat_k4 chat_k8 chat_k6_fixed}; do
  case $r in
    grounded_k4) row $r spec_grounded_prompts.jsonl '{"method": "ngram", "num_speculative_tokens": 4}' ;;
    grounded_k8) row $r spec_grounded_prompts.jsonl '{"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 3}' ;;
    grounded_k6_fixed) row $r spec_grounded_prompts.jsonl "$K6_FIXED" ;;
    chat_k4) row $r spec_chat_prompts.jsonl '{"method": "ngram", "num_speculative_tokens": 4}' ;;
    chat_k8) row $r spec_chat_prompts.jsonl '{"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 3}' ;;
    chat_k6_fixed) row $r spec_chat_prompts.jsonl "$K6_FIXED" ;;
    *) echo "unknown row $r" | tee -a "$S" ;;
  esac
done
