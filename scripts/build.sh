#!/usr/bin/env bash
# Configures and builds kestrel (Release) into build/. Extra CMake arguments: $KESTREL_CMAKE_ARGS.
set -euo pipefail
cd "$(dirname "$0")/.."
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
# shellcheck disable=SC2086
cmake -S . -B build "${gen[@]}" -DCMAKE_BUILD_TYPE=Release ${KESTREL_CMAKE_ARGS:-} >/dev/null
cmake --build build -j "$(nproc)"
