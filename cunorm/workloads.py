"""What `cunorm bench` and the tuner time: a Case per op and size, on arrays
made for it at M*N = ELEMENTS, with torch's own op beside it where torch has
one. Bytes count what a call must read and write at least (each row tensor
once, the saved statistics), so that a fraction of a copy's bandwidth is
comparable across ops. The runs that time them are in cunorm/bench.py."""
from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np

from . import dtypes

BENCH_SIZES = (768, 1024, 4096, 8192, 16384, 65536)
DELTA_HEAD_DIMS = (64, 128, 256)
ELEMENTS = 2**26
NORM_OPS = ("layer_norm", "rms_norm", "layer_norm+residual", "rms_norm+residual")
PLAIN_OPS = ("layer_norm", "rms_norm")
DIRECTIONS = ("fwd", "bwd")
DROPOUT_SIZES = (1024, 4096, 8192)
FP8_SHAPE = (16384, 4096)  # rows, N of `fp8_cases`
QK_SHAPE = (16384, 32, 128)  # rows B*S, heads, head dim of `qk_cases`


class Case(NamedTuple):
    """One benchmarked call on arrays made for it. `call(**kwargs)` runs it,
    with extra keyword arguments for the op (traits=, source=) where it is a
    norm op; `native` is torch's own op on the same tensors, or None."""
    op: str
    n: int
    nbytes: int
    call: Callable
    native: Callable | None = None


def norm_cases(sizes=BENCH_SIZES, dtype: str = "bfloat16", weight_dtype: str | None = None, ops=NORM_OPS,
               layout="", as_array=None, directions=DIRECTIONS, native: bool = False, only: set | None = None):
    """Yields a Case for each op's forward and backward (those in
    `directions`) at M*N = ELEMENTS, the arrays of one size made when its
    first case is drawn. A "+residual" op adds a residual (dresidual in the
    backward) of x's dtype. layout "stride+D" reads and writes rows D elements
    apart beyond N (slices of wider buffers). Bytes count each row tensor once
    plus the saved statistics (4 bytes a row each); weights and partial sums
    are not counted. `as_array` converts each CuPy array made (e.g.
    torch.from_dlpack: the calls then take torch tensors). `native`: give each
    case torch's own op where torch is importable and has it (contiguous rows,
    no residual). `only`: the (op, direction) pairs to yield (None: all)."""
    import cupy

    dt = dtypes.numpy_dtype(dtype)
    wdt = dtypes.numpy_dtype(weight_dtype or dtype)
    pad = int(layout.removeprefix("stride+")) if layout else 0
    conv = as_array or (lambda a: a)
    to_torch = _torch_from_dlpack() if native and not pad else None

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
        for op in ops:
            wanted = [d for d in directions if only is None or (op, d) in only]
            if not wanted:
                continue
            rms = op.startswith("rms")
            res = rows_of(m, n) if op.endswith("+residual") else None
            fwd, bwd, saved = _norm_calls(rms, x, w, b, dy, res, outs)
            natives = {}
            if to_torch is not None and res is None:
                tensors = {k: to_torch(v) for k, v in dict(x=x, dy=dy, w=w, b=b, **saved).items()}
                base = "rms_norm" if rms else "layer_norm"
                natives = {"fwd": torch_native(base, tensors, n), "bwd": torch_native(f"{base}_backward", tensors, n)}
            stats = (4 if rms else 8) * m
            name = op + (f" {layout}" if layout else "")
            nbytes = {"fwd": (2 + (res is not None) * 2) * m * n * e + stats,
                      "bwd": (3 + (res is not None)) * m * n * e + stats}
            for direction, call in (("fwd", fwd), ("bwd", bwd)):
                if direction in wanted:
                    yield Case(f"{name} {direction}", n, nbytes[direction], call, natives.get(direction))


def _norm_calls(rms: bool, x, w, b, dy, res, outs):
    """(forward, backward, saved statistics) of LayerNorm or RMSNorm on these
    arrays; each call takes the op's extra keyword arguments. The backward's
    statistics come from one call of the shipped forward."""
    from .norm import layer_norm, layer_norm_backward, rms_norm, rms_norm_backward

    if rms:
        def fwd(**kwargs):
            return rms_norm(x, w, residual=res, return_stats=True, out=outs[0], **kwargs)

        *_, rstd = fwd()

        def bwd(**kwargs):
            return rms_norm_backward(dy, x, rstd, w, dresidual=res, out=outs[1], **kwargs)

        return fwd, bwd, dict(rms=rstd)

    def fwd(**kwargs):
        return layer_norm(x, w, b, residual=res, return_stats=True, out=outs[0], **kwargs)

    *_, mean, rstd = fwd()

    def bwd(**kwargs):
        return layer_norm_backward(dy, x, mean, rstd, w, dresidual=res, out=outs[1], **kwargs)

    return fwd, bwd, dict(mean=mean, rstd=rstd)


def _torch_from_dlpack():
    """torch.from_dlpack, or None without torch."""
    try:
        import torch
    except ImportError:
        return None
    return torch.from_dlpack


def torch_native(op: str, t: dict, n: int):
    """torch's own `op` on the tensors `t` (x, dy, w, b, mean, rstd or rms;
    o, g for attention_delta: torch's eager (o.float() * g.float()).sum(-1))
    as a call of no arguments; None where this torch lacks the op or refuses
    these tensors."""
    import torch
    import torch.nn.functional as F

    calls = {
        "layer_norm": lambda: F.layer_norm(t["x"], (n,), t["w"], t["b"]),
        "rms_norm": lambda: F.rms_norm(t["x"], (n,), t["w"]),
        "layer_norm_backward": lambda: torch.ops.aten.native_layer_norm_backward(
            t["dy"], t["x"], (n,), t["mean"], t["rstd"], t["w"], t["b"], [True] * 3),
        "rms_norm_backward": lambda: torch.ops.aten._fused_rms_norm_backward(
            t["dy"], t["x"], (n,), t["rms"], t["w"], [True, True]),
        "attention_delta": lambda: (t["o"].float() * t["g"].float()).sum(-1),
    }
    try:
        calls[op]()
    except (AttributeError, RuntimeError):  # an op this torch lacks, or a dtype mix it refuses
        return None
    return calls[op]


def delta_cases(head_dims=DELTA_HEAD_DIMS, dtype: str = "bfloat16"):
    """Yields a Case (n: the head dim K) for attention_delta with ELEMENTS elements per input."""
    import cupy

    from .attention_delta import attention_delta

    dt = dtypes.numpy_dtype(dtype)
    for k in head_dims:
        m = ELEMENTS // k
        o = cupy.random.standard_normal((m, k), dtype=np.float32).astype(dt)
        g = cupy.random.standard_normal((m, k), dtype=np.float32).astype(dt)
        yield Case("attention_delta", k, 2 * m * k * dt.itemsize + 4 * m, lambda: attention_delta(o, g))


def qk_cases(dtype: str = "bfloat16", shape=QK_SHAPE):
    """Yields the q/k-norm Case: RMSNorm over the head dim of q, a [B*S, H, D]
    view of a fused [B*S, 3, H, D] QKV buffer, in place (out=q), with a [D]
    weight; bytes are q read and written. Its native is torch's RMSNorm of the
    same view (out of place, as a model's q_norm(q) runs)."""
    import cupy

    from .norm import rms_norm

    rows, heads, d = shape
    dt = dtypes.numpy_dtype(dtype)
    qkv = cupy.random.standard_normal((rows, 3, heads, d), dtype=np.float32).astype(dt)
    q = qkv[:, 0]
    w = (1 + 0.1 * cupy.random.standard_normal(d, dtype=np.float32)).astype(dt)
    native = None
    to_torch = _torch_from_dlpack()
    if to_torch is not None:
        tq, tw = to_torch(q), to_torch(w)
        native = torch_native("rms_norm", {"x": tq, "w": tw}, d)
    yield Case(f"rms_norm q of qkv [{rows}, 3, {heads}, {d}] fwd", d, 2 * rows * heads * d * dt.itemsize,
               lambda **kwargs: rms_norm(q, w, out=q, **kwargs), native)


def fp8_cases(dtype: str = "bfloat16", shape=FP8_SHAPE):
    """Yields the fp8-output Case: RMSNorm + residual forward with y stored as
    float8_e4m3fn scaled per row; bytes are x and the residual read,
    residual_out (x's dtype) and y (1 byte) written, and the row scales (4
    bytes a row). Its native is torch doing the same unfused: the add, RMSNorm,
    the row amax and the scaled cast to fp8."""
    import cupy

    from .norm import rms_norm

    m, n = shape
    dt = dtypes.numpy_dtype(dtype)
    x, r = (cupy.random.standard_normal((m, n), dtype=np.float32).astype(dt) for _ in range(2))
    w = (1 + 0.1 * cupy.random.standard_normal(n, dtype=np.float32)).astype(dt)
    native = _torch_fp8_rms(x, r, w, n)
    nbytes = m * n * (3 * dt.itemsize + 1) + 4 * m
    yield Case(f"rms_norm+residual -> fp8 e4m3 per row [{m}, {n}] fwd", n, nbytes,
               lambda **kwargs: rms_norm(x, w, residual=r, out_dtype="float8_e4m3fn", scaling="row", **kwargs),
               native)


def dropout_cases(dtype: str = "bfloat16", sizes=DROPOUT_SIZES, p: float = 0.1):
    """Yields dropout + residual + LayerNorm Cases, forward and backward, at M*N = ELEMENTS: the forward
    reads x and the residual and writes y and residual_out (h); the backward reads dy, h, the statistics and
    dresidual and writes dx and dx0 (dweight/dbias partials aside); the mask is drawn, not stored. Their
    native is torch unfused: dropout, the add, layer_norm (its backward: autograd over a graph built once)."""
    import cupy

    from .norm import layer_norm, layer_norm_backward

    dt = dtypes.numpy_dtype(dtype)
    for n in sizes:
        m = ELEMENTS // n
        x, r, dy, dr = (cupy.random.standard_normal((m, n), dtype=np.float32).astype(dt) for _ in range(4))
        w = (1 + 0.1 * cupy.random.standard_normal(n, dtype=np.float32)).astype(dt)
        b = (0.1 * cupy.random.standard_normal(n, dtype=np.float32)).astype(dt)
        _, h, mean, rstd = layer_norm(x, w, b, residual=r, dropout_p=p, seed=1, return_stats=True)
        fwd, bwd = _torch_dropout_ln(x, r, w, b, dy, dr, n, p)
        yield Case("dropout+residual+layer_norm fwd", n, 4 * m * n * dt.itemsize,
                   lambda x=x, r=r, w=w, b=b, **kw: layer_norm(x, w, b, residual=r, dropout_p=p, seed=7, **kw), fwd)
        yield Case("dropout+residual+layer_norm bwd", n, 5 * m * n * dt.itemsize + 8 * m,
                   lambda dy=dy, h=h, mean=mean, rstd=rstd, w=w, dr=dr, **kw: layer_norm_backward(
                       dy, h, mean, rstd, w, dresidual=dr, dropout_p=p, seed=7, **kw), bwd)


def _torch_dropout_ln(x, r, w, b, dy, dr, n: int, p: float):
    """torch's unfused dropout + add + layer_norm on these arrays, forward and backward (autograd); (None,
    None) without torch."""
    to_torch = _torch_from_dlpack()
    if to_torch is None:
        return None, None
    import torch
    import torch.nn.functional as F

    tx, tr, tw, tb, tdy, tdr = map(to_torch, (x, r, w, b, dy, dr))

    def forward(x0):
        h = F.dropout(x0, p) + tr
        return F.layer_norm(h, (n,), tw, tb), h

    def fwd():
        with torch.no_grad():
            return forward(tx)

    x0 = tx.detach().requires_grad_()
    leaves = (x0, tw.detach().requires_grad_(), tb.detach().requires_grad_())  # dx0, dweight, dbias as ours
    tw, tb = leaves[1:]
    graph = forward(x0)  # built once: the timed backward walks it again and again

    def bwd():
        return torch.autograd.grad(graph, leaves, (tdy, tdr), retain_graph=True)

    return fwd, bwd


def _torch_fp8_rms(x, r, w, n: int):
    """torch's unfused RMSNorm + residual with an fp8 y scaled per row, on these arrays; None without torch."""
    to_torch = _torch_from_dlpack()
    if to_torch is None:
        return None
    import torch
    import torch.nn.functional as F

    tx, tr, tw = to_torch(x), to_torch(r), to_torch(w)

    def call():
        h = tx + tr
        y = F.rms_norm(h, (n,), tw).float()
        s = y.abs().amax(-1, keepdim=True) / 448.0
        return (y / s).to(torch.float8_e4m3fn), s, h

    return call
