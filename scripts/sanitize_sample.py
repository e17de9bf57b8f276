"""A sample of the GPU checks, small enough to run under compute-sanitizer.

Run with CuPy's memory pool off (set here, before any allocation): memcheck
misses out-of-bounds accesses that land inside a pool block.
"""
import sys

import cupy

cupy.cuda.set_allocator(None)

from cunorm import check  # noqa: E402

CASES = [check.Case(op, n, rows, dt, wdt)
         for op in ("layer_norm", "layer_norm_backward")
         for n, rows, dt, wdt in [(768, 37, "bfloat16", "bfloat16"), (1000, 5, "float16", "float32"),
                                  (4096, 3, "float32", "float32"), (12800, 3, "bfloat16", "float32"),
                                  (65536, 2, "bfloat16", "bfloat16"), (40, 9, "float32", "float32")]]

bad = 0
for case in CASES:
    for r in check.run_case(case):
        print(f"{r.case.label():<70} {r.output:<8} {r.error:.2e} {'PASS' if r.ok else 'FAIL'}", flush=True)
        bad += not r.ok
print(f"{sum(1 for _ in CASES)} cases, {bad} failed outputs")
sys.exit(1 if bad else 0)
