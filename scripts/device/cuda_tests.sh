#!/usr/bin/env bash
# Builds the CUDA kernels and their op tests alone and runs them on this machine's GPU, ending with
# a pass/fail table. For the GPU machine, which has nvcc, cmake and ninja but none of the CPU
# build's -dev packages: the KESTREL_CUDA_OPS_ONLY configuration needs no PCRE2, nlohmann-json,
# CLI11 or xxhash, and uses GoogleTest when it is installed, else tests/backend/mini_gtest.
#
# From the repository root:
#   scripts/device/cuda_tests.sh                   build (build-cuda-ops/) and run every op test
#   scripts/device/cuda_tests.sh 'CudaPaged*'      only the tests matching a gtest filter
#   KESTREL_CUDA_SANITIZE=1 scripts/device/...     also run the tests under compute-sanitizer
#                                                  (memcheck; racecheck and synccheck on attention)
#   KESTREL_CUDA_REPORT=1 scripts/device/...       also print ptxas register/spill use and the
#                                                  SASS instruction mix of the attention kernels
#   KESTREL_CUDA_BENCH=1 scripts/device/...        also time the ops (bench/cuda/bench_cuda_ops.cpp)
# Logs go to $OUT (when set, as on the device tool) or build-cuda-ops/logs.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
filter="${1:-}"
build="build-cuda-ops"
logs="${OUT:-$build/logs}"
mkdir -p "$logs"

# nvcc where the CUDA image puts it, when it is not on PATH already.
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH="/usr/local/cuda/bin:$PATH"; fi

# cuBLASLt: the toolkit's, else the nvidia-cublas Python wheel's (found and put on the loader's
# path); without either the GEMM wrapper and its test are left out of the build.
cublas_args=()
if ! ls /usr/local/cuda/lib64/libcublasLt.so* >/dev/null 2>&1 && ! ls /usr/local/cuda/targets/*/lib/libcublasLt.so* >/dev/null 2>&1; then
  wheel=$(python3 -c 'import nvidia.cublas as m; print(list(m.__path__)[0])' 2>/dev/null || true)
  if [ -n "$wheel" ] && [ -d "$wheel/lib" ]; then
    cublas_args=("-DKESTREL_CUBLAS_ROOT=$wheel")
    export LD_LIBRARY_PATH="$wheel/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    echo "cuBLASLt from the Python wheel: $wheel"
  fi
fi

echo "== device"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -4
nvcc --version | tail -2 | head -1
cmake --version | head -1

echo "== build ($build)"
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
t0=$(date +%s)
if ! cmake -S . -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DKESTREL_CUDA_OPS_ONLY=ON -DCMAKE_CUDA_COMPILER="$(command -v nvcc)" "${cublas_args[@]}" \
      >"$logs/configure.log" 2>&1; then
  tail -40 "$logs/configure.log"; echo "configure FAILED"; exit 1
fi
if ! cmake --build "$build" -j "$(nproc)" >"$logs/build.log" 2>&1; then
  grep -E "error|Error" "$logs/build.log" | head -40; echo "build FAILED"; exit 1
fi
echo "built in $(( $(date +%s) - t0 )) s"
bin="$build/tests/backend/kestrel_cuda_op_tests"

echo "== tests"
args=()
[ -n "$filter" ] && args=("--gtest_filter=$filter")
"$bin" "${args[@]}" 2>&1 | tee "$logs/tests.log"
rc=${PIPESTATUS[0]}

san_rc=0
if [ "${KESTREL_CUDA_SANITIZE:-0}" = 1 ]; then
  if command -v compute-sanitizer >/dev/null; then
    echo "== compute-sanitizer"
    for tool in memcheck racecheck synccheck; do
      f="$filter"
      [ "$tool" != memcheck ] && f="${filter:-CudaPagedAttention.*}"
      fa=()
      [ -n "$f" ] && fa=("--gtest_filter=$f")
      compute-sanitizer --tool "$tool" --error-exitcode 99 "$bin" "${fa[@]}" >"$logs/sanitize_$tool.log" 2>&1
      r=$?
      echo "$tool: exit $r ($(grep -cE '^\[       OK \]' "$logs/sanitize_$tool.log") tests OK; $(grep -m1 -E 'ERROR SUMMARY' "$logs/sanitize_$tool.log"))"
      [ $r -ne 0 ] && san_rc=$r
    done
  else
    echo "compute-sanitizer not found: sanitizer runs skipped"
  fi
fi

if [ "${KESTREL_CUDA_REPORT:-0}" = 1 ]; then
  echo "== resources (ptxas) and SASS mix of paged_attention.cu"
  nvcc -std=c++20 -O3 -gencode=arch=compute_90a,code=sm_90a -Isrc -Xptxas -v -c src/backend/cuda/paged_attention.cu \
    -o "$build/pa_report.o" 2>&1 | grep -E "Compiling entry|registers|spill" | sed 's/ptxas info *: //'
  if command -v cuobjdump >/dev/null; then
    cuobjdump -sass "$build/pa_report.o" | grep -oE '\b(HMMA|LDSM|LDGSTS|MUFU|LDL|STL|BAR)\b[.A-Z0-9]*' | sort | uniq -c
  fi
fi

if [ "${KESTREL_CUDA_BENCH:-0}" = 1 ]; then
  echo "== benchmarks (median of 20 after 5 warm-ups)"
  "$build/kestrel_cuda_bench" 2>&1 | tee "$logs/bench.log"
fi

echo "== summary"
printf '%-6s %-60s %s\n' RESULT TEST TIME
grep -E '^\[ +(OK|FAILED|SKIPPED) +\] .* \([0-9]+ ms\)$' "$logs/tests.log" |
  sed -E 's/^\[ +(OK|FAILED|SKIPPED) +\] ([^ ]+) \(([0-9]+) ms\)$/\1 \2 \3/' |
  while read -r res name ms; do
    case "$res" in OK) res=PASS ;; FAILED) res=FAIL ;; SKIPPED) res=SKIP ;; esac
    printf '%-6s %-60s %s ms\n' "$res" "$name" "$ms"
  done
n_pass=$(grep -cE '^\[       OK \]' "$logs/tests.log")
n_fail=$(grep -cE '^\[  FAILED  \] .* \([0-9]+ ms\)$' "$logs/tests.log")
n_skip=$(grep -cE '^\[  SKIPPED \] .* \([0-9]+ ms\)$' "$logs/tests.log")
echo "passed $n_pass, failed $n_fail, skipped $n_skip (test binary exit $rc)"
[ "$n_skip" -gt 0 ] && echo "note: skipped tests mean no usable GPU was found"
if [ "$rc" -ne 0 ] || [ "$san_rc" -ne 0 ]; then exit 1; fi
