"""Float64 references for every op: the CPU path of the API, and the ground
truth of the tests and of `cunorm check`. Written against the numpy API, they
also run on CuPy arrays (the checker computes references on the GPU)."""
from __future__ import annotations

import numpy as np


def _f64(a):
    if a is None:
        return None
    return a.astype(np.float64) if hasattr(a, "astype") else np.asarray(a, dtype=np.float64)


def _effective_weight(weight, zero_centered_weight: bool):
    """The multiplier of xhat: weight, 1 + weight (zero-centered), or None."""
    if weight is None:
        if zero_centered_weight:
            raise ValueError("zero_centered_weight: needs a weight")
        return None
    w = _f64(weight)
    return 1.0 + w if zero_centered_weight else w


def add_residual(x, residual):
    """h = x + residual (the pre-norm residual add), float64; x alone without a residual."""
    return _f64(x) if residual is None else _f64(x) + _f64(residual)


def _nan_rows(x, *stats):
    """The statistics with NaN on every row of x that holds inf or NaN: that
    row's outputs are all NaN (as the kernels make them)."""
    bad = ~np.isfinite(x).all(axis=-1)
    return tuple(np.where(bad, np.nan, s) for s in stats)


def layer_norm(x, weight=None, bias=None, eps: float = 1e-5, *, zero_centered_weight: bool = False):
    """(y, mean, rstd) over the last axis, all float64. With a residual, pass
    `add_residual(x, residual)` as x. A row holding inf or NaN gives NaN."""
    x = _f64(x)
    with np.errstate(all="ignore"):  # non-finite rows become NaN below, without warnings
        mean = x.mean(axis=-1)
        var = ((x - mean[..., None]) ** 2).mean(axis=-1)
        mean, rstd = _nan_rows(x, mean, (var + eps) ** -0.5)
        y = (x - mean[..., None]) * rstd[..., None]
    w = _effective_weight(weight, zero_centered_weight)
    if w is not None:
        y = y * w
    if bias is not None:
        y = y + _f64(bias)
    return y, mean, rstd


def _row_grads(dy, xhat, rstd, w, dresidual, centered: bool):
    """dx of a normalization given xhat, rstd and the xhat multiplier w: the
    LayerNorm form (centered) subtracts mean(g); RMSNorm's does not. The skip
    path's gradient dresidual, if any, adds to it."""
    g = dy * w if w is not None else dy
    dx = g - xhat * (g * xhat).mean(axis=-1, keepdims=True)
    if centered:
        dx = dx - g.mean(axis=-1, keepdims=True)
    dx = rstd * dx
    return dx if dresidual is None else dx + _f64(dresidual)


def layer_norm_backward(dy, x, mean, rstd, weight=None, *, dresidual=None, zero_centered_weight: bool = False):
    """(dx, dweight, dbias) in float64, given the forward's saved mean and rstd.
    dweight is None without a weight; dbias is always computed. dweight does not
    change with zero_centered_weight (d(1 + w)/dw = 1)."""
    dy, x, mean, rstd = _f64(dy), _f64(x), _f64(mean)[..., None], _f64(rstd)[..., None]
    xhat = (x - mean) * rstd
    dx = _row_grads(dy, xhat, rstd, _effective_weight(weight, zero_centered_weight), dresidual, centered=True)
    lead = _summed_axes(x, weight)
    dweight = (dy * xhat).sum(axis=lead) if weight is not None else None
    dbias = dy.sum(axis=lead)
    return dx, dweight, dbias


def _summed_axes(x, weight) -> tuple:
    """The axes a weight's gradient sums over: every leading one, or all but the head axis (-2) for a weight
    per head ([heads, N]; dbias then per head too)."""
    return tuple(range(x.ndim - (2 if weight is not None and weight.ndim == 2 else 1)))


def rms_norm(x, weight=None, eps: float = 1e-6, *, bias=None, zero_centered_weight: bool = False):
    """(y, rstd): y = x * rstd * w (+ bias) with rstd = 1 / sqrt(mean(x^2) + eps), float64.
    With a residual, pass `add_residual(x, residual)` as x. A row holding inf or NaN gives NaN."""
    x = _f64(x)
    with np.errstate(all="ignore"):
        (rstd,) = _nan_rows(x, ((x * x).mean(axis=-1) + eps) ** -0.5)
        y = x * rstd[..., None]
    w = _effective_weight(weight, zero_centered_weight)
    y = y * w if w is not None else y
    return (y + _f64(bias) if bias is not None else y), rstd


def bias_grad(dy, weight=None):
    """dbias = the column sums of dy over every leading axis (per head beside a weight per head), float64."""
    dy = _f64(dy)
    return dy.sum(axis=_summed_axes(dy, weight))


def rms_norm_backward(dy, x, rstd, weight=None, *, dresidual=None, zero_centered_weight: bool = False):
    """(dx, dweight) in float64; x is what was normalized (the residual sum when
    a residual was used), dresidual the gradient reaching it from the skip path."""
    dy, x, rstd = _f64(dy), _f64(x), _f64(rstd)[..., None]
    xhat = x * rstd
    dx = _row_grads(dy, xhat, rstd, _effective_weight(weight, zero_centered_weight), dresidual, centered=False)
    dweight = (dy * xhat).sum(axis=_summed_axes(x, weight)) if weight is not None else None
    return dx, dweight


def parallel_backward(dy, dy1, xhat, rstd, weight, weight1, *, rms: bool = False, dresidual=None,
                      zero_centered_weight: bool = False):
    """(dx, dweight, dbias, dweight1, dbias1) in float64 of the parallel block's two outputs y = xhat * w + b
    and y1 = xhat * w1 + b1 (g = dy * w + dy1 * w1), given xhat (float64) and rstd."""
    dy, dy1, rstd = _f64(dy), _f64(dy1), _f64(rstd)[..., None]
    w, w1 = (_effective_weight(a, zero_centered_weight) for a in (weight, weight1))
    g = dy * w + dy1 * w1
    dx = _row_grads(g, xhat, rstd, None, dresidual, centered=not rms)
    lead = _summed_axes(xhat, weight)
    return dx, (dy * xhat).sum(axis=lead), dy.sum(axis=lead), (dy1 * xhat).sum(axis=lead), dy1.sum(axis=lead)


def refined_mean(x, mean, rstd):
    """`mean` (the forward's, rounded to fp32) with, on rows whose mean lies REFINE_MIN_OFFSET standard
    deviations or more from zero (|mean| * rstd), the mean of x - mean added in float64, which undoes that
    rounding; other rows keep the mean given. REFINE_MEAN's backward does the same in fp32."""
    from .traits import REFINE_MIN_OFFSET

    x, mean, rstd = _f64(x), _f64(mean), _f64(rstd)
    with np.errstate(invalid="ignore", over="ignore"):
        offset = np.abs(mean) * rstd >= REFINE_MIN_OFFSET
        return np.where(offset, mean + (x - mean[..., None]).mean(axis=-1), mean)


def backward_mean(x, mean, rstd, *, input_dtype: str, rms: bool = False, from_output: bool = False):
    """The mean a backward of `input_dtype` rows differentiates at, as the kernels do: `mean` given, refined
    (refined_mean) where they refine it (cunorm.traits.refines_mean: fp32 LayerNorm rows from x)."""
    from .traits import refines_mean

    if mean is None or not refines_mean(rms=rms, from_output=from_output, input_dtype=input_dtype):
        return mean
    return refined_mean(x, mean, rstd)


def recovered_xhat(x, rstd=None, mean=None, *, weight=None, bias=None, from_output: bool = False,
                   zero_centered_weight: bool = False):
    """xhat in float64 as a backward recovers it: (x - mean) * rstd (mean None: RMSNorm's x * rstd), or,
    from the forward's output (from_output, x being y), (y - bias) / w, 0 where w is 0."""
    x = _f64(x)
    if from_output:
        w = _effective_weight(weight, zero_centered_weight)
        shifted = x - _f64(bias) if bias is not None else x
        with np.errstate(all="ignore"):  # a zero multiplier loses xhat: taken as 0, as the kernels take it
            return np.where(w == 0, 0.0, shifted / w) if w is not None else shifted
    return (x - (0.0 if mean is None else _f64(mean)[..., None])) * _f64(rstd)[..., None]


def norm_backward_from_output(dy, y, rstd, weight=None, bias=None, *, rms: bool = False, dresidual=None,
                              zero_centered_weight: bool = False):
    """(dx, dweight, dbias) in float64 from the forward's output y (the
    memory-efficient backward): xhat = (y - bias) / w, 0 where w is 0. Exact
    given exact y; y's rounding reaches xhat divided by w."""
    dy, y, rstd = _f64(dy), _f64(y), _f64(rstd)[..., None]
    w = _effective_weight(weight, zero_centered_weight)
    xhat = recovered_xhat(y, weight=weight, bias=bias, from_output=True, zero_centered_weight=zero_centered_weight)
    dx = _row_grads(dy, xhat, rstd, w, dresidual, centered=not rms)
    lead = _summed_axes(y, weight)
    return dx, ((dy * xhat).sum(axis=lead) if weight is not None else None), dy.sum(axis=lead)


FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}
QUANT_GROUP_COLS = 128


def quantize_fp8(y, fmt: str, scaling: str, scale=None):
    """(q, scales, amax) of y as the kernels store an fp8 output: y rounded
    to float32, multiplied by the float32 reciprocal of its scale (given, or
    amax(|y|) / the format's largest value per row or per 128 columns, 1
    where that amax is 0), saturated to the finite range and rounded to
    nearest even (ml_dtypes). q is a numpy ml_dtypes array (numpy inputs);
    scales None for "tensor"; amax the largest |y| (NaN ignored, 0 if none).
    numpy only (the fp8 rounding is ml_dtypes')."""
    import ml_dtypes

    y32 = np.asarray(y, dtype=np.float64).astype(np.float32)
    fmax = np.float32(FP8_MAX[fmt])
    a = np.abs(y32)
    with np.errstate(all="ignore"):
        if scaling == "tensor":
            scales = None
            inv = np.float32(1) / np.float32(np.asarray(scale, dtype=np.float32).reshape(()))
        else:
            groups = a if scaling == "row" else a.reshape(*a.shape[:-1], -1, QUANT_GROUP_COLS)
            m = np.fmax.reduce(groups, axis=-1, initial=np.float32(0)).astype(np.float32)  # NaN ignored
            scales = np.where(m > 0, m / fmax, np.float32(1)).astype(np.float32)
            inv = np.float32(1) / scales
            inv = inv[..., None] if scaling == "row" else np.repeat(inv, QUANT_GROUP_COLS, axis=-1)
        q32 = (y32 * inv).astype(np.float32)
        q = np.clip(q32, -fmax, fmax).astype(getattr(ml_dtypes, fmt))
        amax = np.float32(np.fmax.reduce(a, axis=None, initial=np.float32(0)))
    return q, scales, np.asarray(amax, dtype=np.float32)


# Dropout masks: Philox4x32-10 (Salmon et al., SC'11), counter-based, so a backward regenerates the forward's
# mask from the seed instead of storing it. Element i of a tensor (flat index in C order over its logical
# shape, whatever its layout) takes word i % 4 of Philox(counter = (i // 4 as two 32-bit halves, stream, 0),
# key = (the seed's two 32-bit halves)), and is kept when that word is >= floor(p * 2^32). Stream 0 is x's
# mask, stream 1 that of the parallel branch x1.
_PHILOX_M = (0xD2511F53, 0xCD9E8D57)
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)


def philox4x32(counter, key, rounds: int = 10):
    """Philox4x32 over arrays: counter a (..., 4) and key a (..., 2) array of
    uint32 words (broadcast); returns the (..., 4) uint32 output."""
    c = np.asarray(counter, dtype=np.uint64) & 0xFFFFFFFF
    k = np.asarray(key, dtype=np.uint64) & 0xFFFFFFFF
    c0, c1, c2, c3 = (c[..., j] for j in range(4))
    k0, k1 = k[..., 0], k[..., 1]
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + _PHILOX_W[0]) & 0xFFFFFFFF, (k1 + _PHILOX_W[1]) & 0xFFFFFFFF
        p0, p1 = c0 * _PHILOX_M[0], c2 * _PHILOX_M[1]  # 32 x 32 -> 64 bits: exact in uint64
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & 0xFFFFFFFF, (p0 >> 32) ^ c3 ^ k1, p0 & 0xFFFFFFFF
    return np.stack([c0, c1, c2, c3], axis=-1).astype(np.uint32)


def dropout_keep(shape: tuple, p: float, seed: int, stream: int = 0):
    """The keep mask (bool, `shape`) of dropout with probability p and `seed`,
    as the kernels draw it (see the Philox note above; `stream` 1: x1's)."""
    size = int(np.prod(shape, dtype=np.int64))
    blocks = np.arange((size + 3) // 4, dtype=np.uint64)
    counter = np.stack([blocks & 0xFFFFFFFF, blocks >> 32, np.full_like(blocks, stream), np.zeros_like(blocks)],
                       axis=-1)
    seed = int(seed) & (2**64 - 1)
    words = philox4x32(counter, np.array([seed & 0xFFFFFFFF, seed >> 32], dtype=np.uint64)).reshape(-1)[:size]
    return (words >= np.uint32(dropout_threshold(p))).reshape(shape)


def dropout_threshold(p: float) -> int:
    """The 32-bit word below which an element is dropped: floor(p * 2^32)."""
    return min(int(float(p) * 2**32), 2**32 - 1)


def branch_input(x, *, dropout_p: float = 0.0, seed: int | None = None, rowscale=None, stream: int = 0):
    """(x0 * rowscale * keep / (1 - p), keep) in float64: the branch summed with
    the residual before the norm (keep None without dropout). rowscale has
    shape x.shape[:-1]; `stream` 1 draws the parallel branch x1's mask."""
    h = _f64(x)
    if rowscale is not None:
        h = h * _f64(rowscale)[..., None]
    keep = None
    if dropout_p:
        keep = dropout_keep(h.shape, dropout_p, seed, stream)
        h = np.where(keep, h / (1.0 - dropout_p), 0.0)
    return h, keep


def branch_grad(dh, keep, dropout_p: float = 0.0, rowscale=None):
    """The gradient of the branch input x0 from that of h: dh * keep / (1 - p) * rowscale, float64."""
    g = _f64(dh)
    if keep is not None:
        g = np.where(keep, g / (1.0 - dropout_p), 0.0)
    return g * _f64(rowscale)[..., None] if rowscale is not None else g


def attention_delta(out, grad_out):
    """D = rowsum(out * grad_out) over the last axis, float64."""
    return (_f64(out) * _f64(grad_out)).sum(axis=-1)
