"""One call per case, for a profiler: `ncu -k regex:norm python3 scripts/profile_one.py CASE...`.

A case is OP:N[:KNOBS], OP one of fwd, bwd, rms-fwd, rms-bwd; KNOBS a JSON
object of traits knobs (default: dispatch). bf16 rows, M * N = 2^26 elements.
Example: bwd:4097 'bwd:4096:{"warps_n": 8, "bytes_per_ldg": 8}'
--source FILE: an edited copy of kernels/norm_fwd.cu or norm_bwd.cu for every case (the other direction's
calls then take the shipped file); scripts/ncu_sass.py reads the report's source page.
"""
import argparse
import json
import sys

import cupy
import numpy as np

import cunorm
from cunorm import dtypes
from cunorm.bench import served_directions

parser = argparse.ArgumentParser()
parser.add_argument("--source", help="an edited kernels/norm_fwd.cu or norm_bwd.cu")
parser.add_argument("cases", nargs="+", metavar="CASE")
args = parser.parse_args()
edited = open(args.source).read() if args.source else None
served = served_directions(edited) if edited else ()


def source_for(direction: str):
    """The edited file for the calls of the direction it defines, else None (the shipped file)."""
    return edited if direction in served else None


for case in args.cases:
    op, n, *knobs = case.split(":", 2)
    n, knobs = int(n), (json.loads(knobs[0]) if knobs else None)
    m = 2**26 // n
    x = cupy.random.standard_normal((m, n), dtype=np.float32).astype(dtypes.BFLOAT16)
    w = cupy.random.standard_normal(n, dtype=np.float32).astype(dtypes.BFLOAT16)
    rms = op.startswith("rms-")
    fwd_knobs = knobs if not op.endswith("bwd") else None
    if rms:
        y, rstd = cunorm.rms_norm(x, w, return_stats=True, traits=fwd_knobs, source=source_for("fwd"))
        if op.endswith("bwd"):
            cunorm.rms_norm_backward(y, x, rstd, w, traits=knobs, source=source_for("bwd"))
    else:
        y, mean, rstd = cunorm.layer_norm(x, w, w, return_stats=True, traits=fwd_knobs, source=source_for("fwd"))
        if op.endswith("bwd"):
            cunorm.layer_norm_backward(y, x, mean, rstd, w, traits=knobs, source=source_for("bwd"))
    print(case, cunorm.explain({"fwd": "layer_norm", "bwd": "layer_norm_backward", "rms-fwd": "rms_norm",
                                "rms-bwd": "rms_norm_backward"}[op],
                               *((x, w) if op.endswith("fwd") else
                                 ((y, x, rstd, w) if rms else (y, x, mean, rstd, w))),
                               traits=knobs, source=source_for("bwd" if op.endswith("bwd") else "fwd")
                               ).traits.short(), file=sys.stderr)
cupy.cuda.Device().synchronize()
print("done", file=sys.stderr)
