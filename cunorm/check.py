"""The correctness checker behind `cunorm check` and the GPU test tier.

Each case draws fresh random inputs (never zeros; rows offset from zero so a
one-pass variance would show), poisons every allocation the op makes with NaN
bytes (so an unwritten element cannot pass), runs the op on the GPU and
compares each output with the float64 reference by relative L2 error.
"""
from __future__ import annotations

import contextlib
import itertools
from dataclasses import asdict, dataclass

import numpy as np

from . import dispatch, dtypes, reference

# Relative L2 error allowed for outputs written in each dtype.
TOLERANCE = {"float32": 1e-5, "float16": 1e-3, "bfloat16": 8e-3}
# attention_delta sums in fp32 whatever the inputs: tighter than the output-dtype table.
DELTA_TOLERANCE_FP32, DELTA_TOLERANCE = 1e-6, 1e-5
DEFAULT_ROWS = (1, 37, 4096)
HEURISTIC_SAMPLE = (8, 40, 200, 1000, 1160, 4104, 7168)


DELTA_HEAD_DIMS = (1, 3, 8, 63, 64, 80, 96, 128, 192, 256, 512)
OPS = ("layer_norm", "layer_norm_backward", "attention_delta")


@dataclass(frozen=True)
class Case:
    """One checker case. For attention_delta, hidden_size is the head dim,
    dtype the dtype of `out` and weight_dtype that of `grad_out`."""

    op: str  # one of OPS
    hidden_size: int
    rows: int
    dtype: str
    weight_dtype: str
    has_weight: bool = True
    has_bias: bool = True

    def label(self) -> str:
        if self.op == "attention_delta":
            return f"{self.op} K={self.hidden_size} M={self.rows} out={self.dtype} grad={self.weight_dtype}"
        flags = ("" if self.has_weight else " no-weight") + ("" if self.has_bias else " no-bias")
        return f"{self.op} N={self.hidden_size} M={self.rows} x={self.dtype} w={self.weight_dtype}{flags}"


@dataclass(frozen=True)
class Result:
    case: Case
    output: str
    error: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return bool(self.error <= self.tolerance)  # NaN compares False

    def as_dict(self) -> dict:
        return {**asdict(self.case), "output": self.output, "error": self.error, "tolerance": self.tolerance,
                "ok": self.ok}


def rel_l2(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64; inf if out has any non-finite value."""
    import cupy

    out = cupy.asarray(out).astype(np.float64)
    ref = cupy.asarray(ref).astype(np.float64)
    if out.shape != ref.shape or not bool(cupy.isfinite(out).all()):
        return float("inf")
    denom = float(cupy.linalg.norm(ref))
    return float(cupy.linalg.norm(out - ref)) / (denom if denom > 0 else 1.0)


@contextlib.contextmanager
def poisoned_allocations():
    """Every CuPy allocation inside is filled with 0xFF bytes: NaN in fp32,
    fp16 and bf16 alike."""
    import cupy

    allocator = cupy.cuda.get_allocator()

    def malloc(size):
        mem = allocator(size)
        if size:
            cupy.cuda.runtime.memsetAsync(mem.ptr, 0xFF, size, cupy.cuda.get_current_stream().ptr)
        return mem

    cupy.cuda.set_allocator(malloc)
    try:
        yield
    finally:
        cupy.cuda.set_allocator(allocator)


def default_cases(sizes=None, rows=DEFAULT_ROWS, dtypes_=dtypes.NAMES, ops=OPS, heuristic=True) -> list:
    """LayerNorm: tuned sizes (plus a heuristic sample) x dtypes x {input-dtype,
    fp32} weights x rows. attention_delta: head dims x every (out, grad_out)
    dtype pair x rows. `sizes` replaces both size lists."""
    ln_sizes = tuple(sizes) if sizes else dispatch.TUNED_SIZES + (HEURISTIC_SAMPLE if heuristic else ())
    cases = []
    for op in ops:
        if op == "attention_delta":
            for k, dt, gdt, m in itertools.product(tuple(sizes) if sizes else DELTA_HEAD_DIMS, dtypes_, dtypes_,
                                                   rows):
                cases.append(Case(op, k, m, dt, gdt))
            continue
        for n, dt, m in itertools.product(ln_sizes, dtypes_, rows):
            for wdt in dict.fromkeys((dt, "float32")):
                cases.append(Case(op, n, m, dt, wdt))
    return cases


def _gpu_rng(rng):
    """A CuPy generator seeded from `rng`: inputs are drawn on the GPU (fast at
    4096 x 65536), and still follow the run's seed."""
    import cupy

    return cupy.random.RandomState(int(rng.integers(2**63)))


def delta_inputs(gen, rows: int, k: int, out_dtype: str, grad_dtype: str):
    """out ~ N(0, 1) and grad_out = out + N(0, 0.5^2): each row's dot product is
    well away from zero. With independent inputs a single row's sum can cancel
    to near zero, where no fp32 summation meets a relative bound."""
    o = gen.standard_normal((rows, k), dtype="float32")
    go = o + 0.5 * gen.standard_normal((rows, k), dtype="float32")
    return o.astype(dtypes.numpy_dtype(out_dtype)), go.astype(dtypes.numpy_dtype(grad_dtype))


def _inputs(case: Case, rng):
    m, n = case.rows, case.hidden_size
    dt, wdt = dtypes.numpy_dtype(case.dtype), dtypes.numpy_dtype(case.weight_dtype)
    g = _gpu_rng(rng)
    sign = g.randint(0, 2, size=(m, 1)) * 2.0 - 1.0
    shift = sign * g.uniform(1, 3, size=(m, 1))  # rows far from zero mean
    x = (g.standard_normal((m, n), dtype="float32") * float(rng.uniform(0.5, 2.0)) + shift).astype(dt)
    w = (1.0 + 0.5 * g.standard_normal(n, dtype="float32")).astype(wdt) if case.has_weight else None
    b = (0.5 * g.standard_normal(n, dtype="float32")).astype(wdt) if case.has_bias else None
    return x, w, b


def run_case(case: Case, rng=None) -> list:
    """Runs one case on the current GPU; a Result per output."""
    from .attention_delta import attention_delta
    from .layer_norm import layer_norm, layer_norm_backward

    rng = rng or np.random.default_rng()
    if case.op == "attention_delta":
        o, go = delta_inputs(_gpu_rng(rng), case.rows, case.hidden_size, case.dtype, case.weight_dtype)
        with poisoned_allocations():
            d = attention_delta(o, go)
        tol = DELTA_TOLERANCE_FP32 if (case.dtype, case.weight_dtype) == ("float32", "float32") else DELTA_TOLERANCE
        return [Result(case, "delta", rel_l2(d, reference.attention_delta(o, go)), tol)]
    x, w, b = _inputs(case, rng)
    eps = 1e-5
    y_ref, mean_ref, rstd_ref = reference.layer_norm(x, w, b, eps)
    results = []
    if case.op == "layer_norm":
        with poisoned_allocations():
            y, mean, rstd = layer_norm(x, w, b, eps, return_stats=True)
        results += [Result(case, "y", rel_l2(y, y_ref), TOLERANCE[case.dtype]),
                    Result(case, "mean", rel_l2(mean, mean_ref), TOLERANCE["float32"]),
                    Result(case, "rstd", rel_l2(rstd, rstd_ref), TOLERANCE["float32"])]
    elif case.op == "layer_norm_backward":
        dy = _gpu_rng(rng).standard_normal(x.shape, dtype="float32").astype(dtypes.numpy_dtype(case.dtype))
        mean, rstd = mean_ref.astype(np.float32), rstd_ref.astype(np.float32)
        with poisoned_allocations():
            dx, dw, db = layer_norm_backward(dy, x, mean, rstd, w, has_bias=case.has_bias)
        dx_ref, dw_ref, db_ref = reference.layer_norm_backward(dy, x, mean, rstd, w)
        results.append(Result(case, "dx", rel_l2(dx, dx_ref), TOLERANCE[case.dtype]))
        if case.has_weight:
            results.append(Result(case, "dweight", rel_l2(dw, dw_ref), TOLERANCE[case.weight_dtype]))
        if case.has_bias:
            results.append(Result(case, "dbias", rel_l2(db, db_ref), TOLERANCE[case.weight_dtype]))
    else:
        raise ValueError(f"unknown op {case.op!r}")
    return results
