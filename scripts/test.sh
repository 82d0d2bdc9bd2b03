#!/usr/bin/env bash
# Runs every test: the C++ unit/golden/e2e tests (CTest), the comparison of the default model's
# logits with an independent float64 reference (Python, numpy), and the unit tests again under
# AddressSanitizer + UndefinedBehaviorSanitizer. Installs what is missing first (packages, the
# default model, a Python venv for the reference), so it works on a fresh clone.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/install_deps.sh
scripts/fetch_model.sh
scripts/build.sh

echo "== CTest (Release)"
ctest --test-dir build --output-on-failure -j "$(nproc)"

echo "== logits against the float64 reference"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check numpy==2.1.3 gguf==0.17.1
.venv/bin/python tests/reference/check_logits.py --kestrel build/kestrel \
  --model models/SmolLM2-135M-Instruct.Q4_1.gguf
.venv/bin/python tests/reference/check_stories.py

echo "== ASan + UBSan"
if [ ! -f build-asan/CMakeCache.txt ]; then
  gen=()
  command -v ninja >/dev/null && gen=(-G Ninja)
  cmake -S . -B build-asan "${gen[@]}" -DCMAKE_BUILD_TYPE=Debug -DKESTREL_SANITIZE=ON -DKESTREL_BENCH=OFF
fi
cmake --build build-asan -j "$(nproc)"
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir build-asan --output-on-failure -j "$(nproc)" -LE slow
echo "== all tests passed"
