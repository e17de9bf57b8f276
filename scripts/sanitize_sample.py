"""A sample of the GPU checks, small enough to run under compute-sanitizer.

Run with CuPy's memory pool off (set here, before any allocation): memcheck
misses out-of-bounds accesses that land inside a pool block.
"""
import dataclasses
import sys

import cupy

cupy.cuda.set_allocator(None)

from cunorm import check  # noqa: E402
from cunorm.norm.plans import FUSE_ROW_ELEMENTS  # noqa: E402

C = check.Case
CASES = [C(op, n, rows, dt, wdt, has_bias=not op.startswith("rms"), **kw)
         for op in check.NORM_OPS
         for n, rows, dt, wdt, kw in [
             (768, 37, "bfloat16", "bfloat16", {}), (1000, 5, "float16", "float32", {}),
             (4096, 3, "float32", "float32", {}), (12800, 3, "bfloat16", "float32", {}),
             (65536, 2, "bfloat16", "bfloat16", {}), (40, 9, "float32", "float32", {}),
             # the general kernel: odd sizes (masked tails, clusters), offset views, odd row strides, in place
             (7, 9, "bfloat16", "bfloat16", {}), (4097, 5, "bfloat16", "float32", {"residual_dtype": "float32"}),
             (65537, 2, "bfloat16", "bfloat16", {"zero_centered": True}),
             (1000, 5, "bfloat16", "bfloat16", {"layout": "offset:3", "residual_dtype": "bfloat16"}),
             (1000, 5, "float16", "float16", {"layout": "stride:+13", "weight_layout": "broadcast"}),
             (33, 7, "float32", "bfloat16", {"layout": "offset:1", "weight_layout": "strided"}),
             (4097, 4, "bfloat16", "bfloat16", {"in_place": True})]]
# Backwards of more than plans.FUSE_ROW_ELEMENTS elements take the two-launch path: its finalize kernel with 4
# lanes a column (1000, 2048; 999: FIN_VEC 1), 8 (4096) or 16 (8192; 4095: FIN_VEC 1; Traits.finalize_col_lanes),
# per-head weights and the parallel block's second weight.
BWD = ("layer_norm_backward", "rms_norm_backward")
FINALIZE_ROWS = 4200  # a multiple of 2 * heads
FINALIZED = [C(op, n, FINALIZE_ROWS, dt, wdt, has_bias=not op.startswith("rms"), **kw)
             for op in BWD
             for n, dt, wdt, kw in [
                 (1000, "bfloat16", "float32", {}), (2048, "bfloat16", "bfloat16", {}),
                 (4095, "float16", "float16", {"layout": "offset:1"}), (8192, "bfloat16", "float32", {}),
                 (1024, "bfloat16", "bfloat16", {"heads": 4, "per_head": True}),
                 (2048, "bfloat16", "bfloat16", {"x1_dtype": "bfloat16", "weight1_dtype": "float32",
                                                 "bias1_dtype": "bfloat16"}),
                 (999, "bfloat16", "bfloat16", {}), (4096, "float16", "float32", {})]]
assert all(c.rows * c.hidden_size > FUSE_ROW_ELEMENTS for c in FINALIZED)  # else they take one launch
CASES += FINALIZED
# Backwards with the next row loaded ahead into registers (register_ahead): the last row's load is past the end,
# on aligned rows, offset general rows and a cluster row.
AHEAD = dict(stages=1, register_ahead=True)
CASES += [C("layer_norm_backward", 2048, 301, "bfloat16", "bfloat16",
            knobs=tuple(sorted(dict(AHEAD, warps_n=4, bytes_per_ldg=16).items()))),
          C("rms_norm_backward", 4097, 37, "float16", "float32", has_bias=False, layout="offset:3",
            knobs=tuple(sorted(dict(AHEAD, warps_n=4, bytes_per_ldg=8).items()))),
          C("layer_norm_backward", 10240, 301, "bfloat16", "bfloat16",  # more rows than resident clusters
            knobs=tuple(sorted(dict(AHEAD, warps_n=4, ctas_per_row=4, bytes_per_ldg=8, smem_accumulators=True,
                                    register_sum_steps=1, pushed_exchange=True).items()))),
          # and the rows' statistics ahead too (stats_ahead): the last row's past the end, RMSNorm's rstd alone
          C("layer_norm_backward", 2048, 301, "bfloat16", "bfloat16",
            knobs=tuple(sorted(dict(AHEAD, stats_ahead=True, warps_n=4, bytes_per_ldg=16).items()))),
          C("rms_norm_backward", 4097, 37, "float16", "float32", has_bias=False, layout="offset:3",
            knobs=tuple(sorted(dict(AHEAD, stats_ahead=True, warps_n=4, bytes_per_ldg=8).items()))),
          C("layer_norm_backward", 10240, 301, "bfloat16", "bfloat16",
            knobs=tuple(sorted(dict(AHEAD, stats_ahead=True, warps_n=4, ctas_per_row=4, bytes_per_ldg=8,
                                    smem_accumulators=True, register_sum_steps=1, pushed_exchange=True).items())))]
# Every tensor's dtype and layout drawn independently (a slice of the pairwise sweep), at few rows.
CASES += [dataclasses.replace(c, rows=5) for c in check.pairwise_cases()[::17]]

bad = 0
for case in CASES:
    for r in check.run_case(case):
        print(f"{r.case.label():<100} {r.output:<12} {r.error:.2e} {'PASS' if r.ok else 'FAIL'}", flush=True)
        bad += not r.ok
print(f"{sum(1 for _ in CASES)} cases, {bad} failed outputs")
sys.exit(1 if bad else 0)
