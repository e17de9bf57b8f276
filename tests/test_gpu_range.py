"""Tier C: rows at the ends of fp32's and fp16's range (issue 16, item 4). A row's sum of squares in fp32
overflows for deviations of about sqrt(3.4e38 / N) and more; such rows are summed again scaled, and the
rows sharing a warp, CTA or cluster with them must come out as they would alone."""
import numpy as np
import pytest

import cunorm
from cunorm import check, dtypes, reference

pytestmark = pytest.mark.gpu

# (N, dtype) reaching every reduction shape dispatch picks on sm_90 (weights of x's dtype): several rows a
# warp (128), several rows a CTA of several warps each, whose scaled sum waits on the row's own warps
# (fp32 768 and 1001, the general kernel; bf16 2048 and 4096, tuned), one row a CTA (fp32 4096, 4097),
# clusters (65536, 65537).
CASES = [(128, "float32"), (768, "float32"), (1001, "float32"), (4096, "float32"), (4097, "float32"),
         (65536, "float32"), (65537, "float32"), (2048, "bfloat16"), (4096, "bfloat16")]
# 1e18: the squares' sum overflows; 1e19: each square does; 1e-18: squares near fp32's smallest normal.
ROW_SCALES = (1.0, 1e18, 1e19, 1e-18)


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("n,dtype", CASES)
def test_rows_scaled_by_1e19_to_1e_18_normalize_as_unscaled(op, n, dtype, rng, poisoned):
    """Rows of mean 0.5 and std 2, each scaled by 1, 1e18, 1e19 or 1e-18 (drawn per row, so scaled rows sit
    beside unscaled ones in every warp and CTA), eps = 0 (an eps > 0 is a floor on the variance, not
    scale-free): y, mean and rstd match float64, the unscaled rows bit for bit as in a call without the
    scaled ones, and the backward matches float64 on every row."""
    import cupy

    m, dt = 67, dtypes.numpy_dtype(dtype)
    base = (0.5 + 2.0 * rng.standard_normal((m, n))).astype(dt)
    scales = rng.choice(ROW_SCALES, size=m)
    scales[:len(ROW_SCALES)] = ROW_SCALES  # each kind at least once
    x = cupy.asarray((base.astype(np.float64) * scales[:, None]).astype(dt))
    w = cupy.asarray((1 + 0.5 * rng.standard_normal(n)).astype(dt))
    fwd, tol = getattr(cunorm, op), check.TOLERANCE[dtype]
    y0, *stats0 = fwd(cupy.asarray(base), w, eps=0.0, return_stats=True, out=poisoned(base.shape, dt))
    y, *stats = fwd(x, w, eps=0.0, return_stats=True, out=poisoned(x.shape, dt))
    assert bool(cupy.isfinite(y).all()) and all(bool(cupy.isfinite(s).all()) for s in stats)
    unit = cupy.asarray(scales == 1.0)
    assert cupy.array_equal(y[unit], y0[unit])
    assert all(cupy.array_equal(s[unit], s0[unit]) for s, s0 in zip(stats, stats0))
    ref = getattr(reference, op)(x, w, eps=0.0)
    assert check.rel_l2(y, ref[0]) <= tol
    if dtype == "float32":  # fp32 holds the scaled rows' values exactly enough to compare with the unscaled y
        assert check.rel_l2(y, y0) <= tol
    for s in ROW_SCALES:  # mean and rstd scale with the row: each kind of row against its own size
        rows = cupy.asarray(scales == s)
        for name, got, want in zip(("mean", "rstd") if op == "layer_norm" else ("rstd",), stats, ref[1:]):
            assert check.rel_l2(got[rows], want[rows]) <= 2e-6, (s, name)

    dy = cupy.asarray(rng.standard_normal((m, n)).astype(dt))
    dx_out = poisoned(x.shape, dt)
    # The reference takes the kernel's own statistics: the gradients of what the forward computed.
    if op == "layer_norm":
        grads = cunorm.layer_norm_backward(dy, x, *stats, w, out=dx_out)
        refs = reference.layer_norm_backward(dy, x, *stats, w)
    else:
        grads = cunorm.rms_norm_backward(dy, x, *stats, w, out=dx_out)
        refs = reference.rms_norm_backward(dy, x, *stats, w)
    for s in ROW_SCALES:  # dx scales as 1 / scale
        rows = cupy.asarray(scales == s)
        assert check.rel_l2(grads[0][rows], refs[0][rows]) <= tol, s
    for g, r in zip(grads[1:], refs[1:]):
        if r is not None:
            assert check.rel_l2(g, r) <= tol


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("n", (128, 768, 1001, 4096, 65536))
def test_rows_past_the_range_are_nan_never_zeros(op, n, poisoned):
    """Rows holding inf or NaN, and rows whose std passes 2^126 (their rstd would be below fp32's smallest
    normal), come out NaN (y, mean, rstd), beside rows just inside the range (std 5e37) and ordinary rows
    that come out right: the scaled second sum neither hides a bad row nor touches its neighbours."""
    import cupy

    x = cupy.full((8, n), 3e19, dtype=cupy.float32)
    x[:, ::2] = -3e19  # rows 0, 2, 3: squares overflow, rescued
    x[1, 7] = cupy.inf
    x[4, 3] = cupy.nan
    x[5] = cupy.linspace(-1, 1, n, dtype=cupy.float32)
    x[6] = 2e38
    x[6, ::2] = -2e38  # std 2e38: past 2^126
    x[7] = 5e37
    x[7, ::2] = -5e37  # std 5e37: rstd 2e-38, still normal
    y, *stats = getattr(cunorm, op)(x, return_stats=True, out=poisoned(x.shape, np.float32))
    good = [0, 2, 3, 5, 7]
    for row in good:
        assert bool(cupy.isfinite(y[row]).all()) and all(bool(cupy.isfinite(s[row])) for s in stats), row
    for row in (1, 4, 6):
        assert bool(cupy.isnan(y[row]).all()) and all(bool(cupy.isnan(s[row])) for s in stats), row
    assert check.rel_l2(y[good], getattr(reference, op)(x[good])[0]) <= 1e-5


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_fp16_rows_up_to_60000(op, with_residual, rng, poisoned):
    """fp16 rows spanning its range (squares far past fp16's, and past fp32's sum for no N): finite, as the
    float64 reference, and scale-invariant: the rows divided by 2^10 (exact here) give the same y."""
    import cupy

    n = 4096
    x = cupy.asarray(rng.uniform(-60000, 60000, size=(32, n)).astype(np.float16))
    r = cupy.asarray(rng.uniform(-2000, 2000, size=(32, n)).astype(np.float16)) if with_residual else None
    w = cupy.asarray(rng.standard_normal(n).astype(np.float16))
    fwd = getattr(cunorm, op)
    wide = {"residual_dtype": "float32"} if with_residual else {}  # h kept in fp32: fp16 would overflow
    got = fwd(x, w, eps=0.0, residual=r, out=poisoned(x.shape, np.float16), **wide)
    y, h = (got[0], got[1]) if with_residual else (got, x)
    assert bool(cupy.isfinite(y).all())
    assert check.rel_l2(y, getattr(reference, op)(h, w, eps=0.0)[0]) <= check.TOLERANCE["float16"]
    small = (x.astype(np.float32) / 1024).astype(np.float16)
    r_small = None if r is None else (r.astype(np.float32) / 1024).astype(np.float16)
    got_small = fwd(small, w, eps=0.0, residual=r_small, **wide)
    y_small = got_small[0] if with_residual else got_small
    assert check.rel_l2(y_small, y) <= check.TOLERANCE["float16"]
