"""Bandwidth benchmark: each op as a fraction of a device-to-device copy
measured in the same run (bytes read + written, minimal counts)."""
from __future__ import annotations

import itertools
import json
import sys

import numpy as np

from . import dtypes
from .source import defined_kernels

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
               variants=("layer_norm", "rms_norm", "layer_norm+residual", "rms_norm+residual"), layout="",
               as_array=None, source: str | None = None):
    """Yields (name, n, bytes, fn) for forward and backward at M*N = ELEMENTS.
    A "+residual" variant adds a residual (dresidual in the backward) of x's
    dtype. layout "stride+D" reads and writes rows D elements apart beyond N
    (slices of wider buffers). Bytes count each row tensor once plus the saved
    statistics (4 bytes a row each); weights and partial sums are not counted.
    `as_array` converts each CuPy array made (e.g. torch.from_dlpack: the calls
    then take torch tensors). `source`: an edited kernel file; the cases of the
    direction it serves run it (the others are left out)."""
    import cupy

    from .norm import layer_norm, layer_norm_backward, rms_norm, rms_norm_backward

    dt = dtypes.numpy_dtype(dtype)
    wdt = dtypes.numpy_dtype(weight_dtype or dtype)
    pad = int(layout.removeprefix("stride+")) if layout else 0

    conv = as_array or (lambda a: a)
    served = set() if source is None else defined_kernels(source)

    def rows_of(m, n):
        buf = cupy.random.standard_normal((m, n + pad), dtype=np.float32).astype(dt)
        return conv(buf[:, :n])

    for n in sizes:
        m = ELEMENTS // n
        x, dy = rows_of(m, n), rows_of(m, n)
        outs = [rows_of(m, n) for _ in range(2)] if pad else [None, None]
        w = conv(cupy.random.standard_normal(n, dtype=np.float32).astype(wdt))
        b = conv(cupy.random.standard_normal(n, dtype=np.float32).astype(wdt))
        e = dt.itemsize
        for variant in variants:
            rms = variant.startswith("rms")
            res = rows_of(m, n) if variant.endswith("+residual") else None
            stats = (4 if rms else 8) * m
            tensors = 2 + (res is not None) * 2
            name = variant + (f" {layout}" if layout else "")
            fsrc = source if source is not None and "norm_fwd" in served else None
            bsrc = source if source is not None and "norm_bwd" in served else None
            if rms:
                fwd = lambda: rms_norm(x, w, residual=res, return_stats=True, out=outs[0], source=fsrc)  # noqa: E731
                *_, rstd = fwd()
                bwd = lambda: rms_norm_backward(dy, x, rstd, w, dresidual=res, out=outs[1], source=bsrc)  # noqa: E731
            else:
                fwd = lambda: layer_norm(x, w, b, residual=res, return_stats=True, out=outs[0],  # noqa: E731
                                         source=fsrc)
                *_, mean, rstd = fwd()
                bwd = lambda: layer_norm_backward(dy, x, mean, rstd, w, dresidual=res, out=outs[1],  # noqa: E731
                                                  source=bsrc)
            if source is None or fsrc is not None:
                yield f"{name} fwd", n, tensors * m * n * e + stats, fwd
            if source is None or bsrc is not None:
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


def compare(sizes, source: str, dtype="bfloat16", rounds: int = 5, repeat: int = 10, out=sys.stdout) -> dict:
    """An interleaved A/B of the shipped kernels against an edited kernel file
    (`source`), for the direction it serves: `rounds` rounds, each timing the
    shipped call then the edited one; fraction of a same-run copy as median
    [min, max] over the rounds, and whether the two ranges overlap (a
    difference inside the spread is noise)."""
    import cupy

    copy = copy_bandwidth()
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    results = {"gpu": props["name"].decode(), "copy_gbps": copy / 1e9, "rounds": rounds, "rows": []}
    print(f"# {results['gpu']}: copy {copy / 1e9:.0f} GB/s; shipped vs edited source, {rounds} interleaved rounds",
          file=out)
    print(f"{'op':<30} {'N':>6} {'shipped':>22} {'edited':>22}  verdict", file=out)
    pairs = zip(norm_cases(sizes, dtype, variants=("layer_norm", "rms_norm"), source=source),
                norm_cases(sizes, dtype, variants=("layer_norm", "rms_norm"), source=_shipped_of(source)))
    for (name, n, nbytes, edited), (_, _, _, shipped) in pairs:
        fracs = {"shipped": [], "edited": []}
        for _ in range(rounds):
            for label, fn in (("shipped", shipped), ("edited", edited)):
                fracs[label].append(nbytes / (median_ms(fn, repeat) * 1e-3) / copy)
        stats = {k: (float(np.median(v)), min(v), max(v)) for k, v in fracs.items()}
        (ms, ls, hs), (me, le, he) = stats["shipped"], stats["edited"]
        verdict = "within noise" if le <= hs and ls <= he else ("edited faster" if me > ms else "edited slower")
        results["rows"].append({"op": name, "n": n, **{k: dict(zip(("median", "min", "max"), v))
                                                        for k, v in stats.items()}, "verdict": verdict})
        print(f"{name:<30} {n:>6} {ms:.3f} [{ls:.3f}, {hs:.3f}] {me:.3f} [{le:.3f}, {he:.3f}]  {verdict}", file=out,
              flush=True)
    return results


def _shipped_of(source: str) -> str:
    """The shipped file an edited source replaces (same kernels)."""
    from .source import _read

    return _read("norm_fwd.cu" if "norm_fwd" in defined_kernels(source) else "norm_bwd.cu")


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


HOST_SHAPES = ((1, 4096), (8, 4096), (128, 4096), (4096, 4096))
DELTA_HEAD_DIM = 128  # attention_delta's rows for a host shape (M, N): (M * N / 128, 128)


def per_call_us(fns: dict, repeat: int = 7, seconds: float = 0.05) -> dict:
    """Microseconds per call of each function, called back to back and
    synchronized at the end (the host's cost where it exceeds the GPU's):
    {name: (median, min, max)} over `repeat` rounds, the functions
    interleaved within each round so that drift hits them alike."""
    import time

    import cupy

    sync = cupy.cuda.runtime.deviceSynchronize
    counts = {}
    for name, fn in fns.items():  # warm up, and size each batch to about `seconds`
        for _ in range(20):
            fn()
        sync()
        t = time.perf_counter()
        for _ in range(20):
            fn()
        sync()
        counts[name] = max(20, int(seconds / max((time.perf_counter() - t) / 20, 1e-7)))
    rounds = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            n = counts[name]
            sync()
            t = time.perf_counter()
            for _ in range(n):
                fn()
            sync()
            rounds[name].append((time.perf_counter() - t) / n * 1e6)
    return {name: (float(np.median(v)), min(v), max(v)) for name, v in rounds.items()}


def host_cases(shape: tuple, dtype: str = "bfloat16"):
    """Yields (op, {variant: fn}) for every op at one shape: cunorm on CuPy
    arrays, cunorm on torch tensors, and torch's own op when torch is
    installed (attention_delta: torch's eager (out.float() * grad.float()).sum(-1))."""
    import cupy

    from .attention_delta import attention_delta
    from .norm import layer_norm, layer_norm_backward, rms_norm, rms_norm_backward

    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        torch = None
    n = shape[-1]
    dt = dtypes.numpy_dtype(dtype)
    gen = cupy.random.default_rng(0)
    cx, cdy = (gen.standard_normal(shape, dtype=np.float32).astype(dt) for _ in range(2))
    cw, cb = (gen.standard_normal(n, dtype=np.float32).astype(dt) for _ in range(2))
    _, cmean, crstd = layer_norm(cx, cw, cb, return_stats=True)
    _, crms = rms_norm(cx, cw, return_stats=True)
    co, cg = cx.reshape(-1, DELTA_HEAD_DIM), cdy.reshape(-1, DELTA_HEAD_DIM)
    t = {}
    if torch is not None:
        t = {k: torch.from_dlpack(v) for k, v in dict(x=cx, dy=cdy, w=cw, b=cb, mean=cmean, rstd=crstd, rms=crms,
                                                      o=co, g=cg).items()}
    ops = {
        "layer_norm": (lambda a: layer_norm(a["x"], a["w"], a["b"]),
                       lambda: F.layer_norm(t["x"], (n,), t["w"], t["b"])),
        "rms_norm": (lambda a: rms_norm(a["x"], a["w"]), lambda: F.rms_norm(t["x"], (n,), t["w"])),
        "layer_norm_backward": (lambda a: layer_norm_backward(a["dy"], a["x"], a["mean"], a["rstd"], a["w"]),
                                lambda: torch.ops.aten.native_layer_norm_backward(
                                    t["dy"], t["x"], (n,), t["mean"], t["rstd"], t["w"], t["b"], [True] * 3)),
        "rms_norm_backward": (lambda a: rms_norm_backward(a["dy"], a["x"], a["rms"], a["w"]),
                              lambda: torch.ops.aten._fused_rms_norm_backward(
                                  t["dy"], t["x"], (n,), t["rms"], t["w"], [True, True])),
        "attention_delta": (lambda a: attention_delta(a["o"], a["g"]),
                            lambda: (t["o"].float() * t["g"].float()).sum(-1)),
    }
    c = dict(x=cx, dy=cdy, w=cw, b=cb, mean=cmean, rstd=crstd, rms=crms, o=co, g=cg)
    for op, (ours, native) in ops.items():
        fns = {"cunorm (CuPy)": lambda ours=ours: ours(c)}
        if torch is not None:
            fns["cunorm (torch)"] = lambda ours=ours: ours(t)
            try:
                native()
                fns["torch"] = native
            except (AttributeError, RuntimeError):  # an op this torch lacks
                pass
        yield op, fns


def run_host(shapes=HOST_SHAPES, dtype: str = "bfloat16", repeat: int = 7, out=sys.stdout) -> dict:
    """Per-call host time of every op through the API, beside torch's (same run)."""
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    results = {"gpu": props["name"].decode(), "dtype": dtype, "rows": []}
    print(f"# {results['gpu']}: microseconds per call, back to back (median [min, max] of {repeat} rounds)",
          file=out)
    print(f"{'op':<22} {'shape':<13} {'variant':<15} {'us/call':>8} {'min':>7} {'max':>7}", file=out)
    for shape in shapes:
        for op, fns in host_cases(shape, dtype):
            for variant, (med, lo, hi) in per_call_us(fns, repeat).items():
                shown = shape if op != "attention_delta" else (shape[0] * shape[1] // DELTA_HEAD_DIM, DELTA_HEAD_DIM)
                results["rows"].append({"op": op, "shape": list(shown), "variant": variant, "us": med, "min": lo,
                                        "max": hi})
                print(f"{op:<22} {str(shown):<13} {variant:<15} {med:>8.2f} {lo:>7.2f} {hi:>7.2f}", file=out,
                      flush=True)
    return results


def graph_ms(fn, repeat: int = 20) -> float:
    """Milliseconds per call of `fn` replayed from a CUDA graph (torch's
    capture: outputs come from the graph's private pool), timed with events."""
    import torch

    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(5):
        g.replay()
    for _ in range(repeat):
        g.replay()
        start.record()
        for _ in range(10):
            g.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 10)
    return float(np.median(times))


def run_graph(sizes=(768, 1024, 2048, 4096, 8192, 16384, 32768, 65536), dtype: str = "bfloat16", repeat: int = 20,
              out=sys.stdout) -> dict:
    """Bandwidth through the API (torch tensors, back-to-back calls timed with
    events) beside the same calls replayed from a CUDA graph, as fractions of
    a same-run copy: what the host path costs at M*N = ELEMENTS."""
    import cupy
    import torch

    copy = copy_bandwidth()
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    results = {"gpu": props["name"].decode(), "copy_gbps": copy / 1e9, "rows": []}
    print(f"# {results['gpu']}: copy {copy / 1e9:.0f} GB/s; API (events around back-to-back calls) vs CUDA graph "
          f"replay, torch tensors", file=out)
    print(f"{'op':<28} {'N':>6} {'API':>7} {'graph':>7} {'API/graph':>9}", file=out)
    for name, n, nbytes, fn in norm_cases(sizes, dtype, variants=("layer_norm", "rms_norm"),
                                          as_array=torch.from_dlpack):
        api = median_ms(fn, repeat)
        graph = graph_ms(fn, repeat)
        row = {"op": name, "n": n, "api": nbytes / (api * 1e-3) / copy, "graph": nbytes / (graph * 1e-3) / copy}
        results["rows"].append(row)
        print(f"{name:<28} {n:>6} {row['api']:>7.3f} {row['graph']:>7.3f} {row['api'] / row['graph']:>9.3f}",
              file=out, flush=True)
    return results


def main(argv=None, prog: str = "python -m cunorm.bench") -> int:
    import argparse

    from .cli import EXIT_NO_GPU, gpu_missing

    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--sizes", default=",".join(map(str, BENCH_SIZES)), help="LayerNorm hidden sizes ('' for none)")
    p.add_argument("--head-dims", default=",".join(map(str, DELTA_HEAD_DIMS)), help="attention_delta head dims")
    p.add_argument("--dtype", default="bfloat16", help="activations' dtype")
    p.add_argument("--weight-dtype", default=None, help="weights' dtype (default: the activations')")
    p.add_argument("--repeat", type=int, default=20, help="timed batches per case")
    p.add_argument("--no-extras", action="store_true", help="skip the strided-row and odd-size comparisons")
    p.add_argument("--host", action="store_true", help="per-call host time of every op (CuPy arrays, torch "
                   "tensors, torch's own op) at the host shapes, instead of bandwidth")
    p.add_argument("--graph", action="store_true", help="bandwidth through the API beside CUDA-graph replay "
                   "(torch tensors), instead of the bandwidth table")
    p.add_argument("--source", default=None, help="an edited copy of kernels/norm_fwd.cu or norm_bwd.cu: an "
                   "interleaved A/B against the shipped file at --sizes")
    p.add_argument("--rounds", type=int, default=5, help="interleaved A/B rounds (with --source)")
    p.add_argument("--json", action="store_true", help="print the results as JSON (the table goes to stderr)")
    p.add_argument("--output", default=None, help="also write the results as JSON to this file")
    a = p.parse_args(argv)
    source = None
    if a.source:
        with open(a.source) as f:
            source = f.read()
        if not defined_kernels(source) & {"norm_fwd", "norm_bwd"}:
            p.error(f"--source {a.source}: defines neither norm_fwd nor norm_bwd")
    if gpu_missing(prog, a.json):
        return EXIT_NO_GPU
    out = sys.stderr if a.json else sys.stdout
    ints = lambda text: tuple(int(v) for v in text.split(",") if v)  # noqa: E731
    if source is not None:
        res = compare(ints(a.sizes), source, a.dtype, a.rounds, max(a.repeat // 2, 5), out=out)
    elif a.host:
        res = run_host(dtype=a.dtype, repeat=max(a.repeat // 3, 5), out=out)
    elif a.graph:
        res = run_graph(dtype=a.dtype, out=out)
    else:
        res = run(ints(a.sizes), a.dtype, a.weight_dtype, a.repeat, out=out, head_dims=ints(a.head_dims),
                  extras=not a.no_extras)
    if a.json:
        print(json.dumps(res, indent=1))
    if a.output:
        with open(a.output, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
