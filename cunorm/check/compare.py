"""How a case's outputs are judged: tolerances by dtype, relative L2 error against the float64
reference (scaled where terms cancel), fp8 steps, and the Result of one output."""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from .. import dtypes, reference
from ..sweeps import Case


# Relative L2 error allowed for outputs written in each dtype (or computed in it: see `tolerance`).
TOLERANCE = {"float64": 1e-12, "float32": 1e-5, "float16": 1e-3, "bfloat16": 8e-3}


# attention_delta sums in fp32 (fp64 for fp64 inputs) whatever the inputs: tighter than the output-dtype table.
DELTA_TOLERANCE_FP32, DELTA_TOLERANCE = 1e-6, 1e-5


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


def tolerance(output_dtype: str, x_dtype: str) -> float:
    """The error allowed for an output stored in `output_dtype` by a norm
    kernel reading x of `x_dtype`: the output's rounding, or the compute
    type's (fp32, or fp64 for fp64 x) where that is the coarser."""
    return max(TOLERANCE[output_dtype], TOLERANCE[dtypes.compute_dtype(x_dtype)])


def delta_tolerance(out_dtype: str, grad_dtype: str) -> float:
    from ..attention_delta import delta_dtype

    if delta_dtype(out_dtype, grad_dtype) == "float64":
        return TOLERANCE["float64"]
    return DELTA_TOLERANCE_FP32 if (out_dtype, grad_dtype) == ("float32", "float32") else DELTA_TOLERANCE


def rel_l2(out, ref, scale: float = 0.0) -> float:
    """||out - ref|| / max(||ref||, scale) in float64; inf if out has any
    non-finite value. `scale` is the size of the terms the output is a
    difference of, where they can cancel far below it (the backward's dx)."""
    import cupy

    out = cupy.asarray(out).astype(np.float64)
    ref = cupy.asarray(ref).astype(np.float64)
    if out.shape != ref.shape or not bool(cupy.isfinite(out).all()):
        return float("inf")
    denom = max(float(cupy.linalg.norm(ref)), scale)
    return float(cupy.linalg.norm(out - ref)) / (denom if denom > 0 else 1.0)


def delta_scale(o, go) -> float:
    """||rowsum(|o * grad_out|)||, the size of the terms each D is a sum of: an
    fp32 sum is accurate relative to them, not to a row whose terms cancel
    (few terms, K = 3, can cancel to a small D)."""
    return float(abs(np.linalg.norm(abs(reference._f64(o) * reference._f64(go)).sum(axis=-1))))


# fp32 y carries an absolute error of a few ulps of the row's largest terms; scaled to the fp8 range that is
# about FP8_MAX * 2^-20, which near zero exceeds the fp8 grid's spacing (subnormals): the unit there instead.
FP8_FLOOR = 2.0 ** -18


FP8_BITWISE_SHARE = 1e-3  # the share of fp8 elements allowed to differ in their bits from the reference's


def fp8_ulps(got, want, fmt: str) -> float:
    """The largest difference between two fp8 arrays (numpy, ml_dtypes) in units of the format's spacing at
    the larger magnitude of each pair, or of FP8_FLOOR x the format's largest value where that is coarser
    (values near zero, where the fp32 y's rounding outweighs the grid); NaN where one is NaN and the other is
    not, 0 where both are."""
    from ..reference import FP8_MAX

    a, b = np.asarray(got, np.float64), np.asarray(want, np.float64)
    nan_a, nan_b = np.isnan(a), np.isnan(b)
    if (nan_a != nan_b).any():
        return float("nan")
    a, b = np.where(nan_a, 0, a), np.where(nan_b, 0, b)
    man, min_normal = (3, 2.0 ** -6) if FP8_MAX[fmt] == 448.0 else (2, 2.0 ** -14)
    m = np.maximum(np.maximum(abs(a), abs(b)), min_normal)
    spacing = np.maximum(2.0 ** (np.floor(np.log2(m)) - man), FP8_FLOOR * FP8_MAX[fmt])
    return float((abs(a - b) / spacing).max(initial=0.0))


def dx_scale_of(dy, w, zero_centered: bool, rstd) -> float:
    """||rstd * g||, the size of the terms dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
    is made of. Nearly degenerate rows (N = 2: dx ~ eps / var) cancel far below
    it, where fp32 is accurate relative to the terms, not to dx. numpy or CuPy."""
    weight = reference._effective_weight(w, zero_centered)
    g = reference._f64(dy) * (weight if weight is not None else 1.0)
    terms = g * reference._f64(rstd)[..., None]
    return float((terms * terms).sum() ** 0.5)
