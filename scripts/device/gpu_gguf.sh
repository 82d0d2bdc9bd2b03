#!/usr/bin/env bash
# GGUF blocks in place on the GPU (--cuda-gguf-weights in-place) against the bf16 upload, in one
# device call:
#   tests   kestrel_tests CudaGguf* (every type's GEMV, dequantization and embedding against the
#           CPU dequantizer in float64; the tiny all-types model and SmolLM2 Q4_1 in place vs bf16)
#   kbench  kestrel_cuda_bench gguf: the decode GEMV per type at 1 and 8 tokens beside the bf16
#           skinny GEMM, GB/s and % of the H200's 4.28 TB/s
#   decode  kestrel bench (batch 1, -p 128 -n 256) for SmolLM2-135M-Instruct Q4_1 and Gemma 3 270M
#           Q4_K_M, bf16 vs in-place: tok/s and the weights' device bytes (the runner's description)
#   KL      kestrel perplexity --kl-divergence of in-place against the bf16 upload's base file
#           (bench/data/kld_text.txt, -c 512), as gpu_kld.sh
# usage: scripts/device/gpu_gguf.sh DIR MODELS
#   DIR holds kestrel, kestrel_tests, kestrel_cuda_bench (plain or .xz; KESTREL_CUDA=ON, the bench
#   with KESTREL_BENCH=ON), libpcre2-8.so.0 and libxxhash.so.0; MODELS the two GGUF files
#   (SmolLM2-135M-Instruct.Q4_1.gguf, gemma-3-270m-q4_k_m.gguf) or their NAME.part-* pieces.
#   Results in $OUT (summary.md).
set -uo pipefail
D=$(realpath "$1")
MD=$(realpath "$2")
cd "$(dirname "$0")/../.." || exit 1
OUT="${OUT:-/tmp/kestrel_gguf}"
W=/tmp/kestrel_gguf_work
mkdir -p "$OUT" "$W"
for f in kestrel kestrel_tests kestrel_cuda_bench; do
  [ -f "$D/$f.xz" ] && xz -dkf "$D/$f.xz"
  [ -f "$D/$f" ] && chmod +x "$D/$f"
done
cublas_dir=$(python3 -c 'import nvidia.cublas as m; print(list(m.__path__)[0] + "/lib")' 2>/dev/null || true)
export LD_LIBRARY_PATH="$D:/usr/local/cuda/lib64:${cublas_dir}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export KESTREL_MODEL_DIR="$W"
K="$D/kestrel"
S="$OUT/summary.md"
: > "$S"
note() { echo "$*" | tee -a "$S"; }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader | tee -a "$S"

model_file() {  # NAME: the GGUF in $W, joined from its pieces when only those are there
  if [ -f "$MD/$1" ]; then ln -sf "$MD/$1" "$W/$1"; elif ls "$MD/$1".part-* >/dev/null 2>&1; then
    cat "$MD/$1".part-* > "$W/$1"; fi
  echo "$W/$1"
}
SMOL=$(model_file SmolLM2-135M-Instruct.Q4_1.gguf)
GEMMA=$(model_file gemma-3-270m-q4_k_m.gguf)

echo "== GPU tests"
if [ -f "$D/kestrel_tests" ]; then
  timeout 300 "$D/kestrel_tests" --gtest_filter='CudaGguf*' 2>&1 |
    grep -E "^\[  (PASSED|FAILED|  OK|SKIPPED)|Failure|Expected|Which is|worst|vs bf16" | tee "$OUT/tests.txt" | tail -30
  note "tests: $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/tests.txt" | tr '\n' ' ')"
fi
[ -f scripts/device/pdl_audit.py ] && note "pdl audit: $(python3 scripts/device/pdl_audit.py "$K" 2>&1 | tail -3 | tr '\n' ' ')"

echo "== kestrel_cuda_bench gguf"
if [ -f "$D/kestrel_cuda_bench" ]; then
  timeout 300 "$D/kestrel_cuda_bench" gguf 2>&1 | tee "$OUT/kbench.txt"
  note ""
  note "| kernel | shape | us | GB/s | % of 4.28 TB/s |"
  note "|---|---|---|---|---|"
  awk '/GB\/s/ { for (i = 1; i <= NF; ++i) if ($i == "us") us = $(i-1); else if ($i == "GB/s") gb = $(i-1);
       printf "| %s %s | %s %s | %s | %s | %.0f%% |\n", $1, $2, $3, $4, us, gb, gb / 42.8 }' "$OUT/kbench.txt" |
    sed 's/| skinny bf16 \([^ ]*\) \([^ ]*\) |/| skinny bf16 | \1 \2 |/' | tee -a "$S"
fi

note ""
note "| model | weights | pp128 tok/s | tg256 tok/s | device weights |"
note "|---|---|---|---|---|"
for M in "$SMOL" "$GEMMA"; do
  [ -f "$M" ] || { note "| $(basename "$M") | missing | | | |"; continue; }
  for mode in bf16 in-place; do
    log="$OUT/$(basename "$M" .gguf)_${mode}_bench.txt"
    timeout 200 "$K" bench -m "$M" --device cuda --cuda-gguf-weights $mode -p 128 -n 256 -r 3 > "$log" 2>&1
    desc=$(grep -o "weights [0-9]* KiB" "$log" | head -1)
    pp=$(grep "| pp" "$log" | tail -1 | awk -F'|' '{print $(NF-1)}')
    tg=$(grep "| tg" "$log" | tail -1 | awk -F'|' '{print $(NF-1)}')
    note "| $(basename "$M") | $mode | $pp | $tg | $desc |"
  done
done

note ""
note "| model | run | mean KL | median KL | 99% KL | max KL | top-1 | PPL | base PPL |"
note "|---|---|---|---|---|---|---|---|---|"
TEXT=bench/data/kld_text.txt
for M in "$SMOL" "$GEMMA"; do
  [ -f "$M" ] || continue
  name=$(basename "$M" .gguf)
  timeout 300 "$K" perplexity -m "$M" -f "$TEXT" -c 512 --device cuda --kl-divergence-base "$W/$name.base" \
    > "$OUT/${name}_base.txt" 2>&1 || tail -3 "$OUT/${name}_base.txt"
  for mode in in-place bf16; do  # bf16 against its own base: the run-to-run floor
    log="$OUT/${name}_kl_${mode}.json"
    if ! timeout 300 "$K" perplexity -m "$M" -c 512 --device cuda --cuda-gguf-weights $mode \
        --kl-divergence-base "$W/$name.base" --kl-divergence --json > "$log" 2> "$log.err"; then
      note "| $name | $mode | FAILED: $(tail -1 "$log.err") |"; continue
    fi
    python3 - "$name" "$mode" "$log" <<'PY' | tee -a "$S"
import json, sys
name, label, path = sys.argv[1:4]
r = json.load(open(path))
print(f"| {name} | {label} vs cuda bf16 | {r['kl_mean']:.6f} ± {r['kl_mean_unc']:.6f} | {r['kl_median']:.6f} | {r['kl_p99']:.5f} "
      f"| {r['kl_max']:.5f} | {100 * r['top1']:.2f} % | {r['ppl']:.4f} | {r['base_ppl']:.4f} |")
PY
  done
  rm -f "$W/$name.base"
done
echo "== summary"
cat "$S"
