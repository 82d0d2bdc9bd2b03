#!/usr/bin/env python3
"""Cross-checks llama_ref.dequantize against gguf.quants for every format it supports.

The models on hand only contain F32, Q8_0 and Q4_1, so random data is quantized with
gguf.quants.quantize (F16, Q4_0, Q4_1, Q8_0; F32 trivially) and both dequantizations are
compared. gguf computes in float32, llama_ref in float64: they must agree to float32 rounding.
Exits 1 on a mismatch, 77 (ctest's "skipped") without numpy or gguf.
"""

from __future__ import annotations

import os
import sys

try:
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from llama_ref import dequantize
except ImportError as e:  # pip install numpy gguf
    print(f"skipped: {e}", file=sys.stderr)
    sys.exit(77)


def main() -> int:
    rng = np.random.default_rng(0)
    data = (rng.standard_normal((8, 256)) * rng.uniform(0.01, 3.0, (8, 1))).astype(np.float32)
    failed = 0
    for qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.Q4_0,
                  GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0):
        packed = quants.quantize(data, qtype)
        theirs = np.asarray(quants.dequantize(packed, qtype), dtype=np.float64).reshape(-1)
        mine = dequantize(packed, int(qtype), data.size)
        ok = np.allclose(mine, theirs, rtol=1e-6, atol=1e-7)
        # And the quantization error itself is what the format allows (a sanity bound).
        err = float(np.max(np.abs(mine - data.reshape(-1)) / np.abs(data).max()))
        print(f"{'ok  ' if ok else 'FAIL'} {qtype.name:5s} max |mine - gguf| "
              f"{np.max(np.abs(mine - theirs)):.2e}, quantization error {err:.3f} of max |x|")
        failed += not ok
    print(f"{'FAILED' if failed else 'PASSED'}: {failed} failure(s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
