"""cunorm's ops as torch.library custom ops: `cunorm::norm_fwd`,
`cunorm::norm_bwd` and `cunorm::attention_delta`, with fake (meta)
implementations for torch.compile and an autograd formula for the forward.

On CUDA tensors they run cunorm's kernels through the core API (torch's
allocator, torch's current stream: nothing synchronizes, so they can be
captured in CUDA graphs once a first call has compiled and planned them). On
CPU tensors they run the float64 reference through numpy (slow; for tests
and for models that are not on a GPU yet).

Absent outputs (residual_out without a residual, mean for RMSNorm, dweight
without a weight) come back as empty tensors: a custom op returns tensors.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from torch import Tensor

from .. import dtypes
from ..attention_delta import attention_delta as _attention_delta
from ..norm import layer_norm as _layer_norm
from ..norm import layer_norm_backward as _layer_norm_backward
from ..norm import rms_norm as _rms_norm
from ..norm import rms_norm_backward as _rms_norm_backward


# -- CPU tensors through the numpy path --------------------------------------------

def _to_numpy(t: Tensor | None):
    if t is None:
        return None
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(dtypes.BFLOAT16)
    return t.numpy()


def _from_numpy(a) -> Tensor | None:
    if a is None:
        return None
    a = np.ascontiguousarray(a)
    if a.dtype == dtypes.BFLOAT16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _call(fn, *tensors, **kwargs):
    """fn over torch tensors: CUDA tensors go straight in (torch tensors come
    back); CPU tensors through numpy and back."""
    if tensors[0].is_cuda:
        return fn(*tensors, **kwargs)
    out = fn(*map(_to_numpy, tensors), **kwargs)
    return tuple(map(_from_numpy, out)) if isinstance(out, tuple) else _from_numpy(out)


def _empty(like: Tensor) -> Tensor:
    return like.new_empty(0)


# -- the ops ----------------------------------------------------------------------

@torch.library.custom_op("cunorm::norm_fwd", mutates_args=())
def norm_fwd(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], residual: Optional[Tensor], eps: float,
             rms: bool, zero_centered: bool, out_dtype: Optional[torch.dtype],
             residual_out_dtype: Optional[torch.dtype], rowscale: Optional[Tensor] = None, dropout_p: float = 0.0,
             seed: int = 0, x1: Optional[Tensor] = None, weight1: Optional[Tensor] = None,
             bias1: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(y, residual_out, mean, rstd, y1) of LayerNorm (rms=False) or RMSNorm over
    the last axis of x; residual_out, (RMSNorm) mean and y1 are empty when absent.
    With dropout_p > 0 or a rowscale, x passes the branch first (x * rowscale
    * keep / (1 - p), the mask drawn from `seed`); x1 (the parallel branch,
    its own mask) is added to h; residual_out (h) is then returned with or
    without a residual. weight1 (and bias1) make y1 from the same statistics."""
    writes_h = residual is not None or bool(dropout_p) or rowscale is not None or x1 is not None
    kwargs = dict(residual_dtype=residual_out_dtype if writes_h else None,
                  zero_centered_weight=zero_centered, return_stats=True, out_dtype=out_dtype)
    if dropout_p:
        kwargs.update(dropout_p=dropout_p, seed=seed)
    if rms:
        out = _call(lambda a, w, b, r, s, a1, w1, b1: _rms_norm(a, w, eps, bias=b, residual=r, rowscale=s, x1=a1,
                                                                weight1=w1, bias1=b1, **kwargs),
                    x, weight, bias, residual, rowscale, x1, weight1, bias1)
        out, mean = list(out), None
    else:
        out = _call(lambda a, w, b, r, s, a1, w1, b1: _layer_norm(a, w, b, eps, residual=r, rowscale=s, x1=a1,
                                                                  weight1=w1, bias1=b1, **kwargs),
                    x, weight, bias, residual, rowscale, x1, weight1, bias1)
        out, mean = list(out[:-2]) + [out[-1]], out[-2]
    rstd = out.pop()
    y = out.pop(0)
    y1 = out.pop(0) if weight1 is not None else _empty(x)
    residual_out = out.pop(0) if writes_h else _empty(x)
    return y, residual_out, mean if mean is not None else _empty(rstd), rstd, y1


@norm_fwd.register_fake
def _(x, weight, bias, residual, eps, rms, zero_centered, out_dtype, residual_out_dtype, rowscale=None,
      dropout_p=0.0, seed=0, x1=None, weight1=None, bias1=None):
    lead = x.shape[:-1]
    y = x.new_empty(x.shape, dtype=out_dtype or x.dtype)
    y1 = x.new_empty(x.shape, dtype=out_dtype or x.dtype) if weight1 is not None else x.new_empty(0)
    branch = bool(dropout_p) or rowscale is not None or x1 is not None
    residual_out = (x.new_empty(x.shape, dtype=residual_out_dtype or (residual.dtype if residual is not None
                                                                      else x.dtype))
                    if residual is not None or branch else x.new_empty(0))
    stats = torch.float64 if x.dtype == torch.float64 else torch.float32  # dtypes.compute_dtype
    rstd = x.new_empty(lead, dtype=stats)
    mean = x.new_empty(0, dtype=stats) if rms else x.new_empty(lead, dtype=stats)
    return y, residual_out, mean, rstd, y1


@torch.library.custom_op("cunorm::norm_bwd", mutates_args=())
def norm_bwd(dy: Tensor, x: Tensor, mean: Optional[Tensor], rstd: Tensor, weight: Optional[Tensor],
             dresidual: Optional[Tensor], rms: bool, zero_centered: bool, has_bias: bool,
             bias_dtype: Optional[torch.dtype], rowscale: Optional[Tensor] = None, dropout_p: float = 0.0,
             seed: int = 0, dx0_dtype: Optional[torch.dtype] = None, dy1: Optional[Tensor] = None,
             weight1: Optional[Tensor] = None, has_bias1: bool = False, bias1_dtype: Optional[torch.dtype] = None,
             dx1_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dx, dweight, dbias, dx0, dx1, dweight1, dbias1) of norm_fwd, given what
    it normalized (x: the residual sum when there was a residual) and its
    statistics; dresidual (the skip path's gradient) is added into dx. After a
    branch (dropout_p, rowscale), dx0 is the branch input's gradient; with
    dx1_dtype (x1 under dropout) dx1 is x1's (without dropout it is dx: empty
    here, since outputs of a custom op do not alias); dy1 with weight1 (y1's
    gradient) adds dweight1 (and dbias1). Absent gradients are empty."""
    branch = bool(dropout_p) or rowscale is not None
    kw = dict(has_bias=has_bias, bias_dtype=bias_dtype, zero_centered_weight=zero_centered)
    if branch:
        kw.update(dropout_p=dropout_p, seed=seed if dropout_p else None, dx0_dtype=dx0_dtype)
    if dx1_dtype is not None:
        kw.update(has_x1=True, dx1_dtype=dx1_dtype)
    if weight1 is not None:
        kw.update(has_bias1=has_bias1, bias1_dtype=bias1_dtype)
    if rms:
        dx, *rest = _call(lambda g, a, s, w, dr, rs, g1, w1: _rms_norm_backward(g, a, s, w, dresidual=dr, rowscale=rs,
                                                                                dy1=g1, weight1=w1, **kw),
                          dy, x, rstd, weight, dresidual, rowscale, dy1, weight1)
    else:
        dx, *rest = _call(lambda g, a, m, s, w, dr, rs, g1, w1: _layer_norm_backward(
            g, a, m, s, w, dresidual=dr, rowscale=rs, dy1=g1, weight1=w1, **kw),
            dy, x, mean, rstd, weight, dresidual, rowscale, dy1, weight1)
    dx0 = rest.pop(0) if branch else None
    dx1 = rest.pop(0) if dx1_dtype is not None else None
    dw = rest.pop(0)
    db = rest.pop(0) if has_bias or not rms else None
    dw1 = rest.pop(0) if weight1 is not None else None
    db1 = rest.pop(0) if weight1 is not None and (has_bias1 or not rms) else None
    return tuple(t if t is not None else _empty(x) for t in (dx, dw, db, dx0, dx1, dw1, db1))


@norm_bwd.register_fake
def _(dy, x, mean, rstd, weight, dresidual, rms, zero_centered, has_bias, bias_dtype, rowscale=None, dropout_p=0.0,
      seed=0, dx0_dtype=None, dy1=None, weight1=None, has_bias1=False, bias1_dtype=None, dx1_dtype=None):
    n = x.shape[-1]
    dx = x.new_empty(x.shape)
    dw = x.new_empty(weight.shape, dtype=weight.dtype) if weight is not None else x.new_empty(0)
    b_dtype = bias_dtype or (weight.dtype if weight is not None else torch.float32)
    per_head = weight is not None and weight.dim() == 2  # [heads, N]: dbias per head too
    db = x.new_empty(weight.shape if per_head else (n,), dtype=b_dtype) if has_bias else x.new_empty(0)
    branch = bool(dropout_p) or rowscale is not None
    dx0 = x.new_empty(x.shape, dtype=dx0_dtype or x.dtype) if branch else x.new_empty(0)
    dx1 = x.new_empty(x.shape, dtype=dx1_dtype) if dx1_dtype is not None else x.new_empty(0)
    dw1 = x.new_empty(weight1.shape, dtype=weight1.dtype) if weight1 is not None else x.new_empty(0)
    db1 = (x.new_empty((n,), dtype=bias1_dtype or weight1.dtype) if weight1 is not None and has_bias1
           else x.new_empty(0))
    return dx, dw, db, dx0, dx1, dw1, db1


@torch.library.custom_op("cunorm::attention_delta", mutates_args=())
def attention_delta(out: Tensor, grad_out: Tensor) -> Tensor:
    """D = rowsum(out * grad_out) in float32 (float64 when an input is), shape out.shape[:-1] (not differentiable)."""
    return _call(_attention_delta, out, grad_out)


@attention_delta.register_fake
def _(out, grad_out):
    wide = torch.float64 in (out.dtype, grad_out.dtype)  # attention_delta.delta_dtype
    return out.new_empty(out.shape[:-1], dtype=torch.float64 if wide else torch.float32)


# -- autograd ---------------------------------------------------------------------

def _setup_fwd(ctx, inputs, output):
    (x, weight, bias, residual, eps, rms, zero_centered, out_dtype, residual_out_dtype, rowscale, dropout_p, seed,
     x1, weight1, bias1) = inputs
    y, residual_out, mean, rstd, y1 = output
    ctx.branch = bool(dropout_p) or rowscale is not None
    ctx.dropout_p, ctx.seed = dropout_p, seed
    ctx.x1_dtype = x1.dtype if x1 is not None else None
    ctx.has_bias1, ctx.bias1_dtype = bias1 is not None, bias1.dtype if bias1 is not None else None
    h = residual_out if residual is not None or ctx.branch or x1 is not None else x
    ctx.save_for_backward(h, weight, mean if not rms else None, rstd, rowscale, weight1)
    ctx.rms, ctx.zero_centered, ctx.has_bias = rms, zero_centered, bias is not None
    ctx.bias_dtype = bias.dtype if bias is not None else None
    ctx.x_dtype = x.dtype
    ctx.residual_dtype = residual.dtype if residual is not None else None
    ctx.y_dtype = y.dtype
    ctx.mark_non_differentiable(mean, rstd)


def _backward_fwd(ctx, dy, dresidual_out, _dmean, _drstd, dy1):
    h, weight, mean, rstd, rowscale, weight1 = ctx.saved_tensors
    has_residual = ctx.residual_dtype is not None
    if dy is None:
        dy = torch.zeros(h.shape, dtype=ctx.y_dtype, device=h.device)
    if weight1 is not None and (dy1 is None or not dy1.numel()):
        dy1 = torch.zeros(h.shape, dtype=ctx.y_dtype, device=h.device)
    # residual_out (h) reaches the loss too where it is returned: with a residual, after a branch or with x1
    returned_h = has_residual or ctx.branch or ctx.x1_dtype is not None
    dres = dresidual_out if returned_h and dresidual_out is not None and dresidual_out.numel() else None
    x1_under_dropout = ctx.x1_dtype is not None and bool(ctx.dropout_p)
    dh, dw, db, dx0, dx1, dw1, db1 = norm_bwd(
        dy, h, mean, rstd, weight, dres, ctx.rms, ctx.zero_centered, ctx.has_bias, ctx.bias_dtype, rowscale,
        ctx.dropout_p, ctx.seed, ctx.x_dtype if ctx.branch else None, dy1 if weight1 is not None else None, weight1,
        ctx.has_bias1, ctx.bias1_dtype, ctx.x1_dtype if x1_under_dropout else None)
    dx = dx0 if ctx.branch else (dh if dh.dtype == ctx.x_dtype else dh.to(ctx.x_dtype))
    dr = None
    if has_residual:
        dr = dh if dh.dtype == ctx.residual_dtype else dh.to(ctx.residual_dtype)
    if ctx.x1_dtype is not None and not x1_under_dropout:  # x1's gradient is h's
        dx1 = dh if dh.dtype == ctx.x1_dtype else dh.to(ctx.x1_dtype)
    return (dx, dw if weight is not None else None, db if ctx.has_bias else None, dr,
            None, None, None, None, None, None, None, None,
            dx1 if ctx.x1_dtype is not None else None, dw1 if weight1 is not None else None,
            db1 if ctx.has_bias1 else None)


torch.library.register_autograd("cunorm::norm_fwd", _backward_fwd, setup_context=_setup_fwd)
