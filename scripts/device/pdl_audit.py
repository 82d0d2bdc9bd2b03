#!/usr/bin/env python3
"""PDL audit of the CUDA kernels' SASS (needs cuobjdump and nvdisasm: the CUDA toolkit's, or NVIDIA's
nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm wheels, as scripts/test.sh installs them; no GPU).

Every kernel of src/backend/cuda is launched with programmatic dependent launch and must not load
the previous kernel's output before griddepcontrol.wait (SASS: ACQBULK). ptxas may schedule a
load on the read-only path (LDG...CONSTANT, which const __restrict__ dereferences become) above
the wait; under PDL that reads stale data (it did in stream_gemv, 2026-11-30). For each kernel in
the given files (the kestrel binary, a .so or cubins), this lists the global loads that come
before the first ACQBULK in program order and fails (exit 1) on:
  - a kernel with no ACQBULK at all;
  - a read-only-path load before it that the compiler made (LDG...CONSTANT without .NA): the
    loads the code places there on purpose are the weight streams (ld_stream16, which asks for
    no L1 allocation: LDG.E.NA...CONSTANT; cp.async: LDGSTS) and the decode attention kernel's
    metadata (plain LDG.E of arrays uploaded before the pass).
Limit: "before" is in address order up to the first ACQBULK, so a load on a branch placed after
an early-exit path's wait is not seen.

usage: pdl_audit.py FILE... [--list]
"""
import re
import shutil
import subprocess
import sys


def main():
    files = [a for a in sys.argv[1:] if not a.startswith("--")]
    show_all = "--list" in sys.argv
    tool = shutil.which("cuobjdump") or "/usr/local/cuda/bin/cuobjdump"
    filt = shutil.which("cu++filt")
    n_kernels, bad = 0, []
    for path in files:
        sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True, check=True).stdout
        for block in re.split(r"\n\s*Function : ", sass)[1:]:
            name = block.split("\n", 1)[0].strip()
            if "kestrel" not in name:
                continue  # library kernels (none today) are not ours to audit
            n_kernels += 1
            if filt:
                name = subprocess.run([filt, name], capture_output=True, text=True).stdout.strip()
            before, waited = [], False
            for line in block.split("\n"):
                m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
                if not m:
                    continue
                op = m.group(2)
                if op.startswith("ACQBULK"):
                    waited = True
                    break
                if (op.startswith("LDG") and not op.startswith("LDGDEPBAR")) or op.startswith("LD."):
                    before.append(op)
            short = re.sub(r"\(.*", "", name)[:140]
            hazards = [op for op in before if "CONSTANT" in op and ".NA" not in op]
            if not waited:
                bad.append(f"no griddepcontrol.wait: {short}")
            elif hazards:
                bad.append(f"{len(hazards)} read-only load(s) before the wait ({' '.join(sorted(set(hazards)))}): {short}")
            if show_all:
                kinds = " ".join(sorted(set(before))) if before else "-"
                print(f"{'NO WAIT' if not waited else len(before):>7} before | {short} | {kinds}")
    for b in bad:
        print("PDL AUDIT FAIL:", b)
    print(f"PDL audit: {n_kernels} kernels, {len(bad)} failing: {'FAIL' if bad else 'PASS'}")
    return 1 if bad or n_kernels == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
