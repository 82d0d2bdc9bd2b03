# Sourced by the GPU device scripts: environment for the kestrel build carried in devbin/
# (built on the CPU machine; see gpu_bench_8b.sh), and the paths shared between the calls of one warm
# machine (/tmp survives from one call to the next while the machine is held).
OUT="${OUT:-/tmp/kestrel_out}"
mkdir -p "$OUT" /tmp/kestrel
# devbin/ travels with call 1 only; the later calls use the copy call 1 left in /tmp/kestrel.
if [ -x devbin/kestrel ] || [ -f devbin/kestrel.xz ]; then
  rm -rf /tmp/kestrel/devbin && cp -r devbin /tmp/kestrel/devbin
fi
BIN=/tmp/kestrel/devbin
for z in $BIN/*.xz; do
  [ -f "$z" ] && [ ! -f "${z%.xz}" ] && xz -dkf "$z"
done
cublas_dir=$(python3 -c 'import nvidia.cublas as m; print(list(m.__path__)[0] + "/lib")' 2>/dev/null || true)
export LD_LIBRARY_PATH="$BIN:/usr/local/cuda/lib64:${cublas_dir}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONUNBUFFERED=1
chmod +x $BIN/kestrel $BIN/kestrel_tests $BIN/kestrel_cuda_bench $BIN/kestrel_grammar_bench 2>/dev/null
K="$BIN/${KBIN:-kestrel}"  # KBIN: another carried binary (e.g. kestrel_before)
# The op tests that need stories260K find the carried copy here.
if [ -f $BIN/stories260K.gguf ]; then
  mkdir -p /tmp/kestrel/data/stories260K && ln -sf $BIN/stories260K.gguf /tmp/kestrel/data/stories260K/
  export KESTREL_DATA_DIR="${KESTREL_DATA_DIR:-/tmp/kestrel/data}"
fi
M8=/tmp/kestrel/llama8b     # Llama-3.1-8B-shaped random bf16 model (made by gpu_bench_8b.sh)
SUMMARY=/tmp/kestrel/summary.txt
# note KEY VALUE: one line of the closing table
note() { echo "$*" | tee -a "$SUMMARY"; }
# kernel_trace_run NAME "TABLE_ARGS" BENCH_ARGS...: `kestrel bench --device cuda --load-format dummy
# BENCH_ARGS` on a kernel timeline (tools/kernel_trace, when libkestrel_kernel_trace.so was
# carried): the per-kernel table (kernel_trace.py TABLE_ARGS) into $OUT/trace_NAME.txt, the raw
# records into $OUT/trace_NAME.csv.gz.
kernel_trace_run() {
  local name=$1 table_args=$2
  shift 2
  [ -f $BIN/libkestrel_kernel_trace.so ] || return 0
  local dir=/tmp/kestrel/trace_$name
  mkdir -p "$dir"
  (cd "$dir" && CUDA_INJECTION64_PATH=$BIN/libkestrel_kernel_trace.so timeout 200 $K bench --device cuda \
    --load-format dummy "$@") > "$OUT/trace_$name.log" 2>&1
  # shellcheck disable=SC2086
  python3 scripts/device/kernel_trace.py "$dir/kernel_trace.csv" $table_args 2>&1 | head -40 | tee "$OUT/trace_$name.txt"
  gzip -c "$dir/kernel_trace.csv" > "$OUT/trace_$name.csv.gz"
}
# The batch-1 FP8 decode graph of the Llama-3.1-8B shape (random weights) on a kernel timeline.
trace_b1_fp8() {
  kernel_trace_run b1 "--skip 40" -m "$PWD/scripts/device/configs/llama-3.1-8b" --quantization fp8 -r 1 -p 128 -n 128
}
# stories260K greedy from "Once upon a time", 32 tokens, --device cpu against --device cuda; one
# PASS/FAIL line into the summary.
stories_check() {
  echo "== stories260K: greedy, CPU vs CUDA, 32 tokens"
  for dev in cpu cuda; do
    timeout 60 "$K" generate -m $BIN/stories260K.gguf -p "Once upon a time" -n 32 --temperature 0 --json \
      --device $dev > /tmp/kestrel/stories_$dev.json 2>/tmp/kestrel/stories_$dev.err || tail -3 /tmp/kestrel/stories_$dev.err
  done
  python3 - <<'PY' | tee -a "$SUMMARY"
import json
a = json.load(open("/tmp/kestrel/stories_cpu.json"))["output_ids"]
b = json.load(open("/tmp/kestrel/stories_cuda.json"))["output_ids"]
n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
print(f"stories260K greedy: cpu == cuda for the first {n} of {len(a)} tokens", "PASS" if n >= 32 else "FAIL")
PY
}
# The GPU op tests (kestrel_tests, Cuda*), the stories260K check and the PDL audit of the kernels'
# SASS, with their summary lines.
op_tests() {
  echo "== GPU op tests (kestrel_tests, Cuda*)"
  timeout 300 $BIN/kestrel_tests --gtest_filter="${TEST_FILTER:-Cuda*}" --gtest_brief=1 2>&1 | tail -15 | tee /tmp/kestrel/tests.txt
  note "op tests: $(grep -E '^\[  (PASSED|FAILED) ' /tmp/kestrel/tests.txt | tr '\n' ' ')"
  stories_check
  # No kernel may load the previous kernel's output before griddepcontrol.wait (pdl_audit.py).
  note "$(python3 scripts/device/pdl_audit.py $BIN/kestrel 2>&1 | tail -4 | tr '\n' ' ')"
}
# A configuration of a sweep: kestrel flags joined by commas, or "defaults" (none).
cfg_flags() { [ "$1" = defaults ] || echo "${1//,/ }"; }
# The start of a staged script: an empty summary, the GPU named, the bench binary executable.
begin_run() {
  : > "$SUMMARY"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
  chmod +x $BIN/kestrel_cuda_bench 2>/dev/null
}
