"""Every kernel variant the checker knows, a few rows each, for compute-sanitizer.

The cases are `cunorm check`'s sweeps (every tuned entry and heuristic sample
of every op and dtype mix, the general kernel's odd sizes and layouts, the
flags, the pairwise draw of every tensor's dtype and layout) at 3 rows, so each
kernel runs every code path (full row groups and a partial one) in
milliseconds. Every case runs against the float64 reference as in `cunorm
check`. Kernels are compiled first, outside the sanitized launches' way.

    compute-sanitizer --tool memcheck --error-exitcode 99 python3 scripts/sanitize_sweep.py [--shard 0/4]

CuPy's memory pool is off (set before any allocation): memcheck misses
out-of-bounds accesses that land inside a pool block.
"""
import argparse
import collections
import dataclasses
import re
import sys
import time

import cupy
import numpy as np

cupy.cuda.set_allocator(None)

from cunorm import check  # noqa: E402


def sweep_cases(rows: int = 3) -> list:
    """Every checker case at `rows` rows; per-head cases at the fewest whole [2, rows / (2 heads), heads] blocks."""
    def few(case):
        return dataclasses.replace(case, rows=rows if not case.heads else -(-rows // (2 * case.heads)) * 2 * case.heads)

    return list(dict.fromkeys(few(c) for c in check.default_cases(rows=(rows,))))


def shard(text: str) -> tuple:
    """ "i/k" as (i, k), 0 <= i < k."""
    try:
        i, k = (int(v) for v in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected i/k, e.g. 0/4") from None
    if not 0 <= i < k:
        raise argparse.ArgumentTypeError(f"{text!r}: expected 0 <= i < k")
    return i, k


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shard", default="0/1", type=shard, help="i/k: run every k-th case starting at i (0 <= i < k)")
    p.add_argument("--rows", type=int, default=3)
    p.add_argument("--only", metavar="REGEX",
                   help="only the cases whose label matches (re.search), e.g. 'x1=|weight1='")
    p.add_argument("--start", type=int, default=0, metavar="N",
                   help="skip the shard's first N cases (resume a shard that a time limit cut short)")
    p.add_argument("--compile-only", action="store_true", help="compile the shard's kernels, run nothing")
    p.add_argument("--progress", type=int, default=100, metavar="K",
                   help="a progress line every K cases (a shard cut short by a time limit still shows its rate)")
    a = p.parse_args(argv)
    i, k = a.shard
    cases = [c for c in sweep_cases(a.rows) if a.only is None or re.search(a.only, c.label())][i::k][a.start:]
    from cunorm.compiler import device_arch, device_gpu

    dev = cupy.cuda.Device().id
    kernels = collections.Counter(origin for _, origin in check.case_kernels(cases, device_arch(dev),
                                                                                gpu=device_gpu(dev)))
    t0 = time.time()
    check.precompile(cases)
    print(f"shard {i}/{k}: {len(cases)} cases, {sum(kernels.values())} distinct kernels "
          f"({', '.join(f'{n} {o}' for o, n in kernels.items())}); compiled in {time.time() - t0:.0f} s", flush=True)
    if a.compile_only:
        return 0
    bad = 0
    rng = np.random.default_rng(0)
    for n, case in enumerate(cases, start=a.start):
        if n > a.start and n % a.progress == 0:  # (a resumed part does not report its first case)
            print(f"shard {i}/{k}: cases {a.start}-{n - 1} run, {bad} failed outputs, {time.time() - t0:.0f} s",
                  flush=True)
        for r in check.run_case(case, rng):
            if not r.ok:
                print(f"FAIL {r.case.label()} {r.output} {r.error:.2e} > {r.tolerance:.0e}", flush=True)
                bad += 1
    print(f"shard {i}/{k}: cases {a.start}-{a.start + len(cases) - 1} run ({len(cases)}), {bad} failed outputs, "
          f"{time.time() - t0:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
