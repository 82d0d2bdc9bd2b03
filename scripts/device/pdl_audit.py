#!/usr/bin/env python3
"""PDL audit of the CUDA kernels' SASS (device machine: needs cuobjdump).

Every kernel of src/backend/cuda waits (griddepcontrol.wait, SASS ACQBULK) before it reads what the
previous kernel wrote. ptxas may schedule a load above the wait when it is on the read-only path
(LDG...CONSTANT, from const __restrict__ pointers), which then reads stale data under PDL. This
prints, for each kernel in the given cubins, the global loads that come before its first ACQBULK
in program order (cp.async LDGSTS too), and kernels with no ACQBULK at all, for a person to check
against the rule: before the wait, only weights and arrays uploaded before the pass.

usage: pdl_audit.py CUBIN...
"""
import re
import shutil
import subprocess
import sys


def main():
    tool = shutil.which("cuobjdump") or "/usr/local/cuda/bin/cuobjdump"
    filt = shutil.which("cu++filt")
    for path in sys.argv[1:]:
        sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True, check=True).stdout
        for block in re.split(r"\n\s*Function : ", sass)[1:]:
            name = block.split("\n", 1)[0].strip()
            if filt:
                name = subprocess.run([filt, name], capture_output=True, text=True).stdout.strip()
            before, waited = [], False
            for line in block.split("\n"):
                m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*)", line)
                if not m:
                    continue
                op = m.group(2)
                if op.startswith("ACQBULK"):
                    waited = True
                    break
                if op.startswith(("LDG", "LD.", "LDGSTS", "ULDG")):
                    before.append(op + m.group(3).split(";")[0])
            short = name[:150]
            if not waited:
                print(f"NO WAIT   {short}")
            elif before:
                kinds = sorted(set(b.split()[0] for b in before))
                print(f"{len(before):3d} before {short}: {' '.join(kinds)}")
            else:
                print(f"  0 before {short}")


if __name__ == "__main__":
    main()
