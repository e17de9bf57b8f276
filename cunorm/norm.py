"""LayerNorm and RMSNorm, forward and backward.

Every public function is a thin front of `_forward` or `_backward`, which
validate -> lay the arrays out as rows (`cunorm.layout`) -> pick traits ->
compile (cached) -> launch. `explain` runs the same preparation and reports
what would run, and why, without launching anything.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from . import arrays, dispatch, dtypes, layout, plan, reference
from .traits import Traits

ABSENT_DTYPE = "float32"  # the dtype named for an absent weight, bias or residual (keeps one compile per shape)


class _Family:
    """The normalization kernel family, for cunorm.plan."""

    traits_class = Traits

    @staticmethod
    def choose(arch: int, **call) -> Traits:
        return dispatch.choose(arch=arch, **call)[0]

    @staticmethod
    def from_knobs(knobs: dict, **call) -> Traits:
        return dispatch.from_knobs(knobs, **call)


# -- validation -----------------------------------------------------------------

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


def _vector_arg(a, n: int) -> str:
    """Checks a weight-like argument (shape (N,), any dtype of ours, any
    non-negative stride) and returns its dtype name; ABSENT_DTYPE for None."""
    if a is None:
        return ABSENT_DTYPE
    d = arrays.check_dtype(a)
    arrays.check_shape(a, (n,), "x's last axis")
    return d


def _kernel_weight(a, t: Traits) -> tuple:
    """(array, stride in elements) of a weight as the kernel reads it. The
    general kernel reads any non-negative stride (0 broadcasts one value) in
    place; the aligned kernel loads whole vectors, so a strided, broadcast or
    unaligned weight is copied for it (N elements, documented)."""
    if a is None:
        return np.uint64(0), np.int64(0)
    w = a.array
    stride = w.strides[0] // w.itemsize if w.shape[0] > 1 else 1
    if t.aligned_rows and (stride != 1 or w.data.ptr % min(16, t.elts_per_ldg * w.itemsize)):
        import cupy

        w, stride = cupy.array(w, copy=True), 1  # a fresh allocation: contiguous and aligned
    return w, np.int64(stride)


def _dtype_arg(name: str, value, default: str) -> str:
    if value is None:
        return default
    try:
        return dtypes.name_of(value)
    except ValueError as e:
        raise TypeError(f"{name}: {e}") from None


def _zero_centered(flag, weight):
    if flag and weight is None:
        raise ValueError("zero_centered_weight: needs a weight (the multiplier is 1 + weight)")
    return bool(flag)


def _out_dtype(out, out_dtype, default: str, what: str) -> str:
    """The dtype of an output that may be given (`out=`) or asked for (`out_dtype=`)."""
    want = _dtype_arg("out_dtype", out_dtype, None) if out_dtype is not None else None
    if out is None:
        return want or default
    have = arrays.check_dtype(out)
    if want is not None and want != have:
        raise TypeError(f"out: dtype {have} differs from out_dtype {want}")
    if what and have != default:
        raise TypeError(f"out: dtype {have} must be {what} ({default})")
    return have


def call_base(*, rms: bool, backward: bool, hidden_size: int, input_dtype: str, output_dtype: str,
              weight_dtype: str | None, bias_dtype: str | None, residual_dtype: str | None,
              zero_centered: bool, residual_out_dtype: str | None = None) -> dict:
    """The dispatch fields of a call (absent arguments: None dtypes). The
    residual read (forward) or dresidual (backward) and the residual_out
    written (forward only) are two tensors with a dtype each: residual_out
    defaults to the residual's dtype."""
    if residual_out_dtype is not None and (backward or residual_dtype is None):
        raise ValueError("residual_out_dtype: only a forward call with a residual writes residual_out")
    return dict(hidden_size=hidden_size, input_dtype=input_dtype, output_dtype=output_dtype,
                weight_dtype=weight_dtype or ABSENT_DTYPE, bias_dtype=bias_dtype or ABSENT_DTYPE,
                residual_dtype=residual_dtype or ABSENT_DTYPE,
                residual_out_dtype=ABSENT_DTYPE if backward else (residual_out_dtype or residual_dtype
                                                                  or ABSENT_DTYPE),
                has_weight=weight_dtype is not None, has_bias=bias_dtype is not None, rms=rms,
                has_residual=residual_dtype is not None, zero_centered=zero_centered, backward=backward)


def _result(values: list):
    return values[0] if len(values) == 1 else tuple(values)


# -- the GPU plumbing both directions share ----------------------------------------

@dataclass
class _Prepared:
    """A validated GPU call: its row tensors (outputs to be allocated stand in
    as fresh contiguous rows), the dispatch call and what explain reports."""

    base: dict
    rows: dict  # name -> layout.Rows (None: absent)
    n: int
    row_count: int
    in_place: dict = field(default_factory=dict)

    def row_list(self) -> list:
        return [r for r in self.rows.values() if r is not None]

    def resolve(self, traits, device_id: int):
        return plan.resolve(_Family, traits, self.base, device_id)

    def grid_groups(self, kernel, t: Traits) -> int:
        """Row groups of a persistent grid: one wave of CTAs, each walking many
        rows; a multiple of the shift period (general kernel), so that every
        row of a thread sits at the same offset from a vector boundary."""
        groups = -(-self.row_count // t.rows_per_cta)
        groups = min(groups, kernel.resident_clusters)  # a row group is one cluster (of CTAS_PER_ROW CTAs)
        x = self.rows["x"]
        period = 1 if t.aligned_rows else layout.shift_period(x.ld, x.rows, t.elts_per_ldg)
        step = period // math.gcd(period, t.rows_per_cta)
        # Down to whole periods (CTAs left over would run as a second wave, doubling the time), or up to one.
        return max(step, groups // step * step)


@dataclass(frozen=True)
class _Direction:
    """What a direction's call lays out and checks its `out=` against, stated
    once for both the first call (`_prepare`) and a cached plan (`_cached_out`)."""

    arrays: tuple  # a call's arrays, in signature order ("out" last)
    row_inputs: tuple  # inputs read as row tensors, x first
    weights: tuple  # weight-like inputs (vectors, statistics): read, never written
    in_place: dict  # {output name: the inputs it may be exactly}


_FORWARD = _Direction(("x", "weight", "bias", "residual", "out"), ("x", "residual"), ("weight", "bias"),
                      {"out": ("x",)})
_BACKWARD = _Direction(("dy", "x", "mean", "rstd", "weight", "dresidual", "out"), ("x", "dy", "dresidual"),
                       ("weight", "mean", "rstd"), {"out": ("dy", "dresidual")})


def _check_outputs(d: _Direction, outputs: list, rows: dict, args: dict, n: int):
    """`layout.check_outputs` of given outputs (row views) against the row
    inputs' views `rows` and the weight-like arguments, in the direction's order."""
    weights = [w for w in (args.get(k) for k in d.weights) if w is not None]
    layout.check_outputs(outputs, [r for r in rows.values() if r is not None] + weights, n, d.in_place)


def _prepare(d: _Direction, args: dict, outputs: dict, n: int, base: dict) -> _Prepared:
    """Row views of the inputs (copies for layouts the kernels cannot read),
    given outputs checked for overlap, the vector widths the layout allows."""
    for k in d.weights:
        if args.get(k) is not None:
            layout.check_elements(args[k])
    rows = {name: None if args.get(name) is None else layout.rows_of(args[name], n) for name in d.row_inputs}
    out_rows = {}
    offset = layout.mirrored_offset(rows["x"], dtypes.itemsize(base["input_dtype"]))
    for name, given in outputs.items():
        out_rows[name] = (layout.rows_of(given, n, output=True) if given is not None
                          else layout.fresh_rows(name, rows["x"].rows, n, offset))
    _check_outputs(d, [r for r in out_rows.values() if r.array is not None], rows, args, n)
    rows.update(out_rows)
    present = [r for r in rows.values() if r is not None]
    max_vector, aligned_vector = layout.vector_widths(present, n, dtypes.itemsize(base["input_dtype"]))
    base = dict(base, max_vector=max_vector, aligned_vector=aligned_vector)
    return _Prepared(base, rows, n, rows["x"].rows, d.in_place)


def _cached_out(p: _Prepared, d: _Direction, args: dict) -> _Prepared:
    """A cached plan for a call with `out=`: the out's row view (its layout is
    the cached one; only the pointer is new), checked for overlap as `_prepare`
    checks it, the one rule that depends on addresses. When out's extent meets
    no input's (the common case) nothing can overlap; otherwise the full check
    runs. Cached plans read their inputs in place."""
    o = args["out"].array
    inputs = [args[k].array for k in d.row_inputs + d.weights if args.get(k) is not None]
    if not layout.extents_disjoint(o, inputs):
        rows = {name: layout.rows_of(args[name], p.n) for name in d.row_inputs if args[name] is not None}
        _check_outputs(d, [layout.rows_of(args["out"], p.n, output=True)], rows, args, p.n)
    out = dataclasses.replace(p.rows["out"], array=o, offset=o.data.ptr // o.itemsize)
    return dataclasses.replace(p, rows={**p.rows, "out": out})


def _alloc(prepared: _Prepared, name: str, shape: tuple, dtype: str):
    """The output array `name`: the given one, or a new C-contiguous array
    (placed as its fresh row view says)."""
    r = prepared.rows[name]
    if r.array is not None:
        return r.array
    return layout.allocate(r, shape, dtypes.numpy_dtype(dtype))


def _ptr(a):
    return np.uint64(0) if a is None else a


def _ld(r) -> np.int64:
    return np.int64(0 if r is None else r.ld)


def _arr(a):
    return None if a is None else a.array


# Plans of GPU calls already validated and laid out, by call signature: a
# repeated call (same shapes, strides, dtypes, 16-byte alignment and device of
# every array, `out=` included, and same flags) skips validation, layout and
# dispatch. Calls that copy an input are never cached. Whether `out=` overlaps
# an input depends on addresses, so a cache hit with `out=` redoes that check
# (`_cached_out`).
_PLANS: dict = {}
MAX_PLANS = 4096


def _signature(values: tuple, flags: tuple):
    """The cache key of a call, or None when it is not cacheable (numpy or
    DLPack inputs, knob values that are not hashable)."""
    import cupy

    if isinstance(flags[-1], Mapping):  # traits= as a mapping of knobs: keyed by its items
        try:
            flags = (*flags[:-1], frozenset(flags[-1].items()))
            hash(flags)
        except TypeError:
            return None
    key = [flags]
    for a in values:
        if a is None:
            key.append(None)
        elif type(a) is cupy.ndarray:
            key.append((a.shape, a.strides, a.dtype, a.data.ptr % 16, a.data.device_id))
        else:
            return None
    return tuple(key)


def _plan_of(key, prepared: _Prepared, t: Traits, kernels: dict, base: dict):
    """Caches a plan (without the call's arrays) under `key`, where allowed."""
    if key is None or any(r.copied for r in prepared.row_list()) or len(_PLANS) >= MAX_PLANS:
        return
    rows = {name: None if r is None else dataclasses.replace(r, array=None) for name, r in prepared.rows.items()}
    _PLANS[key] = (dataclasses.replace(prepared, rows=rows), t, kernels, base)


def _input(p: _Prepared, args: dict, name: str):
    """The array the kernel reads for input `name`: the call's own, or its contiguous copy."""
    r = p.rows[name]
    if r is None:
        return None
    return r.array if r.copied else args[name].array


def _cached_args(names: tuple, values: tuple) -> dict:
    """Arguments of a call whose signature matched a cached plan (so already known to be GPU arrays)."""
    return {name: None if a is None else arrays.Arg(name, a, True) for name, a in zip(names, values)}


def _cached_plan(d: _Direction, values: tuple, flags: tuple) -> tuple:
    """(key, hit) of a call whose arrays are `values` (in d.arrays order):
    its cache key, and on a hit (plan, traits, kernels, base, args) ready to
    launch, a given `out=` checked for overlap; hit is None otherwise."""
    key = _signature(values, flags)
    hit = _PLANS.get(key) if key is not None else None
    if hit is None:
        return key, None
    p, t, kernels, base = hit
    args = _cached_args(d.arrays, values)
    if args["out"] is not None:
        p = _cached_out(p, d, args)
    return key, (p, t, kernels, base, args)


# -- forward ----------------------------------------------------------------------

def _forward_args(rms, x, weight, bias, eps, residual, residual_dtype, zero_centered_weight, out_dtype, out):
    """Validates a forward call. Returns (args, on_gpu, base, eps)."""
    args, on_gpu = arrays.take_all({"x": x}, {"weight": weight, "bias": bias, "residual": residual, "out": out})
    X, W, B, R, O = (args[k] for k in ("x", "weight", "bias", "residual", "out"))
    x_dtype = arrays.check_dtype(X)
    n = _hidden_size(X)
    w_dtype, b_dtype = _vector_arg(W, n), _vector_arg(B, n)
    if R is not None:
        arrays.check_dtype(R)
        arrays.check_shape(R, X.array.shape, "x's shape")
    elif residual_dtype is not None:
        raise ValueError("residual_dtype: given without a residual")
    res_dtype = R.dtype_name if R is not None else None  # the residual as read
    res_out_dtype = _dtype_arg("residual_dtype", residual_dtype, res_dtype)  # residual_out as written
    if O is not None:
        arrays.check_shape(O, X.array.shape, "x's shape")
    y_dtype = _out_dtype(O, out_dtype, x_dtype, "")
    base = call_base(rms=rms, backward=False, hidden_size=n, input_dtype=x_dtype, output_dtype=y_dtype,
                     weight_dtype=w_dtype if W is not None else None, bias_dtype=b_dtype if B is not None else None,
                     residual_dtype=res_dtype, residual_out_dtype=res_out_dtype,
                     zero_centered=_zero_centered(zero_centered_weight, W))
    return args, on_gpu, base, _check_eps(eps)


def _forward_prepare(args, base) -> _Prepared:
    O = args["out"]
    outputs = {"y" if O is None else "out": O}
    if args["residual"] is not None:
        outputs["residual_out"] = None
    return _prepare(_FORWARD, args, outputs, base["hidden_size"], base)


def _forward(rms, x, weight, bias, eps, *, residual, residual_dtype, zero_centered_weight, return_stats, out_dtype,
             out, traits):
    key, hit = _cached_plan(_FORWARD, (x, weight, bias, residual, out),
                            (rms, residual_dtype, bool(zero_centered_weight), out_dtype, traits))
    if hit is not None:
        return _forward_launch(*hit, _check_eps(eps), rms, return_stats)
    args, on_gpu, base, eps = _forward_args(rms, x, weight, bias, eps, residual, residual_dtype,
                                            zero_centered_weight, out_dtype, out)
    X, W, B, R, O = (args[k] for k in _FORWARD.arrays)
    zc = base["zero_centered"]
    if not on_gpu:
        h = reference.add_residual(X.array, _arr(R))
        if rms:
            y, rstd = reference.rms_norm(h, _arr(W), eps, zero_centered_weight=zc)
            stats = [rstd]
        else:
            y, mean, rstd = reference.layer_norm(h, _arr(W), _arr(B), eps, zero_centered_weight=zc)
            stats = [mean, rstd]
        y = y.astype(dtypes.numpy_dtype(base["output_dtype"]))
        if O is not None:
            O.array[...] = y
            y = O.array
        values = [y]
        if R is not None:
            values.append(h.astype(dtypes.numpy_dtype(base["residual_out_dtype"])))
        if return_stats:
            values += [s.astype(np.float32) for s in stats]
        return _result(values)

    import cupy

    dev = X.array.data.device_id
    with cupy.cuda.Device(dev):
        p = _forward_prepare(args, base)
        t, kernels = p.resolve(traits, dev)
    _plan_of(key, p, t, kernels, base)
    return _forward_launch(p, t, kernels, base, args, eps, rms, return_stats)


def _forward_launch(p: _Prepared, t: Traits, kernels: dict, base: dict, args: dict, eps: float, rms: bool,
                    return_stats: bool):
    import cupy

    X, W, B, R, O = (args[k] for k in _FORWARD.arrays)
    lead = tuple(X.array.shape[:-1])
    with cupy.cuda.Device(X.array.data.device_id):
        y_name = "y" if O is None else "out"
        y = _alloc(p, y_name, X.array.shape, base["output_dtype"])
        residual_out = _alloc(p, "residual_out", X.array.shape, base["residual_out_dtype"]) if R is not None else None
        stats = cupy.empty((1 if rms else 2,) + lead, dtype=np.float32) if return_stats else None  # one allocation
        mean = stats[0] if return_stats and not rms else None
        rstd = stats[-1] if return_stats else None
        if p.row_count:
            k = kernels["norm_fwd"]
            xr, rr = p.rows["x"], p.rows["residual"]
            (w, w_stride), (b, b_stride) = _kernel_weight(W, t), _kernel_weight(B, t)
            grid = p.grid_groups(k, t) * t.ctas_per_row
            k(grid, (_input(p, args, "x"), _ptr(_input(p, args, "residual")), w, b, y, _ptr(residual_out), _ptr(mean),
                     _ptr(rstd),
                     np.int64(p.row_count), _ld(xr), _ld(rr), _ld(p.rows[y_name]), _ld(p.rows.get("residual_out")),
                     w_stride, b_stride, np.float32(eps)))
    values = [y]
    if R is not None:
        values.append(residual_out)
    if return_stats:
        values += [rstd] if rms else [mean, rstd]
    return _result(values)


def layer_norm(x, weight=None, bias=None, eps=1e-5, *, residual=None, residual_dtype=None,
               zero_centered_weight=False, return_stats=False, out_dtype=None, out=None, traits=None):
    """LayerNorm over the last axis: y = (h - mean) / sqrt(var + eps) * w + bias,
    where h = x, or h = x + residual (summed in fp32) when a residual is given,
    and w = weight, or 1 + weight with `zero_centered_weight=True` (in fp32).

    Returns y (in `out_dtype`, default x's dtype; written into `out` when given,
    which may be x itself). With a residual, (y, residual_out) where
    residual_out = h in `residual_dtype` (default the residual's dtype). With
    `return_stats=True`, mean and rstd (float32, shape x.shape[:-1]) follow.

    x, residual and out: any hidden size, read and written in place when the
    last axis has unit stride and the leading axes merge into one row stride
    (other input layouts are copied first). weight and bias: optional, any
    dtype of fp32/fp16/bf16 each, any non-negative stride (0 broadcasts one
    value). GPU arrays run on the current CuPy stream of x's device; numpy
    arrays run the float64 reference. eps >= 0; a row of one element
    normalizes to 0 (y = bias). NaN or inf in a row makes that row's outputs NaN.
    `traits`: a cunorm.Traits or a mapping of its knobs, to force a kernel.
    """
    return _forward(False, x, weight, bias, eps, residual=residual, residual_dtype=residual_dtype,
                    zero_centered_weight=zero_centered_weight, return_stats=return_stats, out_dtype=out_dtype,
                    out=out, traits=traits)


def rms_norm(x, weight=None, eps=1e-6, *, residual=None, residual_dtype=None, zero_centered_weight=False,
             return_stats=False, out_dtype=None, out=None, traits=None):
    """RMSNorm over the last axis: y = h * rstd * w with rstd = 1 / sqrt(mean(h^2) + eps),
    h = x or x + residual (fp32), w = weight or 1 + weight (`zero_centered_weight`).

    Returns y; with a residual (y, residual_out); with `return_stats=True` the
    float32 rstd is appended. Layouts, dtypes, `out=` and `traits=` as in
    `layer_norm`.
    """
    return _forward(True, x, weight, None, eps, residual=residual, residual_dtype=residual_dtype,
                    zero_centered_weight=zero_centered_weight, return_stats=return_stats, out_dtype=out_dtype,
                    out=out, traits=traits)


# -- backward ---------------------------------------------------------------------

def _backward_args(rms, dy, x, mean, rstd, weight, has_bias, bias_dtype, dresidual, zero_centered_weight, out):
    """Validates a backward call. Returns (args, on_gpu, base)."""
    required = {"dy": dy, "x": x} | ({} if rms else {"mean": mean}) | {"rstd": rstd}
    args, on_gpu = arrays.take_all(required, {"weight": weight, "dresidual": dresidual, "out": out})
    X, DY, W, DR, O = (args.get(k) for k in ("x", "dy", "weight", "dresidual", "out"))
    x_dtype = arrays.check_dtype(X)
    n = _hidden_size(X)
    dy_dtype = arrays.check_dtype(DY)
    arrays.check_shape(DY, X.array.shape, "x's shape")
    lead = tuple(X.array.shape[:-1])
    for name in ("mean", "rstd"):
        if name in args:
            arrays.check_dtype(args[name], ("float32",))
            arrays.check_shape(args[name], lead, "x.shape[:-1]")
    w_dtype = _vector_arg(W, n)
    if DR is not None:
        arrays.check_dtype(DR)
        arrays.check_shape(DR, DY.array.shape, "dy's shape")
    if O is not None:
        arrays.check_shape(O, X.array.shape, "x's shape")
        _out_dtype(O, None, x_dtype, "x's dtype")
    has_bias = bool(has_bias) and not rms
    b_dtype = _dtype_arg("bias_dtype", bias_dtype, w_dtype) if has_bias else None
    base = call_base(rms=rms, backward=True, hidden_size=n, input_dtype=x_dtype, output_dtype=dy_dtype,
                     weight_dtype=w_dtype if W is not None else None, bias_dtype=b_dtype,
                     residual_dtype=DR.dtype_name if DR is not None else None,
                     zero_centered=_zero_centered(zero_centered_weight, W))
    return args, on_gpu, base


def _backward_prepare(args, base) -> _Prepared:
    O = args["out"]
    return _prepare(_BACKWARD, args, {"dx" if O is None else "out": O}, base["hidden_size"], base)


def _backward(rms, dy, x, mean, rstd, weight, *, has_bias, bias_dtype, dresidual, zero_centered_weight, out,
              traits):
    key, hit = _cached_plan(_BACKWARD, (dy, x, mean, rstd, weight, dresidual, out),
                            (rms, bool(has_bias), bias_dtype, bool(zero_centered_weight), traits))
    if hit is not None:
        return _backward_launch(*hit, rms)
    args, on_gpu, base = _backward_args(rms, dy, x, mean, rstd, weight, has_bias, bias_dtype, dresidual,
                                        zero_centered_weight, out)
    args.setdefault("mean", None)  # RMSNorm has none
    X, DY, W, DR, O = (args.get(k) for k in ("x", "dy", "weight", "dresidual", "out"))
    zc, has_bias = base["zero_centered"], base["has_bias"]
    w_np, b_np = dtypes.numpy_dtype(base["weight_dtype"]), dtypes.numpy_dtype(base["bias_dtype"])
    if not on_gpu:
        if rms:
            dx, dw = reference.rms_norm_backward(DY.array, X.array, args["rstd"].array, _arr(W),
                                                 dresidual=_arr(DR), zero_centered_weight=zc)
        else:
            dx, dw, db = reference.layer_norm_backward(DY.array, X.array, args["mean"].array, args["rstd"].array,
                                                       _arr(W), dresidual=_arr(DR), zero_centered_weight=zc)
        dx = dx.astype(X.array.dtype)
        if O is not None:
            O.array[...] = dx
            dx = O.array
        dw = None if dw is None else dw.astype(w_np)
        return (dx, dw) if rms else (dx, dw, db.astype(b_np) if has_bias else None)

    import cupy

    with cupy.cuda.Device(X.array.data.device_id):
        p = _backward_prepare(args, base)
        t, kernels = p.resolve(traits, X.array.data.device_id)
    _plan_of(key, p, t, kernels, base)
    return _backward_launch(p, t, kernels, base, args, rms)


def _backward_launch(p: _Prepared, t: Traits, kernels: dict, base: dict, args: dict, rms: bool):
    import cupy

    X, W, O = args["x"], args["weight"], args["out"]
    n = base["hidden_size"]
    w_np, b_np = dtypes.numpy_dtype(base["weight_dtype"]), dtypes.numpy_dtype(base["bias_dtype"])
    with cupy.cuda.Device(X.array.data.device_id):
        dx_name = "dx" if O is None else "out"
        dx = _alloc(p, dx_name, X.array.shape, base["input_dtype"])
        dweight = cupy.empty(n, dtype=w_np) if t.has_weight else None
        dbias = cupy.empty(n, dtype=b_np) if t.has_bias else None
        grads = (dx, dweight) if rms else (dx, dweight, dbias)
        if p.row_count == 0:  # no rows: empty dx, and the column sums of nothing are zero
            for a in (dweight, dbias):
                if a is not None:
                    a.fill(0)
            return grads
        # mean and rstd are read by row number: a strided view is copied (documented).
        stats = [None if s is None else cupy.ascontiguousarray(s.array) for s in (args["mean"], args["rstd"])]
        k = kernels["norm_bwd"]
        parts = p.grid_groups(k, t)
        sums = t.has_weight or t.has_bias
        partials = cupy.empty((2, parts, n), dtype=np.float32) if sums else None
        dgamma_part, dbeta_part = (None, None) if partials is None else (partials[0], partials[1])
        xr, dyr, drr = p.rows["x"], p.rows["dy"], p.rows["dresidual"]
        w, w_stride = _kernel_weight(W, t)
        k(parts * t.ctas_per_row,
          (_input(p, args, "dy"), _input(p, args, "x"), _ptr(_input(p, args, "dresidual")), _ptr(stats[0]),
           stats[1], w, dx, _ptr(dgamma_part),
           _ptr(dbeta_part), np.int64(p.row_count), _ld(xr), _ld(dyr), _ld(drr), _ld(p.rows[dx_name]), w_stride))
        if sums:
            fin = kernels["norm_bwd_finalize"]
            fin(-(-n // t.finalize_cols_per_cta),
                (dgamma_part, dbeta_part, np.int32(parts), _ptr(dweight), _ptr(dbias)))
    return grads


def layer_norm_backward(dy, x, mean, rstd, weight=None, *, has_bias=True, bias_dtype=None, dresidual=None,
                        zero_centered_weight=False, out=None, traits=None):
    """Gradients of `layer_norm` given dy and the forward's saved mean and rstd.

    x is what was normalized (residual_out when a residual was used). Returns
    (dx, dweight, dbias): dx in x's dtype (written into `out` when given, which
    may be dy or dresidual itself), plus dresidual when given (the skip path's
    gradient, so dx is then the gradient of both x and the residual); dweight
    (None without a weight) in the weight's dtype; dbias (None unless has_bias)
    in `bias_dtype` (default the weight's dtype, float32 without a weight).
    Accumulated in fp32, bitwise reproducible run to run. dweight does not change
    with zero_centered_weight.
    """
    return _backward(False, dy, x, mean, rstd, weight, has_bias=has_bias, bias_dtype=bias_dtype,
                     dresidual=dresidual, zero_centered_weight=zero_centered_weight, out=out, traits=traits)


def rms_norm_backward(dy, x, rstd, weight=None, *, dresidual=None, zero_centered_weight=False, out=None,
                      traits=None):
    """Gradients of `rms_norm`: (dx, dweight), as in `layer_norm_backward`."""
    return _backward(True, dy, x, None, rstd, weight, has_bias=False, bias_dtype=None, dresidual=dresidual,
                     zero_centered_weight=zero_centered_weight, out=out, traits=traits)
