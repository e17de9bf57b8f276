"""Tuning: time every legal candidate traits for a hidden size and report the
fastest knobs (what goes into dispatch.TUNED)."""
from __future__ import annotations

import itertools
import sys

import numpy as np

from . import dtypes
from .traits import Traits


def candidates(hidden_size: int, dtype: str, backward: bool, arch: int = 90):
    """Legal traits over a grid of knobs (16- and 8-byte loads)."""
    seen = set()
    for ctas, warps_n, warps_m, bpl, cache, min_ctas, smem_acc in itertools.product(
            (1, 2, 4, 8), (1, 2, 4, 8, 16, 32), (1, 2, 4, 8), (16, 8), (True, False), (1, 2, 3, 4),
            (False, True) if backward else (False,)):
        if ctas > 1 and (warps_m > 1 or arch < 90):
            continue
        try:
            t = Traits(hidden_size=hidden_size, input_dtype=dtype, weight_dtype=dtype, output_dtype=dtype,
                       warps_m=warps_m, warps_n=warps_n, ctas_per_row=ctas, bytes_per_ldg=bpl, backward=backward,
                       cache_weights=cache, min_ctas_per_sm=min_ctas, smem_accumulators=smem_acc)
        except ValueError:
            continue
        # Skip shapes that leave most of a CTA idle or hold too few elements per thread.
        if t.threads_per_cta < 64 or t.elts_per_thread < 8 or t.ldgs * t.vec_cols_per_ldg > 2 * t.vec_cols:
            continue
        # A register cap below 64 per thread only spills.
        if 65536 // (min_ctas * t.threads_per_cta) < 64:
            continue
        if t not in seen:
            seen.add(t)
            yield t


def tune(hidden_size: int, dtype: str = "bfloat16", backward: bool = False, elements: int = 2**26,
         repeat: int = 10, out=sys.stdout) -> list:
    """[(ms, traits)] sorted fastest first."""
    import cupy

    from .bench import median_ms
    from .layer_norm import layer_norm, layer_norm_backward

    m = max(1, elements // hidden_size)
    dt = dtypes.numpy_dtype(dtype)
    x = cupy.random.standard_normal((m, hidden_size), dtype=np.float32).astype(dt)
    w = cupy.random.standard_normal(hidden_size, dtype=np.float32).astype(dt)
    _, mean, rstd = layer_norm(x, w, w, return_stats=True)
    dy = cupy.random.standard_normal((m, hidden_size), dtype=np.float32).astype(dt) if backward else None
    timed = []
    for t in candidates(hidden_size, dtype, backward):
        knobs = t.knobs()
        if backward:
            fn = lambda: layer_norm_backward(dy, x, mean, rstd, w, traits=knobs)  # noqa: E731
        else:
            fn = lambda: layer_norm(x, w, w, return_stats=True, traits=knobs)  # noqa: E731
        try:
            ms = median_ms(fn, repeat=repeat, warmup=2, batch=5)
        except Exception as e:  # a candidate that fails to compile or launch is reported, not fatal
            print(f"  {t.short()}: {type(e).__name__}: {str(e).splitlines()[0]}", file=out)
            continue
        timed.append((ms, t))
    timed.sort(key=lambda p: p[0])
    return timed


def main(argv=None):
    import argparse

    from .bench import copy_bandwidth

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--sizes", default="1024,4096,8192,16384")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--top", type=int, default=3)
    p.add_argument("--direction", choices=["fwd", "bwd", "both"], default="both")
    a = p.parse_args(argv)
    copy = copy_bandwidth()
    e = dtypes.itemsize(a.dtype)
    for n in (int(s) for s in a.sizes.split(",")):
        for backward in {"fwd": (False,), "bwd": (True,), "both": (False, True)}[a.direction]:
            m = 2**26 // n
            nbytes = (3 if backward else 2) * m * n * e + 8 * m
            ranked = tune(n, a.dtype, backward)
            for ms, t in ranked[:a.top]:
                frac = nbytes / (ms * 1e-3) / copy
                print(f"TUNE {'bwd' if backward else 'fwd'} N={n} {a.dtype} {frac:.3f} of copy {ms:.4f} ms "
                      f"knobs={tuple(int(v) for v in t.knobs().values())} "
                      f"ldgs={t.ldgs}",
                      flush=True)


if __name__ == "__main__":
    main()
