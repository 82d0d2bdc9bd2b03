#!/usr/bin/env bash
# Runs every test: the C++ unit/golden/e2e tests and the Python reference checks (CTest), then the
# C++ tests again under AddressSanitizer + UndefinedBehaviorSanitizer (clang). Installs what is missing
# first (packages, the default model and Gemma 3 270M, a Python venv with numpy + gguf for the float64 reference,
# safetensors for the Hugging Face folder checks, pytest + requests + openai + lm_eval for the server
# tests), so it works on a fresh clone. Last, the libFuzzer targets of the sanitizer build run for a
# bounded time.
# First of all, the tree rules (scripts/check_tree.sh: getenv in one file, file sizes, no work
# history).
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/check_tree.sh

scripts/install_deps.sh
scripts/fetch_model.sh
scripts/fetch_model.sh gemma3-270m  # the second real model: Gemma 3's greedy transcripts
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check numpy==2.1.3 gguf==0.17.1 safetensors==0.6.2 \
  pytest==8.4.2 requests==2.32.5 jsonschema==4.25.1 rfc3339-validator==0.1.4 openai==3.57.0 "lm_eval[api]==0.4.13"
export KESTREL_REQUIRE_REFERENCE=1  # a missing reference piece fails instead of skipping
KESTREL_CMAKE_ARGS="-DPython3_EXECUTABLE=$PWD/.venv/bin/python" scripts/build.sh

echo "== CTest (Release)"
ctest --test-dir build --output-on-failure -j "$(nproc)"

if grep -q '^KESTREL_CUDA:BOOL=ON' build/CMakeCache.txt; then
  echo "== PDL audit of the CUDA kernels' SASS (scripts/device/pdl_audit.py)"
  # cuobjdump and nvdisasm from NVIDIA's wheels (the Debian toolkit install lacks them): every
  # kernel must wait (griddepcontrol.wait) before it loads what the previous kernel wrote.
  .venv/bin/python -m pip install --quiet --disable-pip-version-check nvidia-cuda-cuobjdump==13.5.37 \
    nvidia-cuda-nvdisasm==13.5.37
  nv_bin="$(.venv/bin/python -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13", "bin"))')"
  PATH="$nv_bin:$PATH" .venv/bin/python scripts/device/pdl_audit.py build/kestrel
fi

echo "== CTest under ASan + UBSan (clang), then the libFuzzer targets of the same build"
# One sanitizer build serves both: clang with AddressSanitizer, UndefinedBehaviorSanitizer and
# libFuzzer's coverage instrumentation, at -O1 -g1 (line tables for the reports; half the compile
# time of -O2 -g). The CUDA backend is left out (nvcc code is not instrumented, and its tests and its
# CPU emulation already ran in the Release build). Configured every time, so an older tree gets new
# options too.
gen=()
[ -f build-san/CMakeCache.txt ] || { command -v ninja >/dev/null && gen=(-G Ninja); }
cmake -S . -B build-san "${gen[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_COMPILER=clang \
  -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" -DKESTREL_SANITIZE=ON -DKESTREL_FUZZ=ON \
  -DKESTREL_CUDA=OFF -DKESTREL_BENCH=OFF -DPython3_EXECUTABLE="$PWD/.venv/bin/python" >/dev/null
cmake --build build-san -j "$(nproc)"
# Left out there: the Python reference checks and the sampled-distribution tests (statistics over
# many draws, 4x their Release time instrumented, nothing a sanitizer adds to).
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir build-san --output-on-failure -j "$(nproc)" -E '^(reference_check|SpecDistribution\.)'

echo "== libFuzzer targets (the sanitizer build), 60 s each"
KESTREL_FUZZ_BUILD=build-san scripts/fuzz.sh 60
echo "== all tests passed"
