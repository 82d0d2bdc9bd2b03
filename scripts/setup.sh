#!/usr/bin/env bash
# One command on a fresh Debian 12 machine: packages, the default model, the build, and a first
# chat answer from the model on the CPU. Re-running skips what is done.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
scripts/fetch_model.sh
scripts/build.sh
echo
echo '$ ./build/kestrel chat --temperature 0 -n 64 -p "What is the capital of France?"'
./build/kestrel chat --temperature 0 -n 64 -p "What is the capital of France?"
