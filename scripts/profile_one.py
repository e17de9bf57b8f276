"""One call per case, for a profiler: `ncu -k regex:norm python3 scripts/profile_one.py CASE...`.

A case is OP:N[:KNOBS], OP one of fwd, bwd, rms-fwd, rms-bwd; KNOBS a JSON
object of traits knobs (default: dispatch). bf16 rows, M * N = 2^26 elements.
Example: bwd:4097 'bwd:4096:{"warps_n": 8, "bytes_per_ldg": 8}'
"""
import json
import sys

import cupy
import numpy as np

import cunorm
from cunorm import dtypes

for case in sys.argv[1:]:
    op, n, *knobs = case.split(":", 2)
    n, knobs = int(n), (json.loads(knobs[0]) if knobs else None)
    m = 2**26 // n
    x = cupy.random.standard_normal((m, n), dtype=np.float32).astype(dtypes.BFLOAT16)
    w = cupy.random.standard_normal(n, dtype=np.float32).astype(dtypes.BFLOAT16)
    rms = op.startswith("rms-")
    fwd_knobs = knobs if not op.endswith("bwd") else None
    if rms:
        y, rstd = cunorm.rms_norm(x, w, return_stats=True, traits=fwd_knobs)
        if op.endswith("bwd"):
            cunorm.rms_norm_backward(y, x, rstd, w, traits=knobs)
    else:
        y, mean, rstd = cunorm.layer_norm(x, w, w, return_stats=True, traits=fwd_knobs)
        if op.endswith("bwd"):
            cunorm.layer_norm_backward(y, x, mean, rstd, w, traits=knobs)
    print(case, cunorm.explain({"fwd": "layer_norm", "bwd": "layer_norm_backward", "rms-fwd": "rms_norm",
                                "rms-bwd": "rms_norm_backward"}[op],
                               *((x, w) if op.endswith("fwd") else
                                 ((y, x, rstd, w) if rms else (y, x, mean, rstd, w))),
                               traits=knobs).traits.short(), file=sys.stderr)
cupy.cuda.Device().synchronize()
print("done", file=sys.stderr)
