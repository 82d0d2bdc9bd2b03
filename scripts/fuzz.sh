#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz/fuzz_*.cpp; clang, ASan + UBSan, the "fuzz" CMake preset)
# and runs each for SECONDS from its seed corpus. Exits non-zero on the first finding: a crash, a
# sanitizer report, an input slower than 10 s, an allocation over the target's -malloc_limit_mb or
# the process over 2 GB; libFuzzer writes the input to BUILD/findings/TARGET-*.
#
#   scripts/fuzz.sh [SECONDS] [TARGET...]     # default 60 s each, every target
#
# Environment: KESTREL_FUZZ_BUILD (build folder, default build-fuzz). The corpus a run grows is kept
# in BUILD/corpus/TARGET (not in the repo), so repeated runs go on from where the last one stopped;
# seeds: tests/fuzz/corpus/NAME/ for fuzz_NAME and, for the file readers, the heads of the shared
# test models.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=${1:-60}
shift || true
build=${KESTREL_FUZZ_BUILD:-build-fuzz}
data=${KESTREL_DATA_DIR:-../shared/data}

if [ $# -gt 0 ]; then
  targets=("$@")
else
  targets=()
  for src in tests/fuzz/fuzz_*.cpp; do
    targets+=("$(basename "$src" .cpp)")
  done
fi

# Configured every time (cheap when nothing changed); the CUDA backend is not fuzzed. A folder
# already configured with KESTREL_FUZZ (the test command's sanitizer build, which also holds the
# tests) is used as it is.
if [ "$build" = build-fuzz ]; then
  cmake --preset fuzz -DKESTREL_CUDA=OFF >/dev/null
elif ! grep -q '^KESTREL_FUZZ:BOOL=ON' "$build/CMakeCache.txt" 2>/dev/null; then
  cmake --preset fuzz -B "$build" -DKESTREL_CUDA=OFF >/dev/null
fi
cmake --build "$build" -j "$(nproc)" --target "${targets[@]}"

# Seeds cut from real files: a seed longer than -max_len is truncated by libFuzzer anyway.
seed_head() {  # seed_head FILE BYTES DEST
  [ -f "$1" ] && head -c "$2" "$1" >"$3" || true
}

mkdir -p "$build/findings"
for t in "${targets[@]}"; do
  corpus="$build/corpus/$t"
  mkdir -p "$corpus"
  seeds="tests/fuzz/corpus/${t#fuzz_}"
  [ -d "$seeds" ] && cp -n "$seeds"/* "$corpus"/ 2>/dev/null || true
  flags=(-max_len=4096 -malloc_limit_mb=512)
  case "$t" in
    fuzz_gguf)
      flags=(-max_len=20000 -malloc_limit_mb=256)
      seed_head "$data/stories260K/stories260K.gguf" 20000 "$corpus/seed-stories260K"
      seed_head "$data/llama-2-tiny-random/llama-2-tiny-random.gguf" 20000 "$corpus/seed-tiny-random"
      ;;
    fuzz_safetensors)
      flags=(-max_len=4096 -malloc_limit_mb=256)
      for f in "$data"/hf-tiny/*/model.safetensors; do
        seed_head "$f" 4096 "$corpus/seed-$(basename "$(dirname "$f")")"
      done
      ;;
    fuzz_http_head) flags=(-max_len=16384 -malloc_limit_mb=256) ;;
    fuzz_openai_request) flags=(-max_len=4096 -malloc_limit_mb=512) ;;
  esac
  echo "== $t: ${seconds} s from $(find "$corpus" -type f | wc -l) inputs (${flags[*]})"
  # -timeout: one input slower than 10 s is a finding. -rss_limit_mb bounds the whole process.
  ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    "$build/tests/fuzz/$t" "${flags[@]}" -timeout=10 -rss_limit_mb=2048 -max_total_time="$seconds" \
    -print_final_stats=1 -artifact_prefix="$build/findings/$t-" "$corpus" 2>"$build/findings/$t.log" || {
    tail -60 "$build/findings/$t.log"
    echo "== $t: FINDING (input and log in $build/findings/)"
    exit 1
  }
  grep -E '^stat::(number_of_executed_units|average_exec_per_sec|peak_rss_mb)' "$build/findings/$t.log" | tr '\n' ' '
  echo
done
echo "== fuzzing: no finding in ${#targets[@]} targets x ${seconds} s"
