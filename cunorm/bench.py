"""Bandwidth benchmark: each op as a fraction of a device-to-device copy
measured in the same run (bytes read + written, minimal counts)."""
from __future__ import annotations

import itertools
import json
import sys

import numpy as np

from . import dtypes

BENCH_SIZES = (768, 1024, 4096, 8192, 16384, 65536)
DELTA_HEAD_DIMS = (64, 128, 256)
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


def norm_cases(sizes=BENCH_SIZES, dtype: str = "bfloat16", weight_dtype: str | None = None,
               variants=("layer_norm", "rms_norm", "layer_norm+residual", "rms_norm+residual"), layout=""):
    """Yields (name, n, bytes, fn) for forward and backward at M*N = ELEMENTS.
    A "+residual" variant adds a residual (dresidual in the backward) of x's
    dtype. layout "stride+D" reads and writes rows D elements apart beyond N
    (slices of wider buffers). Bytes count each row tensor once plus the saved
    statistics (4 bytes a row each); weights and partial sums are not counted."""
    import cupy

    from .norm import layer_norm, layer_norm_backward, rms_norm, rms_norm_backward

    dt = dtypes.numpy_dtype(dtype)
    wdt = dtypes.numpy_dtype(weight_dtype or dtype)
    pad = int(layout.removeprefix("stride+")) if layout else 0

    def rows_of(m, n):
        buf = cupy.random.standard_normal((m, n + pad), dtype=np.float32).astype(dt)
        return buf[:, :n]

    for n in sizes:
        m = ELEMENTS // n
        x, dy = rows_of(m, n), rows_of(m, n)
        outs = [rows_of(m, n) for _ in range(2)] if pad else [None, None]
        w = cupy.random.standard_normal(n, dtype=np.float32).astype(wdt)
        b = cupy.random.standard_normal(n, dtype=np.float32).astype(wdt)
        e = dt.itemsize
        for variant in variants:
            rms = variant.startswith("rms")
            res = rows_of(m, n) if variant.endswith("+residual") else None
            stats = (4 if rms else 8) * m
            tensors = 2 + (res is not None) * 2
            name = variant + (f" {layout}" if layout else "")
            if rms:
                fwd = lambda: rms_norm(x, w, residual=res, return_stats=True, out=outs[0])  # noqa: E731
                *_, rstd = fwd()
                bwd = lambda: rms_norm_backward(dy, x, rstd, w, dresidual=res, out=outs[1])  # noqa: E731
            else:
                fwd = lambda: layer_norm(x, w, b, residual=res, return_stats=True, out=outs[0])  # noqa: E731
                *_, mean, rstd = fwd()
                bwd = lambda: layer_norm_backward(dy, x, mean, rstd, w, dresidual=res, out=outs[1])  # noqa: E731
            yield f"{name} fwd", n, tensors * m * n * e + stats, fwd
            yield f"{name} bwd", n, (3 + (res is not None)) * m * n * e + stats, bwd


def delta_cases(head_dims=DELTA_HEAD_DIMS, dtype: str = "bfloat16"):
    """Yields (name, K, bytes, fn) for attention_delta with ELEMENTS elements per input."""
    import cupy

    from .attention_delta import attention_delta

    dt = dtypes.numpy_dtype(dtype)
    for k in head_dims:
        m = ELEMENTS // k
        o = cupy.random.standard_normal((m, k), dtype=np.float32).astype(dt)
        g = cupy.random.standard_normal((m, k), dtype=np.float32).astype(dt)
        yield "attention_delta", k, 2 * m * k * dt.itemsize + 4 * m, lambda: attention_delta(o, g)


# Layout and odd-size comparisons: strided rows beside contiguous ones at 4096,
# odd sizes beside their neighbours.
STRIDED = ((4096,), "stride+64")
ODD_SIZES = (4097, 65537)


def run(sizes=BENCH_SIZES, dtype="bfloat16", weight_dtype=None, repeat=20, out=sys.stdout,
        head_dims=DELTA_HEAD_DIMS, extras=True) -> dict:
    import cupy

    copy = copy_bandwidth()
    dev = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(dev.id)
    results = {"gpu": props["name"].decode(), "copy_gbps": copy / 1e9, "dtype": dtype,
               "weight_dtype": weight_dtype or dtype, "elements": ELEMENTS, "rows": []}
    print(f"# {results['gpu']}: device-to-device copy {copy / 1e9:.0f} GB/s (read + write)", file=out)
    print(f"{'op':<36} {'N or K':>6} {'ms':>8} {'GB/s':>7} {'of copy':>7}", file=out)
    cases = [norm_cases(sizes, dtype, weight_dtype)]
    if extras:
        cases += [norm_cases(STRIDED[0], dtype, weight_dtype, ("layer_norm", "rms_norm"), STRIDED[1]),
                  norm_cases(ODD_SIZES, dtype, weight_dtype, ("layer_norm", "rms_norm"))]
    for name, n, nbytes, fn in itertools.chain(*cases, delta_cases(head_dims, dtype)):
        ms = median_ms(fn, repeat)
        bw = nbytes / (ms * 1e-3)
        row = {"op": name, "n": n, "ms": ms, "gbps": bw / 1e9, "fraction_of_copy": bw / copy}
        results["rows"].append(row)
        print(f"{name:<36} {n:>6} {ms:>8.4f} {bw / 1e9:>7.0f} {bw / copy:>7.3f}", file=out, flush=True)
    return results


def main(argv=None):
    import argparse

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--sizes", default=",".join(map(str, BENCH_SIZES)), help="LayerNorm hidden sizes ('' for none)")
    p.add_argument("--head-dims", default=",".join(map(str, DELTA_HEAD_DIMS)), help="attention_delta head dims")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--weight-dtype", default=None)
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--json", default=None, help="also write results to this file")
    p.add_argument("--no-extras", action="store_true", help="skip the strided-row and odd-size comparisons")
    a = p.parse_args(argv)
    ints = lambda text: tuple(int(v) for v in text.split(",") if v)  # noqa: E731
    res = run(ints(a.sizes), a.dtype, a.weight_dtype, a.repeat, head_dims=ints(a.head_dims), extras=not a.no_extras)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
