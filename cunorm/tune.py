"""Tuning: time every legal candidate traits for a hidden size and report the
fastest knobs (what goes into dispatch.TUNED)."""
from __future__ import annotations

import itertools
import json
import sys

import numpy as np

from . import dtypes
from .traits import Traits


SHAPES = dict(ctas_per_row=(1, 2, 4, 8), warps_n=(1, 2, 4, 8, 16, 32), warps_m=(1, 2, 4, 8), bytes_per_ldg=(16, 8))
EXTRAS = dict(stages=(1, 2, 3, 4), min_ctas_per_sm=(1, 2), cache_weights=(True, False),
              smem_accumulators=(False, True), recompute=(True, False))
SIZES = (1024, 4096, 8192, 16384)  # what `cunorm tune` tunes by default
DIRECTIONS = {"fwd": (False,), "bwd": (True,), "both": (False, True)}  # backward flags per --direction


def _legal(base: dict, **knobs):
    try:
        t = Traits(**base, **knobs)
    except ValueError:
        return None
    # Skip shapes that leave most of a CTA idle or hold too few elements per thread.
    if t.threads_per_cta < 64 or t.elts_per_thread < 8 or t.ldgs * t.vec_cols_per_ldg > 2 * t.vec_cols:
        return None
    return t


def candidates(hidden_size: int, dtype: str, backward: bool, arch: int = 90, rms: bool = False):
    """Phase 1: launch shapes (CTAs per row, warps, load width) with default
    extras, for contiguous rows: the general kernel where the load width does
    not divide N."""
    base = dict(hidden_size=hidden_size, input_dtype=dtype, weight_dtype=dtype, output_dtype=dtype,
                backward=backward, rms=rms, has_bias=not rms)
    out = []
    for ctas, wn, wm, bpl in itertools.product(*SHAPES.values()):
        if ctas > 1 and (wm > 1 or arch < 90):
            continue
        aligned = hidden_size % (bpl // dtypes.itemsize(dtype)) == 0
        t = _legal(base, ctas_per_row=ctas, warps_n=wn, warps_m=wm, bytes_per_ldg=bpl, aligned_rows=aligned)
        if t is not None:
            out.append(t)
    return out


def refinements(shape: Traits):
    """Phase 2: the extras (stages, register cap, weight caching, shared-memory sums) on one shape."""
    out = []
    for stages, min_ctas, cache, smem_acc, recompute in itertools.product(*EXTRAS.values()):
        if (smem_acc or not recompute) and not shape.backward:
            continue
        try:
            t = shape.replace(stages=stages, min_ctas_per_sm=min_ctas, cache_weights=cache,
                              smem_accumulators=smem_acc, recompute=recompute)
        except ValueError:
            continue
        if 65536 // (min_ctas * t.threads_per_cta) >= 64:  # a cap below 64 registers only spills
            out.append(t)
    return out


def _usable(traits: Traits, device_id: int) -> bool:
    """Compiles (CuPy caches it) and rejects kernels that spill or cannot launch."""
    from .compiler import kernels_for

    try:
        kernels = kernels_for(traits, device_id)
    except Exception:
        return False
    return all(k.function.local_size_bytes == 0 for k in kernels.values())


def _time_all(traits_list, fn_for, repeat, out, label: str):
    """[(ms, traits)] for the usable candidates, compiled in parallel first."""
    from concurrent.futures import ThreadPoolExecutor

    import cupy

    from .bench import median_ms, progress

    dev = cupy.cuda.Device().id
    usable = []
    compiling = progress(len(traits_list), f"{label}: compiling", out)
    with ThreadPoolExecutor(max_workers=16) as pool, compiling as (bar, _):
        for ok in pool.map(lambda t: _usable(t, dev), traits_list):
            usable.append(ok)
            bar.update(1)
    timed = []
    with progress(sum(usable), f"{label}: timing", out) as (bar, echo):
        for t, ok in zip(traits_list, usable):
            if not ok:
                continue
            try:
                timed.append((median_ms(fn_for(t), repeat=repeat, warmup=2, batch=5), t))
            except Exception as e:  # a candidate that fails to launch is reported, not fatal
                echo(f"  {t.short()}: {type(e).__name__}: {str(e).splitlines()[0]}")
            bar.update(1)
    timed.sort(key=lambda p: p[0])
    return timed


def tune(hidden_size: int, dtype: str = "bfloat16", backward: bool = False, elements: int = 2**26,
         repeat: int = 6, keep: int = 2, rms: bool = False, out=sys.stdout) -> list:
    """[(ms, traits)] sorted fastest first: every shape, then the extras on the `keep` fastest shapes."""
    import cupy

    from .norm import layer_norm, layer_norm_backward, rms_norm, rms_norm_backward

    m = max(1, elements // hidden_size)
    dt = dtypes.numpy_dtype(dtype)
    x = cupy.random.standard_normal((m, hidden_size), dtype=np.float32).astype(dt)
    w = cupy.random.standard_normal(hidden_size, dtype=np.float32).astype(dt)
    _, mean, rstd = layer_norm(x, w, w, return_stats=True)
    dy = cupy.random.standard_normal((m, hidden_size), dtype=np.float32).astype(dt) if backward else None

    def fn_for(t):
        knobs = t.knobs()
        if rms:
            if backward:
                return lambda: rms_norm_backward(dy, x, rstd, w, traits=knobs)
            return lambda: rms_norm(x, w, return_stats=True, traits=knobs)
        if backward:
            return lambda: layer_norm_backward(dy, x, mean, rstd, w, traits=knobs)
        return lambda: layer_norm(x, w, w, return_stats=True, traits=knobs)

    label = f"{'rms-' if rms else ''}{'bwd' if backward else 'fwd'} N={hidden_size}"
    shapes = _time_all(candidates(hidden_size, dtype, backward, rms=rms), fn_for, repeat, out, f"{label} shapes")
    refined = [t for _, shape in shapes[:keep] for t in refinements(shape)]
    return sorted(shapes + _time_all(refined, fn_for, repeat, out, f"{label} extras"), key=lambda p: p[0])


def run(sizes=SIZES, dtype: str = "bfloat16", direction: str = "both", rms: bool = False, top: int = 3,
        warps_n=None, as_json: bool = False, output: str | None = None, out=sys.stdout):
    """Tunes every size in `direction` ("fwd", "bwd" or "both"): the `top`
    candidates of each as TUNE lines to `out`; the best knobs of each as a
    JSON line, printed to stdout (`as_json`) and appended to the file `output`.
    `warps_n`: the WARPS_N values to try (replaces SHAPES' for this process)."""
    from .bench import copy_bandwidth

    if warps_n:
        SHAPES["warps_n"] = tuple(warps_n)
    copy = copy_bandwidth()
    e = dtypes.itemsize(dtype)
    for n in sizes:
        for backward in DIRECTIONS[direction]:
            m = 2**26 // n
            nbytes = (3 if backward else 2) * m * n * e + 8 * m
            ranked = tune(n, dtype, backward, rms=rms, out=out)
            if ranked and (as_json or output):
                ms, best = ranked[0]
                general = n % dtypes.vector_elements(e) != 0  # contiguous rows of N: the general kernel
                line = json.dumps({"backward": backward, "rms": rms, "general": general, "n": n,
                                   "dtype": dtype, "ms": ms, "fraction_of_copy": nbytes / (ms * 1e-3) / copy,
                                   "knobs": list(best.knobs().values())})
                if as_json:
                    print(line, flush=True)
                if output:
                    with open(output, "a") as f:
                        f.write(line + "\n")
            for ms, t in ranked[:top]:
                frac = nbytes / (ms * 1e-3) / copy
                print(f"TUNE {'rms-' if rms else ''}{'bwd' if backward else 'fwd'} N={n} {dtype} {frac:.3f} of copy "
                      f"{ms:.4f} ms "
                      f"knobs={tuple(int(v) for v in t.knobs().values())} "
                      f"ldgs={t.ldgs}",
                      file=out, flush=True)


if __name__ == "__main__":
    from .cli import tune as command

    command(prog_name="python -m cunorm.tune")
