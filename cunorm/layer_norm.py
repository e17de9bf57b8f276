"""LayerNorm forward and backward: validate -> pick traits -> compiled kernel -> launch."""
from __future__ import annotations

import math

import numpy as np

from . import arrays, dispatch, dtypes, plan, reference
from .traits import Traits

WEIGHT_DTYPES_NOTE = "the input dtype or float32"


def _weight_dtype(x_dtype: str, args: dict, names: tuple) -> str:
    """Checks weight-like arguments (shape (N,), dtype = x's or fp32, all alike)
    and returns their common dtype (float32 when none is given)."""
    found = None
    for name in names:
        a = args.get(name)
        if a is None:
            continue
        d = arrays.check_dtype(a)
        if d not in (x_dtype, "float32"):
            raise TypeError(f"{name}: dtype {d} must be {WEIGHT_DTYPES_NOTE} ({x_dtype} or float32)")
        if found is not None and d != found[1]:
            raise TypeError(f"{name}: dtype {d} differs from {found[0]}'s {found[1]}")
        found = (name, d)
    return found[1] if found else "float32"


def _hidden_size(x: arrays.Arg) -> int:
    if x.array.ndim < 1:
        raise ValueError(f"{x.name}: needs at least one axis (the normalized last axis), got a 0-d array")
    n = x.array.shape[-1]
    if n == 0:
        raise ValueError(f"{x.name}: the last axis (hidden size) is empty; there is nothing to normalize")
    return n


def _check_eps(eps) -> float:
    try:
        e = float(eps)
    except (TypeError, ValueError):
        raise TypeError(f"eps: expected a float, got {type(eps).__name__}") from None
    if not math.isfinite(e) or e < 0:
        raise ValueError(f"eps: must be finite and >= 0, got {eps}")
    return e


class _Family:
    """LayerNorm's kernel family for cunorm.plan."""

    traits_class = Traits

    @staticmethod
    def choose(arch: int, **base) -> Traits:
        return dispatch.choose(arch=arch, **base)[0]


def _resolve(traits, base: dict, device_id: int):
    return plan.resolve(_Family, traits, base, device_id)


def _gpu_layout(n: int, args: dict):
    """What the kernels assume of GPU arrays, checked before any compile:
    a hidden size that is a multiple of 8, C-contiguous arrays."""
    if n % 8:
        raise ValueError(f"x: hidden size {n} is not a multiple of 8; other sizes come with the "
                         f"general kernel and are not supported on the GPU yet")
    for a in args.values():
        if a is not None and not a.array.flags.c_contiguous:
            raise ValueError(f"{a.name}: must be C-contiguous (strided layouts are not supported on the GPU yet); "
                             f"pass a contiguous copy")


def _gpu_alignment(traits: Traits, args: dict):
    """Row-vector arguments aligned to the chosen vector loads (mean and rstd are read singly)."""
    for a in args.values():
        if a is not None:
            vector_bytes = traits.elts_per_ldg * a.array.itemsize if a.name not in ("mean", "rstd") else 4
            arrays.check_aligned(a, min(16, vector_bytes))


def _grid_groups(kernel, traits: Traits, rows: int) -> int:
    """Row groups in a persistent grid: one wave of CTAs, each walking many
    rows (prefetching the next while reducing the current one)."""
    groups = -(-rows // traits.rows_per_cta)
    return min(groups, max(1, kernel.sm_count * kernel.blocks_per_sm // traits.ctas_per_row))


def _null():
    return np.uint64(0)


def _arr(arg):
    return None if arg is None else arg.array


def _ptr(a):
    return _null() if a is None else a


def layer_norm(x, weight=None, bias=None, eps=1e-5, *, return_stats=False, out_dtype=None, traits=None):
    """LayerNorm over the last axis of `x`: (x - mean) / sqrt(var + eps) * weight + bias.

    Returns y (in `out_dtype`, default x's dtype), or (y, mean, rstd) with
    `return_stats=True` (float32, shape x.shape[:-1]). GPU arrays run the CUDA
    kernels on the current CuPy stream of x's device; numpy arrays run the
    float64 reference and return numpy arrays. eps >= 0 (with eps = 0 a constant
    row has rstd = inf, as in other frameworks).
    """
    args, on_gpu = arrays.take_all({"x": x}, {"weight": weight, "bias": bias})
    X = args["x"]
    x_dtype = arrays.check_dtype(X)
    n = _hidden_size(X)
    for name in ("weight", "bias"):
        if args[name] is not None:
            arrays.check_shape(args[name], (n,), "x's last axis")
    w_dtype = _weight_dtype(x_dtype, args, ("weight", "bias"))
    y_dtype = dtypes.name_of(out_dtype) if out_dtype is not None else x_dtype
    eps = _check_eps(eps)
    lead = tuple(X.array.shape[:-1])
    W, B = args["weight"], args["bias"]

    if not on_gpu:
        y, mean, rstd = reference.layer_norm(X.array, _arr(W), _arr(B), eps)
        y = y.astype(dtypes.numpy_dtype(y_dtype))
        return (y, mean.astype(np.float32), rstd.astype(np.float32)) if return_stats else y

    import cupy

    dev = X.array.device.id
    base = dict(hidden_size=n, input_dtype=x_dtype, weight_dtype=w_dtype, output_dtype=y_dtype,
                has_weight=W is not None, has_bias=B is not None, backward=False)
    _gpu_layout(n, args)
    with cupy.cuda.Device(dev):
        t, kernels = _resolve(traits, base, dev)
        _gpu_alignment(t, args)
        rows = math.prod(lead)
        y = cupy.empty(lead + (n,), dtype=dtypes.numpy_dtype(y_dtype))
        stats = cupy.empty((2,) + lead, dtype=np.float32) if return_stats else None  # one allocation
        mean, rstd = (stats[0], stats[1]) if return_stats else (None, None)
        if rows:
            k = kernels["layer_norm_fwd"]
            grid = _grid_groups(k, t, rows) * t.ctas_per_row
            k(grid, (X.array, _ptr(_arr(W)), _ptr(_arr(B)), y, _ptr(mean), _ptr(rstd),
                     np.int64(rows), np.int64(n), np.int64(n), np.float32(eps)))
    return (y, mean, rstd) if return_stats else y


def layer_norm_backward(dy, x, mean, rstd, weight=None, *, has_bias=True, traits=None):
    """Gradients of `layer_norm` given dy and the forward's saved mean and rstd.

    Returns (dx, dweight, dbias): dx in x's dtype; dweight (None without a
    weight) and dbias (None unless has_bias) in the weight's dtype, float32
    without a weight; accumulated in fp32, bitwise reproducible run to run.
    """
    args, on_gpu = arrays.take_all({"dy": dy, "x": x, "mean": mean, "rstd": rstd}, {"weight": weight})
    X, DY = args["x"], args["dy"]
    x_dtype = arrays.check_dtype(X)
    n = _hidden_size(X)
    dy_dtype = arrays.check_dtype(DY)
    arrays.check_shape(DY, X.array.shape, "x's shape")
    lead = tuple(X.array.shape[:-1])
    for name in ("mean", "rstd"):
        arrays.check_dtype(args[name], ("float32",))
        arrays.check_shape(args[name], lead, "x.shape[:-1]")
    W = args["weight"]
    if W is not None:
        arrays.check_shape(W, (n,), "x's last axis")
    w_dtype = _weight_dtype(x_dtype, args, ("weight",))

    if not on_gpu:
        dx, dw, db = reference.layer_norm_backward(DY.array, X.array, args["mean"].array, args["rstd"].array,
                                                   _arr(W))
        wt = dtypes.numpy_dtype(w_dtype)
        return (dx.astype(X.array.dtype), None if dw is None else dw.astype(wt),
                db.astype(wt) if has_bias else None)

    import cupy

    dev = X.array.device.id
    base = dict(hidden_size=n, input_dtype=x_dtype, weight_dtype=w_dtype, output_dtype=dy_dtype,
                has_weight=W is not None, has_bias=bool(has_bias), backward=True)
    _gpu_layout(n, args)
    with cupy.cuda.Device(dev):
        t, kernels = _resolve(traits, base, dev)
        _gpu_alignment(t, args)
        rows = math.prod(lead)
        wt = dtypes.numpy_dtype(w_dtype)
        dx = cupy.empty(X.array.shape, dtype=X.array.dtype)
        grads = cupy.empty((2, n), dtype=wt) if (t.has_weight or t.has_bias) else None  # one allocation
        dweight = grads[0] if t.has_weight else None
        dbias = grads[1] if t.has_bias else None
        if rows == 0:  # no rows: empty dx, and the column sums of nothing are zero
            for a in (dweight, dbias):
                if a is not None:
                    a.fill(0)
            return dx, dweight, dbias
        k = kernels["layer_norm_bwd"]
        parts = _grid_groups(k, t, rows)
        partials = cupy.empty((2, parts, n), dtype=np.float32) if (t.has_weight or t.has_bias) else None
        dgamma_part, dbeta_part = (None, None) if partials is None else (partials[0], partials[1])
        k(parts * t.ctas_per_row,
          (DY.array, X.array, args["mean"].array, args["rstd"].array, _ptr(_arr(W)), dx,
           _ptr(dgamma_part), _ptr(dbeta_part),
           np.int64(rows), np.int64(n), np.int64(n), np.int64(n)))
        if partials is not None:
            fin = kernels["layer_norm_bwd_finalize"]
            fin(-(-n // t.finalize_cols_per_cta),
                (dgamma_part, dbeta_part, np.int32(parts), _ptr(dweight), _ptr(dbias)))
    return dx, dweight, dbias
