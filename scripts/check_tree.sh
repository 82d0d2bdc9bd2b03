#!/usr/bin/env bash
# Tree rules checked in CI before anything is built:
#  - configuration is flags: getenv is called in src/core/env.cpp alone (the list of the variables
#    kestrel reads is that file's header);
#  - no source file is over 800 lines (split by responsibility instead);
#  - no code, script or doc records work history (issue numbers, work sessions, drafts): git log
#    keeps it.
set -euo pipefail
cd "$(dirname "$0")/.."
fail=0

sources=$(git ls-files 'src/*' 'tools/*' 'tests/*' 'bench/*' | grep -E '\.(c|cc|cpp|h|hpp|cu|cuh)$' || true)

getenv_hits=$(grep -nE '\bgetenv\s*\(' $sources | grep -v '^src/core/env\.cpp:' || true)
if [ -n "$getenv_hits" ]; then
  echo "check_tree: getenv outside src/core/env.cpp (add the variable to src/core/env.h, or make it a flag):"
  echo "$getenv_hits"
  fail=1
fi

long=$(for f in $sources; do n=$(wc -l <"$f"); [ "$n" -le 800 ] || echo "$f: $n lines"; done)
if [ -n "$long" ]; then
  echo "check_tree: source files over 800 lines:"
  echo "$long"
  fail=1
fi

texts=$(git ls-files | grep -E '\.(c|cc|cpp|h|hpp|cu|cuh|py|sh|md|txt|cmake)$|CMakeLists\.txt$' | grep -v '^tests/fuzz/corpus/' || true)
history=$(grep -niE '\bissue ?#?[0-9]+\b|\b(first|second|third|fourth|fifth|sixth|seventh|eighth|this|previous|last|next) session\b|\bfirst draft\b' $texts || true)
if [ -n "$history" ]; then
  echo "check_tree: work history in the tree (say why in the present tense; git log keeps history):"
  echo "$history"
  fail=1
fi

[ "$fail" = 0 ] && echo "check_tree: ok"
exit "$fail"
