#!/usr/bin/env bash
# Accuracy of the quantized formats on the GPU in one device call (`kestrel perplexity`): for
# SmolLM2-135M-Instruct (Q4_1 GGUF) and Gemma 3 270M (Q4_K_M GGUF), over bench/data/kld_text.txt at
# -c 512 (6 chunks, 2,874 scored positions with either tokenizer):
#   cpu base         the CPU backend, default KV (f16): a base file, and its perplexity
#   cuda bf16        the CUDA backend as it uploads a GGUF (weights dequantized to bf16, bf16 KV):
#                    the base file of the rows below, and its KL from the CPU base
#   cuda -q fp8      FP8 E4M3 weights, per output row scales (W8A16 decode, W8A8 prefill)
#   cuda -q rtn      INT4 round-to-nearest, groups of 128, zero points (W4A16)
#   cuda fp8 KV      --kv-cache-dtype fp8
# Each row: mean KL (+/- its uncertainty), median / 99% / max KL, top-1 agreement, PPL; one JSON
# object per row in $OUT/kld.jsonl and the table in $OUT/summary.md (docs/performance.md's rows).
# usage: scripts/device/gpu_kld.sh DIR MODELS
#   DIR holds kestrel (plain or .xz; built with KESTREL_CUDA=ON), libpcre2-8.so.0 and libxxhash.so.0,
#   optionally kestrel_tests (its LoadQuantize and FP8 runner tests are run first);
#   MODELS the two GGUF files
#   (SmolLM2-135M-Instruct.Q4_1.gguf, gemma-3-270m-q4_k_m.gguf), or pieces of them named
#   NAME.part-* (split -b 60M, to carry them in calls of at most 64 MiB), joined here first.
set -uo pipefail
D=$(realpath "$1")
MD=$(realpath "$2")
cd "$(dirname "$0")/../.." || exit 1
OUT="${OUT:-/tmp/kestrel_kld}"
W=/tmp/kestrel_kld_work
mkdir -p "$OUT" "$W"
[ -f "$D/kestrel.xz" ] && xz -dkf "$D/kestrel.xz"
chmod +x "$D/kestrel"
export LD_LIBRARY_PATH="$D:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
K="$D/kestrel"
TEXT=bench/data/kld_text.txt
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"

# The GPU tests of quantization at load, when DIR holds kestrel_tests too.
[ -f "$D/kestrel_tests.xz" ] && xz -dkf "$D/kestrel_tests.xz"
if [ -f "$D/kestrel_tests" ]; then
  chmod +x "$D/kestrel_tests"
  timeout 120 "$D/kestrel_tests" --gtest_filter='LoadQuantize*:CudaModelRunner.Fp8*' 2>&1 |
    grep -E "^\[  (PASSED|FAILED|  OK|SKIPPED)|Failure|Expected|cuda |cpu " | tee "$OUT/tests.txt" | tail -20
fi

model_file() {  # NAME: the GGUF, joined from its pieces when only those are there
  local f="$MD/$1"
  if [ ! -f "$f" ] && ls "$f".part-* >/dev/null 2>&1; then
    cat "$f".part-* > "$W/$1" && f="$W/$1"
  fi
  echo "$f"
}

: > "$OUT/kld.jsonl"
{
  echo "| model | run | mean KL | median KL | 99% KL | max KL | top-1 | PPL | base PPL |"
  echo "|---|---|---|---|---|---|---|---|---|"
} > "$OUT/summary.md"

# row MODEL LABEL BASE ARGS...: kestrel perplexity --kl-divergence against BASE with ARGS.
row() {
  local name=$1 label=$2 base=$3
  shift 3
  local log="$OUT/${name}_${label// /_}.txt"
  if ! timeout 300 "$K" perplexity -m "$M" -c 512 --kl-divergence-base "$base" --kl-divergence --json "$@" \
      > "$log" 2> "$log.err"; then
    echo "$name $label FAILED: $(tail -2 "$log.err")" | tee -a "$OUT/summary.md"
    return
  fi
  python3 - "$name" "$label" "$log" <<'PY' | tee -a "$OUT/summary.md"
import json, sys
name, label, path = sys.argv[1:4]
r = json.load(open(path))
r.update(model=name, run=label)
open(sys.argv[3] + ".row", "w").write(json.dumps(r))
print(f"| {name} | {label} | {r['kl_mean']:.5f} ± {r['kl_mean_unc']:.5f} | {r['kl_median']:.5f} | {r['kl_p99']:.4f} "
      f"| {r['kl_max']:.4f} | {100 * r['top1']:.2f} ± {100 * r['top1_unc']:.2f} % | {r['ppl']:.3f} | {r['base_ppl']:.3f} |")
PY
  cat "$log.row" >> "$OUT/kld.jsonl" && echo >> "$OUT/kld.jsonl"
}

for name in smollm2 gemma3; do
  if [ $name = smollm2 ]; then M=$(model_file SmolLM2-135M-Instruct.Q4_1.gguf); else M=$(model_file gemma-3-270m-q4_k_m.gguf); fi
  [ -f "$M" ] || { echo "$name: no model file in $MD" | tee -a "$OUT/summary.md"; continue; }
  echo "== $name: base files (cpu, cuda bf16)"
  t0=$(date +%s)
  timeout 300 "$K" perplexity -m "$M" -f "$TEXT" -c 512 --kl-divergence-base "$W/$name.cpu.base" > "$OUT/${name}_cpu_base.txt" 2>&1 ||
    tail -3 "$OUT/${name}_cpu_base.txt"
  timeout 300 "$K" perplexity -m "$M" -f "$TEXT" -c 512 --device cuda --kl-divergence-base "$W/$name.cuda.base" \
    > "$OUT/${name}_cuda_base.txt" 2>&1 || tail -3 "$OUT/${name}_cuda_base.txt"
  echo "   base files in $(( $(date +%s) - t0 )) s"
  row $name "cuda bf16 vs cpu" "$W/$name.cpu.base" --device cuda
  row $name "cuda -q fp8" "$W/$name.cuda.base" --device cuda -q fp8
  row $name "cuda -q rtn" "$W/$name.cuda.base" --device cuda -q rtn
  row $name "cuda fp8 KV" "$W/$name.cuda.base" --device cuda --kv-cache-dtype fp8
  rm -f "$W/$name".*.base
done
echo "== summary"
cat "$OUT/summary.md"
