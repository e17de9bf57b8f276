"""Float64 references for every op: the CPU path of the API, and the ground
truth of the tests and of `cunorm check`. Written against the numpy API, they
also run on CuPy arrays (the checker computes references on the GPU)."""
from __future__ import annotations

import numpy as np


def _f64(a):
    if a is None:
        return None
    return a.astype(np.float64) if hasattr(a, "astype") else np.asarray(a, dtype=np.float64)


def layer_norm(x, weight=None, bias=None, eps: float = 1e-5):
    """(y, mean, rstd) over the last axis, all float64."""
    x = _f64(x)
    mean = x.mean(axis=-1)
    var = ((x - mean[..., None]) ** 2).mean(axis=-1)
    rstd = (var + eps) ** -0.5
    y = (x - mean[..., None]) * rstd[..., None]
    if weight is not None:
        y = y * _f64(weight)
    if bias is not None:
        y = y + _f64(bias)
    return y, mean, rstd


def layer_norm_backward(dy, x, mean, rstd, weight=None):
    """(dx, dweight, dbias) in float64, given the forward's saved mean and rstd.
    dweight is None without a weight; dbias is always computed."""
    dy, x, mean, rstd = _f64(dy), _f64(x), _f64(mean)[..., None], _f64(rstd)[..., None]
    xhat = (x - mean) * rstd
    g = dy * _f64(weight) if weight is not None else dy
    dx = rstd * (g - g.mean(axis=-1, keepdims=True) - xhat * (g * xhat).mean(axis=-1, keepdims=True))
    lead = tuple(range(x.ndim - 1))
    dweight = (dy * xhat).sum(axis=lead) if weight is not None else None
    dbias = dy.sum(axis=lead)
    return dx, dweight, dbias


def attention_delta(out, grad_out):
    """D = rowsum(out * grad_out) over the last axis, float64."""
    return (_f64(out) * _f64(grad_out)).sum(axis=-1)
