"""The inputs a case draws (fresh random rows far from zero mean, each tensor in its own layout, the rest of
its buffer NaN), and allocations poisoned with NaN while the op runs."""
from __future__ import annotations

import contextlib

import numpy as np

from .. import dtypes, reference
from ..sweeps import LAYOUTS, WEIGHT_LAYOUTS, Case


def standard_normal(gen, shape, dtype: str):
    """N(0, 1) draws for a tensor of `dtype`: drawn in float64 for a float64
    tensor (a float32 draw would leave its low bits zero, and an fp64 kernel
    that truncated to fp32 would pass), float32 otherwise."""
    return gen.standard_normal(shape, dtype="float64" if dtype == "float64" else "float32")


@contextlib.contextmanager
def poisoned_allocations():
    """Every CuPy allocation inside is filled with 0xFF bytes: NaN in fp32,
    fp16 and bf16 alike. Working memory kept per stream is dropped first, so
    that a call's scratch is poisoned too (a partial sum left unwritten shows)."""
    import cupy

    from .. import launch, scratch

    with launch._launch_lock:
        scratch.forget()
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


def _gpu_rng(rng):
    """A CuPy generator seeded from `rng`: inputs are drawn on the GPU (fast at
    4096 x 65536), and still follow the run's seed."""
    import cupy

    return cupy.random.RandomState(int(rng.integers(2**63)))


def delta_inputs(gen, rows: int, k: int, out_dtype: str, grad_dtype: str):
    """out ~ N(0, 1) and grad_out = out + N(0, 0.5^2): each row's dot product is
    well away from zero. With independent inputs a single row's sum can cancel
    to near zero, where no fp32 summation meets a relative bound."""
    o = standard_normal(gen, (rows, k), out_dtype)
    go = o + 0.5 * standard_normal(gen, (rows, k), grad_dtype)
    return o.astype(dtypes.numpy_dtype(out_dtype)), go.astype(dtypes.numpy_dtype(grad_dtype))


def _lead(case: Case) -> tuple | None:
    return case.lead if case.heads else None


def _fill(view, values):
    view[...] = values
    return view


def row_tensor(gen, rows: int, n: int, dtype: str, layout: str, values, lead: tuple | None = None):
    """A (rows, n) array in `layout` holding `values` (a GPU array of that
    shape), shaped lead + (n,) when `lead` is given (`Case.lead`). The rest
    of its buffer is NaN: a kernel that reads past a row's ends and lets
    those lanes in cannot pass."""
    import cupy

    dt = dtypes.numpy_dtype(dtype)
    shape = (lead or (rows,)) + (n,)
    if layout == "qkv":
        if lead is None or len(lead) != 3:
            raise ValueError("layout: qkv needs a case with heads")
        b, s, h = lead
        buf = cupy.full((b, s + 1, 3, h, n), np.nan, dtype=dt)
        return _fill(buf[:, :s, 1], values.reshape(shape))
    if layout == "contiguous":
        return values.astype(dt).reshape(shape)
    kind, k = layout.split(":")
    k = int(k)
    if kind == "offset":
        buf = cupy.full(rows * n + k, np.nan, dtype=dt)
        return _fill(buf[k:].reshape(rows, n), values).reshape(shape)
    if kind == "stride":
        buf = cupy.full((rows, n + k), np.nan, dtype=dt)
        return _fill(buf[:, :n], values).reshape(shape)
    raise ValueError(f"layout: unknown {layout!r}; expected one of {', '.join(LAYOUTS)}")


def weight_vector(n: int, dtype: str, layout: str, values, heads: int = 0):
    """A weight of length n in `layout` (broadcast: the first value everywhere, stride 0); with `heads`, a
    weight per head, [heads, n] (`values` of that shape; contiguous, or "strided": every other column)."""
    import cupy

    dt = dtypes.numpy_dtype(dtype)
    if heads:
        if layout == "strided":
            buf = cupy.full((heads, 2 * n), np.nan, dtype=dt)
            return _fill(buf[:, ::2], values)
        return values.astype(dt)
    if layout == "contiguous":
        return values.astype(dt)
    if layout == "broadcast":
        return cupy.broadcast_to(values[:1].astype(dt), (n,))
    if layout == "strided":
        buf = cupy.full(2 * n, np.nan, dtype=dt)
        return _fill(buf[::2], values)
    if layout == "offset":
        buf = cupy.full(n + 1, np.nan, dtype=dt)
        return _fill(buf[1:], values)
    raise ValueError(f"weight_layout: unknown {layout!r}; expected one of {', '.join(WEIGHT_LAYOUTS)}")


def _inputs(case: Case, rng):
    """x (rows far from zero mean), weight, bias, residual for a case."""
    m, n = case.rows, case.hidden_size
    g = _gpu_rng(rng)
    sign = g.randint(0, 2, size=(m, 1)) * 2.0 - 1.0
    shift = sign * g.uniform(1, 3, size=(m, 1))  # rows far from zero mean
    xv = standard_normal(g, (m, n), case.dtype) * float(rng.uniform(0.5, 2.0)) + shift
    x = row_tensor(g, m, n, case.dtype, case.layout, xv, _lead(case))
    wshape = (case.heads, n) if case.per_head else n
    heads = case.heads if case.per_head else 0
    w = (weight_vector(n, case.weight_dtype, case.weight_layout,
                       (1.0 + 0.5 * standard_normal(g, wshape, case.weight_dtype)) * (0.5 if case.zero_centered else 1.0),
                       heads)
         if case.has_weight else None)
    bdt = case.bias_dtype or case.weight_dtype
    b = (weight_vector(n, bdt, case.bias_layout or case.weight_layout, 0.5 * standard_normal(g, wshape, bdt), heads)
         if case.has_bias else None)
    r = None
    if case.residual_dtype is not None and not case.backward:
        r = row_tensor(g, m, n, case.residual_dtype, case.layout_of("residual"),
                       standard_normal(g, (m, n), case.residual_dtype), _lead(case))
    return x, w, b, r


def _traits_of(case: Case) -> dict | None:
    """The `traits=` a case forces (its knobs), or None: dispatch's choice."""
    return None if case.knobs is None else dict(case.knobs)


def _given_out(case: Case, dtype: str):
    """The `out=` a case passes when it names an out_layout: NaN everywhere, so
    an element the op leaves unwritten cannot pass."""
    import cupy

    if case.out_layout is None:
        return None
    m, n = case.rows, case.hidden_size
    return row_tensor(None, m, n, dtype, case.out_layout, cupy.full((m, n), np.nan, dtype=np.float32), _lead(case))


def _branch_inputs(case: Case, x, rng):
    """None without dropout or a row scale; else the branch's op arguments (kwargs: dropout_p, a seed drawn
    from rng, rowscale), its float64 result x0 = x * rowscale * keep / (1 - p), and the keep mask (CuPy)."""
    import cupy

    if not case.dropout_p and case.rowscale_dtype is None:
        return None
    g = _gpu_rng(rng)
    rs = None
    if case.rowscale_dtype is not None:
        rs = (g.uniform(0.5, 2.0, case.lead)).astype(dtypes.numpy_dtype(case.rowscale_dtype))
    seed = int(rng.integers(2**63)) * 2 + 1 if case.dropout_p else None  # high key bits set
    x0 = reference._f64(x)
    if rs is not None:
        x0 = x0 * reference._f64(rs)[..., None]
    keep = None
    if case.dropout_p:
        keep = cupy.asarray(reference.dropout_keep(x.shape, case.dropout_p, seed))
        x0 = _dropped(x0, keep, case.dropout_p)
    return {"kwargs": dict(dropout_p=case.dropout_p, seed=seed, rowscale=rs), "x0": x0, "keep": keep, "rs": rs}


def _dropped(a, keep, p: float):
    """a * keep / (1 - p) (float64, CuPy): a branch after dropout."""
    import cupy

    return cupy.where(keep, a / (1.0 - p), 0.0)


def _parallel_inputs(case: Case, rng, branch):
    """None without the parallel block; else x1 (contiguous, its dtype) and its float64 branch (x1_0: x1 *
    keep1 / (1 - p), keep1 drawn from the branch's seed, stream 1), weight1 and bias1 (or None)."""
    import cupy

    if case.x1_dtype is None and case.weight1_dtype is None:
        return None
    g = _gpu_rng(rng)
    m, n = case.rows, case.hidden_size
    x1 = x1_0 = keep1 = None
    if case.x1_dtype is not None and not case.backward:
        x1 = row_tensor(g, m, n, case.x1_dtype, "contiguous", standard_normal(g, (m, n), case.x1_dtype), _lead(case))
        x1_0 = reference._f64(x1)
    if case.x1_dtype is not None and case.dropout_p:
        seed = branch["kwargs"]["seed"]
        keep1 = cupy.asarray(reference.dropout_keep((*case.lead, n), case.dropout_p, seed, stream=1))
        if x1_0 is not None:
            x1_0 = _dropped(x1_0, keep1, case.dropout_p)
    w1 = b1 = None
    if case.weight1_dtype is not None:
        w1 = weight_vector(n, case.weight1_dtype, "contiguous", 1.0 + 0.5 * standard_normal(g, n, case.weight1_dtype))
        if case.bias1_dtype is not None:
            b1 = weight_vector(n, case.bias1_dtype, "contiguous", 0.5 * standard_normal(g, n, case.bias1_dtype))
    return {"x1": x1, "x1_0": x1_0, "keep1": keep1, "w1": w1, "b1": b1}


def cupy_array(values, dtype: str):
    import cupy

    return cupy.asarray(np.asarray(values, dtype=dtype))
