"""Tier C: rows at the ends of fp32's and fp16's range (issue 16, item 4). A row's sum of squares in fp32
overflows for deviations of about sqrt(3.4e38 / N) and more; such rows are summed again scaled, and the
rows sharing a warp, CTA or cluster with them must come out as they would alone."""
import numpy as np
import pytest

import cunorm
from cunorm import check, reference

pytestmark = pytest.mark.gpu

# Kernels of every reduction shape: several rows a warp (128), rows of several warps with several rows a
# CTA (768, 4096: the scaled sum's barrier is the row's own warps), the general kernel (1000, 4097) and
# clusters (65536, 65537).
SIZES = (128, 768, 1000, 4096, 4097, 65536, 65537)
ROW_SCALES = (1.0, 1e18, 1e-18)


def _poisoned(shape, dtype):
    import cupy

    return cupy.full(shape, cupy.nan, dtype=dtype)


def _mixed_rows(rng, m, n):
    """fp32 rows of mean 0.5 and std 2 (the base), and the same rows each scaled by 1, 1e18 or 1e-18, drawn
    per row so that scaled rows sit beside unscaled ones in every warp and CTA."""
    import cupy

    base = (0.5 + 2.0 * rng.standard_normal((m, n))).astype(np.float32)
    scales = rng.choice(ROW_SCALES, size=m)
    scales[:3] = ROW_SCALES  # each kind at least once
    x = (base.astype(np.float64) * scales[:, None]).astype(np.float32)
    return cupy.asarray(base), cupy.asarray(x), scales


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("n", SIZES)
def test_fp32_rows_scaled_by_1e18_and_1e_18_normalize_as_unscaled(op, n, rng):
    """y of a row scaled by 1e18 (its squares overflow fp32) or 1e-18 is the y of the unscaled row, with
    eps = 0 (an eps > 0 is a floor on the variance, not scale-free); the backward matches float64 on every
    row; mean and rstd are finite."""
    import cupy

    m = 67
    base, x, scales = _mixed_rows(rng, m, n)
    w = cupy.asarray((1 + 0.5 * rng.standard_normal(n)).astype(np.float32))
    fwd = getattr(cunorm, op)
    y0 = fwd(base, w, eps=0.0, out=_poisoned(base.shape, np.float32))
    y, *stats = fwd(x, w, eps=0.0, return_stats=True, out=_poisoned(x.shape, np.float32))
    assert bool(cupy.isfinite(y).all()) and all(bool(cupy.isfinite(s).all()) for s in stats)
    assert check.rel_l2(y, y0) <= 1e-5
    ref = getattr(reference, op)(x, w, eps=0.0)
    assert check.rel_l2(y, ref[0]) <= 1e-5
    for s in ROW_SCALES:  # mean and rstd scale with the row: each kind of row against its own size
        rows = cupy.asarray(scales == s)
        # Rows of 1e-18, whose squares sit near fp32's smallest normal (1.2e-38), came out with rstd up to
        # 1.8e-5 above float64's on an H100 (up to 4.5e-6 over a call's such rows); other rows within 1e-7.
        tolerance = 2e-5 if s < 1 else 1e-6
        for got, want in zip(stats, ref[1:]):
            assert check.rel_l2(got[rows], want[rows]) <= tolerance, s

    dy = cupy.asarray(rng.standard_normal((m, n)).astype(np.float32))
    dx_out = _poisoned(x.shape, np.float32)
    if op == "layer_norm":
        grads = cunorm.layer_norm_backward(dy, x, *stats, w, out=dx_out)
        refs = reference.layer_norm_backward(dy, x, ref[1], ref[2], w)
    else:
        grads = cunorm.rms_norm_backward(dy, x, *stats, w, out=dx_out)
        refs = reference.rms_norm_backward(dy, x, ref[1], w)
    dx, dx_ref = grads[0], refs[0]
    for s in ROW_SCALES:  # dx scales as 1 / scale
        rows = cupy.asarray(scales == s)
        assert check.rel_l2(dx[rows], dx_ref[rows]) <= 1e-5, s
    for g, r in zip(grads[1:], refs[1:]):
        if r is not None:
            assert check.rel_l2(g, r) <= 1e-5


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("n", (128, 4096, 65536))
def test_rows_with_inf_stay_nan_beside_rows_whose_squares_overflow(op, n):
    """The scaled second sum must not turn a row holding inf, or NaN, into a finite one, nor touch its
    neighbours."""
    import cupy

    x = cupy.full((6, n), 3e19, dtype=cupy.float32)
    x[:, ::2] = -3e19
    x[1, 7] = cupy.inf
    x[4, 3] = cupy.nan
    x[5] = cupy.linspace(-1, 1, n, dtype=cupy.float32)
    y, *stats = getattr(cunorm, op)(x, return_stats=True, out=_poisoned(x.shape, np.float32))
    for row in (0, 2, 3, 5):
        assert bool(cupy.isfinite(y[row]).all()), row
        assert all(bool(cupy.isfinite(s[row])) for s in stats), row
    for row in (1, 4):
        assert bool(cupy.isnan(y[row]).all()) and bool(cupy.isnan(stats[-1][row])), row
    ref = getattr(reference, op)(x[[0, 2, 3, 5]])
    assert check.rel_l2(y[[0, 2, 3, 5]], ref[0]) <= 1e-5


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_fp16_rows_up_to_60000(op, with_residual, rng):
    """fp16 rows spanning its range (squares far past fp16's, and past fp32's sum for no N): finite, as the
    float64 reference, and scale-invariant: the rows divided by 2^10 (exact here) give the same y."""
    import cupy

    n = 4096
    x = cupy.asarray(rng.uniform(-60000, 60000, size=(32, n)).astype(np.float16))
    r = cupy.asarray(rng.uniform(-2000, 2000, size=(32, n)).astype(np.float16)) if with_residual else None
    w = cupy.asarray(rng.standard_normal(n).astype(np.float16))
    fwd = getattr(cunorm, op)
    wide = {"residual_dtype": "float32"} if with_residual else {}  # h kept in fp32: fp16 would overflow
    got = fwd(x, w, eps=0.0, residual=r, out=_poisoned(x.shape, np.float16), **wide)
    y, h = (got[0], got[1]) if with_residual else (got, x)
    assert bool(cupy.isfinite(y).all())
    assert check.rel_l2(y, getattr(reference, op)(h, w, eps=0.0)[0]) <= check.TOLERANCE["float16"]
    small = (x.astype(np.float32) / 1024).astype(np.float16)
    r_small = None if r is None else (r.astype(np.float32) / 1024).astype(np.float16)
    got_small = fwd(small, w, eps=0.0, residual=r_small, **wide)
    y_small = got_small[0] if with_residual else got_small
    assert check.rel_l2(y_small, y) <= check.TOLERANCE["float16"]
