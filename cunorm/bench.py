"""Bandwidth benchmark: each op as a fraction of a device-to-device copy
measured in the same run (bytes read + written, minimal counts), and kernel
variants (an edited kernel file, forced traits) against the shipped kernels in
interleaved rounds. The command is `cunorm bench` (cunorm/cli/measuring.py);
what it times is in cunorm/workloads.py."""
from __future__ import annotations

import functools
import itertools
import sys

import numpy as np

from . import dtypes
from .check import SHORT_NAMES
from .source import defined_kernels
# Re-exported: callers and the tests' stand-ins reach them as bench.*.
from .timing import copy_bandwidth, gpu_name, graph_ms, kernel_ms, median_ms, per_call_us, progress  # noqa: F401
from .workloads import (BENCH_SIZES, DELTA_HEAD_DIMS, DIRECTIONS, DROPOUT_SIZES, ELEMENTS, NORM_OPS,  # noqa: F401
                        PLAIN_OPS, Case, delta_cases, dropout_cases, fp8_cases, norm_cases, qk_cases, torch_native,
                        _torch_from_dlpack)

# `cunorm bench --ops` names: the (op, direction) each stands for; "delta" is attention_delta.
OP_CHOICES = {f"{name}{extra}": (f"{op}{extra}", "bwd" if backward else "fwd")
              for extra in ("", "+residual") for name, (op, backward) in SHORT_NAMES.items()}
BENCH_OPS = (*OP_CHOICES, "delta", "qk", "fp8", "dropout")  # qk: q/k-norm of a fused QKV buffer; fp8: fp8-output
# RMSNorm; dropout: dropout + residual + LayerNorm forward and backward (`dropout_cases`)


def op_pairs(ops=None) -> set:
    """The (op, direction) pairs `ops` (names of BENCH_OPS; None: all) stand for."""
    return {OP_CHOICES[name] for name in (ops or OP_CHOICES) if name in OP_CHOICES}


# Layout and odd-size comparisons: strided rows beside contiguous ones at 4096,
# odd sizes beside their neighbours.
STRIDED = ((4096,), "stride+64")
ODD_SIZES = (4097, 65537)


def variants_of(source: str | None = None, traits: dict | None = None) -> dict:
    """Kernel variants for `compare`, {label: keyword arguments for the op}:
    "tuned" (the shipped kernels and dispatch) first, then "edited" (`source`,
    an edited kernel file) and one per entry of `traits` ({label: knobs}).
    With a source, the other variants pass the shipped file's text, so that
    every call takes the same path."""
    base = {} if source is None else {"source": _shipped_of(source)}
    variants = {"tuned": base}
    if source is not None:
        variants["edited"] = {"source": source}
    for label, knobs in (traits or {}).items():
        variants[label] = {**base, "traits": dict(knobs)}
    return variants


def served_directions(source: str) -> tuple:
    """The directions an edited kernel file serves: "fwd" for norm_fwd.cu's kernel, "bwd" for norm_bwd.cu's."""
    served = defined_kernels(source)
    return tuple(d for d, kernel in zip(DIRECTIONS, ("norm_fwd", "norm_bwd")) if kernel in served)


def _shipped_of(source: str) -> str:
    """The shipped file an edited source replaces (same kernels)."""
    from .source import _read

    return _read("norm_fwd.cu" if "norm_fwd" in defined_kernels(source) else "norm_bwd.cu")


def compare(sizes, variants: dict, dtype: str = "bfloat16", weight_dtype: str | None = None, rounds: int = 5,
            repeat: int = 10, directions=DIRECTIONS, out=sys.stdout, ops=("fwd", "bwd", "rms", "rms-bwd"),
            timing: str = "api") -> dict:
    """Kernel variants timed side by side at `sizes` on `ops` (names of
    BENCH_OPS; by default LayerNorm and RMSNorm, forward and backward, without
    a residual; "qk" and "fp8" add those forward cases at their own shapes) in `directions`.
    `variants`: {label: keyword arguments for the op} (see `variants_of`), the
    first the baseline; torch's own op joins them where torch is importable.
    Each case runs `rounds` rounds, each timing every variant in turn, so that
    drift hits them alike; per variant, the fraction of a same-run copy as
    median [min, max] over the rounds and microseconds per call (median). A
    variant the op refuses at a size (illegal traits: ValueError; or one that
    fails to compile or launch) is skipped there. Verdict of each against the
    baseline: "within noise" where the two ranges overlap, else "faster" or
    "slower"; a row's "verdict" sums up the variants given (torch aside). `timing`: "api" (per call through
    the API) or "kernel" (the kernels alone), as `timer_of` says."""
    timer = timer_of(timing)
    copy = copy_bandwidth()
    results = {"gpu": gpu_name(), "copy_gbps": copy / 1e9, "dtype": dtype, "weight_dtype": weight_dtype or dtype,
               "rounds": rounds, "variants": list(variants), "timing": timing, "rows": []}
    print(f"# {results['gpu']}: copy {copy / 1e9:.0f} GB/s; {', '.join(variants)} (and torch where importable), "
          f"{rounds} interleaved rounds, {_TIMING_WORDS[timing]}; fraction of copy: median [min, max]", file=out)
    print(f"{'op':<16} {'N':>6}  {'variant':<26} {'of copy [min, max]':<22} {'us/call':>9}  verdict", file=out)
    pairs = {(op, d) for op, d in op_pairs(ops) if d in directions}
    cases = norm_cases(sizes, dtype, weight_dtype, NORM_OPS, directions=directions, native=True, only=pairs)
    # The forward-only fused cases, with their own shapes (not `sizes`).
    fused = [make for name, make in (("qk", qk_cases), ("fp8", fp8_cases)) if name in ops and "fwd" in directions]
    count = len(sizes) * len(pairs) + len(fused)
    with progress(count * rounds, "timing variants", out) as (bar, echo):
        for case in itertools.chain(cases, *(make(dtype) for make in fused)):
            fns, skipped = {}, {}
            for label, kwargs in variants.items():
                fn = functools.partial(case.call, **kwargs)
                try:
                    fn()  # compiles it; illegal traits raise here
                except (ValueError, RuntimeError) as e:  # RuntimeError: a compile or launch failure
                    skipped[label] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
                    continue
                fns[label] = fn
            if case.native is not None:
                fns["torch"] = case.native
            ms = {label: [] for label in fns}
            for _ in range(rounds):
                for label, fn in fns.items():
                    ms[label].append(timer(fn, repeat))
                bar.update(1)
            row = _compared(case, ms, skipped, copy, list(variants))
            results["rows"].append(row)
            for line in _compared_lines(row):
                echo(line)
    return results


def _compared(case: Case, ms: dict, skipped: dict, copy: float, variants: list) -> dict:
    """A row of `compare`: per variant (in `variants`' order, torch last) its
    fractions and time, or why it was skipped; its verdict against the first;
    and the row's verdict, which names the variants outside the noise."""
    row = {"op": case.op, "n": case.n, "bytes": case.nbytes, "variants": {}}
    for label in [*variants, "torch"]:
        if label in skipped:
            row["variants"][label] = {"skipped": skipped[label]}
        elif label in ms:
            fractions = [case.nbytes / (t * 1e-3) / copy for t in ms[label]]
            row["variants"][label] = {"fraction_of_copy": float(np.median(fractions)), "fraction_min": min(fractions),
                                      "fraction_max": max(fractions), "us": float(np.median(ms[label])) * 1e3}
    baseline = row["variants"][variants[0]]
    if "skipped" in baseline:
        row["verdict"] = f"{variants[0]} skipped"
        return row
    notes = []
    for label, v in list(row["variants"].items())[1:]:
        if "skipped" in v:
            notes.append(f"{label} skipped")
            continue
        overlap = v["fraction_min"] <= baseline["fraction_max"] and baseline["fraction_min"] <= v["fraction_max"]
        v["verdict"] = ("within noise" if overlap else
                        "faster" if v["fraction_of_copy"] > baseline["fraction_of_copy"] else "slower")
        if label != "torch" and v["verdict"] != "within noise":
            notes.append(f"{label} {v['verdict']}")
    row["verdict"] = "; ".join(notes) or "within noise"
    return row


def _compared_lines(row: dict):
    """The table lines of one row of `compare`: a line per variant."""
    for i, (label, v) in enumerate(row["variants"].items()):
        head = f"{row['op']:<16} {row['n']:>6}" if i == 0 else " " * 23
        if "skipped" in v:
            yield f"{head}  {label:<26} skipped: {v['skipped']}"
            continue
        spread = f"{v['fraction_of_copy']:.3f} [{v['fraction_min']:.3f}, {v['fraction_max']:.3f}]"
        yield f"{head}  {label:<26} {spread:<22} {v['us']:>9.1f}  {v.get('verdict', '')}"


_TIMING_WORDS = {"api": "per call through the API", "kernel": "kernel time (calls queued behind a spin)"}


def timer_of(timing: str):
    """The timer of a `timing`: "api", per call through the API (median_ms); "kernel", the kernels alone
    (kernel_ms: --kernel-time)."""
    return {"api": median_ms, "kernel": kernel_ms}[timing]


def run(sizes=BENCH_SIZES, dtype="bfloat16", weight_dtype=None, repeat=20, out=sys.stdout,
        head_dims=DELTA_HEAD_DIMS, extras=True, ops=None, timing: str = "api", rounds: int = 1) -> dict:
    """The bandwidth table: every op at `sizes` (and, with `extras`, strided
    rows and odd sizes), attention_delta at `head_dims`; `ops` (names of
    BENCH_OPS; None: all) picks the ops and directions; `timing` as `timer_of` says.
    `rounds` > 1 runs the whole sweep that many times (each size's arrays made
    afresh each round, one size's alive at a time as in one round), so drift and a
    stalled reading show as the spread; each row is then the median [min, max] of
    its rounds (fraction of copy; ms and GB/s of the median time)."""
    timer = timer_of(timing)
    pairs = op_pairs(ops)
    head_dims = head_dims if ops is None or "delta" in ops else ()
    qk, fp8, dropout = (ops is None or name in ops for name in ("qk", "fp8", "dropout"))
    copy = copy_bandwidth()
    results = {"gpu": gpu_name(), "copy_gbps": copy / 1e9, "dtype": dtype,
               "weight_dtype": weight_dtype or dtype, "elements": ELEMENTS, "timing": timing, "rounds": rounds,
               "rows": []}
    spread = f"; median [min, max] of {rounds} rounds" if rounds > 1 else ""
    print(f"# {results['gpu']}: device-to-device copy {copy / 1e9:.0f} GB/s (read + write); "
          f"{_TIMING_WORDS[timing]}{spread}", file=out)
    print(f"{'op':<36} {'N or K':>6} {'ms':>8} {'GB/s':>7} {'of copy':>7}{'  [min, max] of copy' if spread else ''}",
          file=out)

    def sweep():
        cases = [norm_cases(sizes, dtype, weight_dtype, only=pairs)]
        if extras:
            cases += [norm_cases(STRIDED[0], dtype, weight_dtype, PLAIN_OPS, STRIDED[1], only=pairs),
                      norm_cases(ODD_SIZES, dtype, weight_dtype, PLAIN_OPS, only=pairs)]
        return itertools.chain(*cases, delta_cases(head_dims, dtype), qk_cases(dtype) if qk else (),
                               fp8_cases(dtype) if fp8 else (), dropout_cases(dtype) if dropout else ())

    count = len(sizes) * len(pairs) + len(head_dims) + qk + fp8 + 2 * len(DROPOUT_SIZES) * dropout
    if extras:
        count += (len(STRIDED[0]) + len(ODD_SIZES)) * sum(op in PLAIN_OPS for op, _ in pairs)
    # (position in the round, torch's or not) -> (op, n, bytes, [ms a round]); torch's op named "op (torch)".
    timed = {}
    with progress(count * rounds, "benchmarking", out) as (bar, echo):
        for _ in range(rounds):
            for i, case in enumerate(sweep()):
                for native, op, fn in ((False, case.op, case.call), (True, f"{case.op} (torch)", case.native)):
                    if fn is None:
                        continue
                    times = timed.setdefault((i, native), (op, case.n, case.nbytes, []))[3]
                    times.append(timer(fn, repeat))
                    if rounds == 1:
                        echo(_sweep_line(_sweep_row(op, case.n, case.nbytes, times, copy), False))
                bar.update(1)
        for op, n, nbytes, times in timed.values():
            results["rows"].append(_sweep_row(op, n, nbytes, times, copy))
            if rounds > 1:
                echo(_sweep_line(results["rows"][-1], True))
    return results


def _sweep_row(op: str, n: int, nbytes: int, times: list, copy: float) -> dict:
    """A row of the bandwidth table: the median ms of its rounds, its bandwidth and fraction of `copy`, and the
    fraction's [min, max] over the rounds (of the slowest and the fastest round)."""
    ms = float(np.median(times))
    return {"op": op, "n": n, "ms": ms, "gbps": nbytes / (ms * 1e-3) / 1e9,
            "fraction_of_copy": nbytes / (ms * 1e-3) / copy, "fraction_min": nbytes / (max(times) * 1e-3) / copy,
            "fraction_max": nbytes / (min(times) * 1e-3) / copy}


def _sweep_line(row: dict, spread: bool) -> str:
    op = row["op"] if not row["op"].endswith(" (torch)") else "  torch: " + row["op"][:-len(" (torch)")]
    line = f"{op:<36} {row['n']:>6} {row['ms']:>8.4f} {row['gbps']:>7.0f} {row['fraction_of_copy']:>7.3f}"
    return line + (f"  [{row['fraction_min']:.3f}, {row['fraction_max']:.3f}]" if spread else "")


HOST_SHAPES = ((1, 4096), (8, 4096), (128, 4096), (4096, 4096))
HOST_OPS = ("layer_norm", "rms_norm", "layer_norm_backward", "rms_norm_backward", "attention_delta")
DELTA_HEAD_DIM = 128  # attention_delta's rows for a host shape (M, N): (M * N / 128, 128)


def host_cases(shape: tuple, dtype: str = "bfloat16"):
    """Yields (op, {variant: fn}) for every op of HOST_OPS at one shape:
    cunorm on CuPy arrays, cunorm on torch tensors, and torch's own op when
    torch is installed and has it (see `torch_native`)."""
    import cupy

    from .attention_delta import attention_delta
    from .norm import layer_norm, layer_norm_backward, rms_norm, rms_norm_backward

    n = shape[-1]
    dt = dtypes.numpy_dtype(dtype)
    gen = cupy.random.default_rng(0)
    cx, cdy = (gen.standard_normal(shape, dtype=np.float32).astype(dt) for _ in range(2))
    cw, cb = (gen.standard_normal(n, dtype=np.float32).astype(dt) for _ in range(2))
    _, cmean, crstd = layer_norm(cx, cw, cb, return_stats=True)
    _, crms = rms_norm(cx, cw, return_stats=True)
    co, cg = cx.reshape(-1, DELTA_HEAD_DIM), cdy.reshape(-1, DELTA_HEAD_DIM)
    c = dict(x=cx, dy=cdy, w=cw, b=cb, mean=cmean, rstd=crstd, rms=crms, o=co, g=cg)
    to_torch = _torch_from_dlpack()
    t = {k: to_torch(v) for k, v in c.items()} if to_torch is not None else {}
    ours = {
        "layer_norm": lambda a: layer_norm(a["x"], a["w"], a["b"]),
        "rms_norm": lambda a: rms_norm(a["x"], a["w"]),
        "layer_norm_backward": lambda a: layer_norm_backward(a["dy"], a["x"], a["mean"], a["rstd"], a["w"]),
        "rms_norm_backward": lambda a: rms_norm_backward(a["dy"], a["x"], a["rms"], a["w"]),
        "attention_delta": lambda a: attention_delta(a["o"], a["g"]),
    }
    for op in HOST_OPS:
        fns = {"cunorm (CuPy)": functools.partial(ours[op], c)}
        if t:
            fns["cunorm (torch)"] = functools.partial(ours[op], t)
            native = torch_native(op, t, n)
            if native is not None:
                fns["torch"] = native
        yield op, fns


def run_host(shapes=HOST_SHAPES, dtype: str = "bfloat16", repeat: int = 7, out=sys.stdout) -> dict:
    """Per-call host time of every op through the API, beside torch's (same run)."""
    results = {"gpu": gpu_name(), "dtype": dtype, "rows": []}
    print(f"# {results['gpu']}: microseconds per call, back to back (median [min, max] of {repeat} rounds)",
          file=out)
    print(f"{'op':<22} {'shape':<13} {'variant':<15} {'us/call':>8} {'min':>7} {'max':>7}", file=out)
    with progress(len(shapes) * len(HOST_OPS), "timing calls", out) as (bar, echo):
        for shape in shapes:
            for op, fns in host_cases(shape, dtype):
                for variant, (med, lo, hi) in per_call_us(fns, repeat).items():
                    shown = shape if op != "attention_delta" else (shape[0] * shape[1] // DELTA_HEAD_DIM,
                                                                   DELTA_HEAD_DIM)
                    results["rows"].append({"op": op, "shape": list(shown), "variant": variant, "us": med,
                                            "min": lo, "max": hi})
                    echo(f"{op:<22} {str(shown):<13} {variant:<15} {med:>8.2f} {lo:>7.2f} {hi:>7.2f}")
                bar.update(1)
    return results


GRAPH_SIZES = (768, 1024, 2048, 4096, 8192, 16384, 32768, 65536)


def run_graph(sizes=GRAPH_SIZES, dtype: str = "bfloat16", repeat: int = 20, out=sys.stdout) -> dict:
    """Bandwidth through the API (torch tensors, back-to-back calls timed with
    events) beside the same calls replayed from a CUDA graph, as fractions of
    a same-run copy: what the host path costs at M*N = ELEMENTS."""
    import torch

    copy = copy_bandwidth()
    results = {"gpu": gpu_name(), "copy_gbps": copy / 1e9, "rows": []}
    print(f"# {results['gpu']}: copy {copy / 1e9:.0f} GB/s; API (events around back-to-back calls) vs CUDA graph "
          f"replay, torch tensors", file=out)
    print(f"{'op':<28} {'N':>6} {'API':>7} {'graph':>7} {'API/graph':>9}", file=out)
    with progress(len(sizes) * len(PLAIN_OPS) * len(DIRECTIONS), "API vs graph", out) as (bar, echo):
        for case in norm_cases(sizes, dtype, ops=PLAIN_OPS, as_array=torch.from_dlpack):
            api = median_ms(case.call, repeat)
            graph = graph_ms(case.call, repeat)
            row = {"op": case.op, "n": case.n, "api": case.nbytes / (api * 1e-3) / copy,
                   "graph": case.nbytes / (graph * 1e-3) / copy}
            results["rows"].append(row)
            echo(f"{case.op:<28} {case.n:>6} {row['api']:>7.3f} {row['graph']:>7.3f} "
                 f"{row['api'] / row['graph']:>9.3f}")
            bar.update(1)
    return results


if __name__ == "__main__":
    from .cli import bench

    bench(prog_name="python -m cunorm.bench")
