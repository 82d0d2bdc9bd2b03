#!/usr/bin/env bash
# Installs the Debian packages kestrel builds and tests with (skips those already installed).
set -euo pipefail
pkgs=(build-essential cmake ninja-build pkg-config git python3 python3-pip python3-venv
      libpcre2-dev libxxhash-dev nlohmann-json3-dev libcli11-dev libgtest-dev libgmock-dev libbenchmark-dev
      libboost1.81-dev clang libclang-rt-14-dev json-schema-test-suite)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install_deps: all packages present"
  exit 0
fi
sudo=""
[ "$(id -u)" -ne 0 ] && sudo="sudo"
echo "install_deps: installing ${missing[*]}"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}"
