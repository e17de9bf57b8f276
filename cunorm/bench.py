"""Bandwidth benchmark: each op as a fraction of a device-to-device copy
measured in the same run (bytes read + written, minimal counts)."""
from __future__ import annotations

import json
import sys

import numpy as np

from . import dtypes

BENCH_SIZES = (768, 1024, 4096, 8192, 16384, 65536)
ELEMENTS = 2**26


def median_ms(fn, repeat: int = 50, warmup: int = 5, batch: int = 10) -> float:
    """Milliseconds per call: the median over `repeat` batches of the mean of
    `batch` back-to-back calls, timed with CUDA events after `warmup` calls.
    One call is queued before the start event, so the GPU is already busy when
    timing starts; back-to-back calls then overlap each call's host work with
    the previous call's kernels. What is timed is the GPU's time per call, host
    overhead included only where it exceeds the kernels' time."""
    import cupy

    for _ in range(warmup):
        fn()
    times = []
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    for _ in range(repeat):
        fn()
        start.record()
        for _ in range(batch):
            fn()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop) / batch)
    return float(np.median(times))


def copy_bandwidth(nbytes: int = 2**30) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read plus written."""
    import cupy

    src = cupy.empty(nbytes, dtype=np.uint8)
    src[...] = 1
    dst = cupy.empty_like(src)
    ms = median_ms(lambda: cupy.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, nbytes,
                                                          cupy.cuda.runtime.memcpyDeviceToDevice,
                                                          cupy.cuda.get_current_stream().ptr))
    return 2 * nbytes / (ms * 1e-3)


def layer_norm_cases(sizes=BENCH_SIZES, dtype: str = "bfloat16", weight_dtype: str | None = None):
    """Yields (name, n, bytes, fn) for forward and backward at M*N = ELEMENTS."""
    import cupy

    from .layer_norm import layer_norm, layer_norm_backward

    dt = dtypes.numpy_dtype(dtype)
    wdt = dtypes.numpy_dtype(weight_dtype or dtype)
    for n in sizes:
        m = ELEMENTS // n
        x = cupy.random.standard_normal((m, n), dtype=np.float32).astype(dt)
        dy = cupy.random.standard_normal((m, n), dtype=np.float32).astype(dt)
        w = cupy.random.standard_normal(n, dtype=np.float32).astype(wdt)
        b = cupy.random.standard_normal(n, dtype=np.float32).astype(wdt)
        _, mean, rstd = layer_norm(x, w, b, return_stats=True)
        e = dt.itemsize
        yield "layer_norm fwd", n, 2 * m * n * e + 8 * m, lambda: layer_norm(x, w, b, return_stats=True)
        yield "layer_norm bwd", n, 3 * m * n * e + 8 * m, lambda: layer_norm_backward(dy, x, mean, rstd, w)


def run(sizes=BENCH_SIZES, dtype="bfloat16", weight_dtype=None, repeat=20, out=sys.stdout) -> dict:
    import cupy

    copy = copy_bandwidth()
    dev = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(dev.id)
    results = {"gpu": props["name"].decode(), "copy_gbps": copy / 1e9, "dtype": dtype,
               "weight_dtype": weight_dtype or dtype, "elements": ELEMENTS, "rows": []}
    print(f"# {results['gpu']}: device-to-device copy {copy / 1e9:.0f} GB/s (read + write)", file=out)
    print(f"{'op':<16} {'N':>6} {'ms':>8} {'GB/s':>7} {'of copy':>7}", file=out)
    for name, n, nbytes, fn in layer_norm_cases(sizes, dtype, weight_dtype):
        ms = median_ms(fn, repeat)
        bw = nbytes / (ms * 1e-3)
        row = {"op": name, "n": n, "ms": ms, "gbps": bw / 1e9, "fraction_of_copy": bw / copy}
        results["rows"].append(row)
        print(f"{name:<16} {n:>6} {ms:>8.4f} {bw / 1e9:>7.0f} {bw / copy:>7.3f}", file=out, flush=True)
    return results


def main(argv=None):
    import argparse

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--sizes", default=",".join(map(str, BENCH_SIZES)))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--weight-dtype", default=None)
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--json", default=None, help="also write results to this file")
    a = p.parse_args(argv)
    res = run(tuple(int(s) for s in a.sizes.split(",")), a.dtype, a.weight_dtype, a.repeat)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
