"""Tier C: LayerNorm statistics on rows far from zero mean (issue 16, item 2). The mean in fp32 is rounded by
|mean| / std times fp32's epsilon of the std; fp32 rows (REFINE_MEAN) undo that rounding in the forward (the
mean of h - mean is added) and in the backward (the mean of (x - mean) * rstd), so that rows of mean 1e4 and
std 1 normalize, and differentiate, within 1e-5 of float64."""
import numpy as np
import pytest

import cunorm
from cunorm import check, reference

pytestmark = pytest.mark.gpu

OFFSET_TOLERANCE = 1e-5


def _dy_along_xhat(rows, rng):
    """dy of the rows' own xhat plus noise (float64 rows in, fp32 out): mean(g * xhat) is then O(1), so dx
    moves by about the mean's fp32 rounding (5e-4 of the std at mean 1e4) where the backward does not undo it;
    with dy independent of xhat, dx would move by only about 1e-5 (and only dweight would show it)."""
    xhat = (rows - rows.mean(axis=-1, keepdims=True)) / rows.std(axis=-1, keepdims=True)
    return (xhat + 0.5 * rng.standard_normal(rows.shape)).astype(np.float32)


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("n", [1024, 2048, 4096, 5120, 65536, 65537])
def test_rows_of_mean_1e4_and_std_1_within_1e_5(n, residual, rng, poisoned):
    """fp32 rows of mean 1e4 (drawn per row, of either sign) and std 1: y, mean and rstd of the forward, then
    dx, dweight and dbias of the backward from the forward's own (fp32) statistics (dy along xhat), every
    element against the float64 reference of the exact rows; with a residual, h = x + residual (both fp32) is
    what is offset."""
    import cupy

    m = 48
    offsets = rng.choice([-1.0, 1.0], size=(m, 1)) * rng.uniform(0.5e4, 1.5e4, size=(m, 1))
    x = (offsets + rng.standard_normal((m, n))).astype(np.float32)
    res = rng.standard_normal((m, n)).astype(np.float32) if residual else None
    w = (1 + 0.5 * rng.standard_normal(n)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    dy = _dy_along_xhat(x.astype(np.float64) + (res if residual else 0.0), rng)
    xg, wg, bg, dyg = map(cupy.asarray, (x, w, b, dy))
    kw = dict(residual=cupy.asarray(res), out=poisoned((m, n))) if residual else dict(out=poisoned((m, n)))
    outs = cunorm.layer_norm(xg, wg, bg, return_stats=True, **kw)
    y, h, mean, rstd = outs if residual else (outs[0], None, *outs[1:])
    # with a residual, the row normalized is h rounded to fp32 (stored as residual_out): the reference's too
    h32 = (x.astype(np.float64) + (res if residual else 0.0)).astype(np.float32)
    y_ref, mean_ref, rstd_ref = reference.layer_norm(h32.astype(np.float64), w, b, 1e-5)
    assert check.rel_l2(y, y_ref) <= OFFSET_TOLERANCE
    assert check.rel_l2(mean, mean_ref) <= 2e-7 and check.rel_l2(rstd, rstd_ref) <= 1e-6
    if residual:
        assert cupy.array_equal(h, cupy.asarray(h32))

    src = h if residual else xg
    dres = cupy.asarray(rng.standard_normal((m, n)).astype(np.float32)) if residual else None
    dx, dw, db = cunorm.layer_norm_backward(dyg, src, mean, rstd, wg, dresidual=dres, out=poisoned((m, n)))
    refs = reference.layer_norm_backward(dy, cupy.asnumpy(src), mean_ref, rstd_ref, w,
                                         dresidual=None if dres is None else cupy.asnumpy(dres))
    for name, got, want in zip(("dx", "dweight", "dbias"), (dx, dw, db), refs):
        assert check.rel_l2(got, want) <= OFFSET_TOLERANCE, name


@pytest.mark.parametrize("n", [7, 1001, 1024, 4096, 65537])
def test_rows_of_one_value_give_the_bias_bit_for_bit(n, rng, poisoned):
    """A row of one value (near 1e4, small, or 0: the forward leaves rows of zeros out of its offset test) has
    variance 0: y is beta exactly, mean is the value and rstd 1 / sqrt(eps); the backward (xhat = 0 there)
    matches float64 given those statistics."""
    import cupy

    m = 33
    kind = rng.random((m, 1))
    values = np.where(kind < 0.4, 1e4 + rng.uniform(-100, 100, (m, 1)), rng.standard_normal((m, 1)))
    values[kind[:, 0] > 0.8] = 0.0
    x = np.broadcast_to(values, (m, n)).astype(np.float32)
    w = (1 + 0.5 * rng.standard_normal(n)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    y, mean, rstd = cunorm.layer_norm(cupy.asarray(x), cupy.asarray(w), cupy.asarray(b), return_stats=True,
                                      out=poisoned((m, n)))
    assert cupy.array_equal(y, cupy.asarray(np.broadcast_to(b, (m, n))))
    assert cupy.array_equal(mean, cupy.asarray(x[:, 0]))
    assert check.rel_l2(rstd, np.full(m, 1 / np.sqrt(1e-5))) <= 1e-6
    dy = rng.standard_normal((m, n)).astype(np.float32)
    dx, dw, db = cunorm.layer_norm_backward(cupy.asarray(dy), cupy.asarray(x), mean, rstd, cupy.asarray(w),
                                            out=poisoned((m, n)))
    refs = reference.layer_norm_backward(dy, x, cupy.asnumpy(mean), cupy.asnumpy(rstd), w)
    for got, want in zip((dx, dw, db), refs):
        assert check.rel_l2(got, want) <= check.TOLERANCE["float32"]


@pytest.mark.parametrize("n", [128, 256, 512, 768, 1024, 1001, 4096])
def test_offset_rows_beside_centred_rows_match_each_row_alone(n, rng, poisoned):
    """Offset rows (mean 1e4) and centred rows mixed in one call, where rows share a warp (128-512, q/k-norm's
    sizes), CTAs hold several rows (768, 1024) or rows of several warps: every row's y, mean, rstd and dx are
    bitwise those of the row computed alone (the
    refinement of one row never changes its neighbours'), and within 1e-5 of float64. Odd N (1001) in
    batch-invariant mode, which is where the README promises it."""
    import cupy

    was = cunorm.batch_invariant()
    cunorm.set_batch_invariant(n % 4 != 0)
    try:
        _offset_rows_beside_centred_rows(n, rng, cupy, poisoned)
    finally:
        cunorm.set_batch_invariant(was)


def _offset_rows_beside_centred_rows(n, rng, cupy, poisoned):
    m = 40
    offset = rng.random((m, 1)) < 0.5
    x = (np.where(offset, 1e4, 0.0) + rng.standard_normal((m, n))).astype(np.float32)
    w = (1 + 0.5 * rng.standard_normal(n)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    dy = _dy_along_xhat(x.astype(np.float64), rng)
    xg, wg, bg, dyg = map(cupy.asarray, (x, w, b, dy))
    y, mean, rstd = cunorm.layer_norm(xg, wg, bg, return_stats=True, out=poisoned((m, n)))
    dx, dw, db = cunorm.layer_norm_backward(dyg, xg, mean, rstd, wg, out=poisoned((m, n)))
    y_ref, mean_ref, rstd_ref = reference.layer_norm(x.astype(np.float64), w, b, 1e-5)
    assert check.rel_l2(y, y_ref) <= OFFSET_TOLERANCE
    refs = reference.layer_norm_backward(dy, x, mean_ref, rstd_ref, w)
    for name, got, want in zip(("dx", "dweight", "dbias"), (dx, dw, db), refs):
        assert check.rel_l2(got, want) <= OFFSET_TOLERANCE, name
    for i in range(m):
        yi, mi, ri = cunorm.layer_norm(xg[i:i + 1], wg, bg, return_stats=True, out=poisoned((1, n)))
        dxi = cunorm.layer_norm_backward(dyg[i:i + 1], xg[i:i + 1], mi, ri, wg, out=poisoned((1, n)))[0]
        assert cupy.array_equal(yi, y[i:i + 1]) and cupy.array_equal(mi, mean[i:i + 1]), i
        assert cupy.array_equal(ri, rstd[i:i + 1]) and cupy.array_equal(dxi, dx[i:i + 1]), i


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("n", [768, 1024, 4096, 65536, 65537])
def test_centred_rows_keep_their_bits_beside_a_few_offset_rows(n, residual, rng, poisoned):
    """Many rows a CTA, a few of them offset (1%): each centred row's dx is bitwise what it is in the same call
    with every row centred, and each offset row's dx what it is alone, so that the refinement of a row never
    reaches its neighbours' (it is decided per row; a kernel that decided it per CTA or cluster would have
    to keep those bits too); dx, dweight and dbias within 1e-5 of float64. Odd N in batch-invariant mode,
    where the README promises a row's bits alone and in a batch."""
    import cupy

    was = cunorm.batch_invariant()
    cunorm.set_batch_invariant(n % 4 != 0)
    try:
        _centred_rows_beside_a_few_offset_rows(n, residual, rng, cupy, poisoned)
    finally:
        cunorm.set_batch_invariant(was)


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("n", [32769, 65537])
def test_general_rows_keep_their_bits_beside_a_few_offset_rows(n, residual, rng, poisoned):
    """As above on the general kernel (batch-invariant mode off), where the rows' lanes outside the row are
    filled differently by the refined and the plain row loop of kernels that pick one per CTA (PERFORMANCE.md
    version 46: the H100's picks at 32769 and 65537): each centred row's dx is bitwise what it is with every
    row centred (same positions, same alignments). A row alone starts elsewhere, so it is not compared."""
    import cupy

    was = cunorm.batch_invariant()
    cunorm.set_batch_invariant(False)
    try:
        _centred_rows_beside_a_few_offset_rows(n, residual, rng, cupy, poisoned, alone=False)
    finally:
        cunorm.set_batch_invariant(was)


def _centred_rows_beside_a_few_offset_rows(n, residual, rng, cupy, poisoned, alone=True):
    m = 2048 if n <= 4096 else 160
    offset = np.zeros((m, 1), dtype=bool)
    offset[rng.choice(m, size=max(2, m // 100), replace=False)] = True
    centred = rng.standard_normal((m, n))
    x = (np.where(offset, 1e4, 0.0) + centred).astype(np.float32)
    x_plain = np.where(offset, rng.standard_normal((m, n)), centred).astype(np.float32)
    w = (1 + 0.5 * rng.standard_normal(n)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    dy = cupy.asarray(_dy_along_xhat(x.astype(np.float64), rng))
    dres = cupy.asarray(rng.standard_normal((m, n)).astype(np.float32)) if residual else None
    wg, bg = cupy.asarray(w), cupy.asarray(b)
    grads, stats = {}, {}
    for name, rows in (("mixed", x), ("plain", x_plain)):
        xg = cupy.asarray(rows)
        _, mean, rstd = cunorm.layer_norm(xg, wg, bg, return_stats=True, out=poisoned((m, n)))
        grads[name] = cunorm.layer_norm_backward(dy, xg, mean, rstd, wg, dresidual=dres, out=poisoned((m, n)))
        stats[name] = mean, rstd
    keep = ~offset[:, 0]
    assert cupy.array_equal(grads["mixed"][0][keep], grads["plain"][0][keep])
    mean, rstd = stats["mixed"]
    xg = cupy.asarray(x)
    for i in np.flatnonzero(offset[:, 0]) if alone else ():
        one = slice(i, i + 1)
        dxi = cunorm.layer_norm_backward(dy[one], xg[one], mean[one], rstd[one], wg,
                                         dresidual=None if dres is None else dres[one], out=poisoned((1, n)))[0]
        assert cupy.array_equal(dxi, grads["mixed"][0][one]), i
    mean_ref, rstd_ref = reference.layer_norm(x.astype(np.float64), w, b, 1e-5)[1:]
    refs = reference.layer_norm_backward(cupy.asnumpy(dy), x, mean_ref, rstd_ref, w,
                                         dresidual=None if dres is None else cupy.asnumpy(dres))
    for name, got, want in zip(("dx", "dweight", "dbias"), grads["mixed"], refs):
        assert check.rel_l2(got, want) <= OFFSET_TOLERANCE, name


@pytest.mark.parametrize("branch", ["x1", "dropout"])
def test_offset_rows_with_x1_or_dropout_within_1e_5(branch, rng, poisoned):
    """The forward's branches on offset rows: h = x + x1 with x of mean 1e4 (the parallel block's second
    input), or h = dropout(x) + residual with the residual of mean 1e4; y within 1e-5 of float64 of h as
    returned (residual_out, fp32), and the backward from it (dy along xhat) within 1e-5 too."""
    import cupy

    m, n = 48, 4096
    off = 1e4 * rng.choice([-1.0, 1.0], size=(m, 1))
    w = (1 + 0.5 * rng.standard_normal(n)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    wg, bg = cupy.asarray(w), cupy.asarray(b)
    if branch == "x1":
        x = (off + rng.standard_normal((m, n))).astype(np.float32)
        x1 = rng.standard_normal((m, n)).astype(np.float32)
        y, h, mean, rstd = cunorm.layer_norm(cupy.asarray(x), wg, bg, x1=cupy.asarray(x1), return_stats=True,
                                             out=poisoned((m, n)))
    else:
        x = rng.standard_normal((m, n)).astype(np.float32)
        res = (off + rng.standard_normal((m, n))).astype(np.float32)
        y, h, mean, rstd = cunorm.layer_norm(cupy.asarray(x), wg, bg, residual=cupy.asarray(res), dropout_p=0.1,
                                             seed=1234, return_stats=True, out=poisoned((m, n)))
    h64 = cupy.asnumpy(h).astype(np.float64)
    assert np.abs(h64.mean(axis=-1)).min() > 5e3  # the rows normalized are offset
    y_ref, mean_ref, rstd_ref = reference.layer_norm(h64, w, b, 1e-5)
    assert check.rel_l2(y, y_ref) <= OFFSET_TOLERANCE
    dy = _dy_along_xhat(h64, rng)
    grads = cunorm.layer_norm_backward(cupy.asarray(dy), h, mean, rstd, wg, out=poisoned((m, n)))
    for name, got, want in zip(("dx", "dweight", "dbias"), grads,
                               reference.layer_norm_backward(dy, h64, mean_ref, rstd_ref, w)):
        assert check.rel_l2(got, want) <= OFFSET_TOLERANCE, name


def test_fp8_outputs_of_offset_rows_round_as_float64s(rng):
    """fp8 (e4m3, per-row scales) outputs of fp32 rows of mean 1e4: the stored bits are those of the float64
    reference's y quantized, but for the few elements that y's fp32 rounding moves across an fp8 rounding
    boundary (at most 1e-3 of them; y's unrefined error, 3e-4, moves about 1% of them)."""
    import cupy

    m, n = 64, 4096
    x = (1e4 * rng.choice([-1.0, 1.0], size=(m, 1)) + rng.standard_normal((m, n))).astype(np.float32)
    w = (1 + 0.5 * rng.standard_normal(n)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    bits, scales = cunorm.layer_norm(cupy.asarray(x), cupy.asarray(w), cupy.asarray(b),
                                     out_dtype="float8_e4m3fn", scaling="row")[:2]
    y_ref = reference.layer_norm(x.astype(np.float64), w, b, 1e-5)[0]
    q_ref, scales_ref, _ = reference.quantize_fp8(y_ref, "float8_e4m3fn", "row")
    np.testing.assert_allclose(cupy.asnumpy(scales), scales_ref, rtol=1e-5)
    differ = cupy.asnumpy(bits) != q_ref.view(np.uint8)
    assert differ.mean() <= 1e-3, differ.mean()


@pytest.mark.parametrize("n", [12288, 32768, 65537, 131072])
def test_merged_moments_keep_offset_constant_and_huge_rows_exact(n, rng, poisoned):
    """LayerNorm forwards of cluster rows with merged_moments (one cluster exchange for mean and variance):
    fp32 rows of mean 1e4 and std 1 within the offset tolerances, rows of one value give the bias bit for bit,
    rows scaled by 1e19 (their squares overflow fp32) and ordinary rows within float64's tolerance."""
    import cupy

    knobs = dict(ctas_per_row=8, warps_n=4 if n <= 16384 else 16, stages=1, cache_weights=False,
                 merged_moments=True)
    m = 40
    kind = rng.integers(0, 4, size=(m, 1))  # offset, one value, scaled by 1e19, ordinary: beside each other
    kind[:4, 0] = np.arange(4)
    offsets = rng.choice([-1.0, 1.0], size=(m, 1)) * rng.uniform(0.5e4, 1.5e4, size=(m, 1))
    noise = rng.standard_normal((m, n))
    rows = np.where(kind == 0, offsets + noise, np.where(kind == 1, offsets, np.where(kind == 2, 1e19 * noise,
                                                                                       0.5 + 2.0 * noise)))
    x = rows.astype(np.float32)
    w = (1 + 0.5 * rng.standard_normal(n)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    y, mean, rstd = cunorm.layer_norm(cupy.asarray(x), cupy.asarray(w), cupy.asarray(b), return_stats=True,
                                      out=poisoned((m, n)), traits=knobs)
    y_ref, mean_ref, rstd_ref = reference.layer_norm(x.astype(np.float64), w, b, 1e-5)
    for k, name in enumerate(("offset", "one value", "scaled by 1e19", "ordinary")):
        at = cupy.asarray(kind[:, 0] == k)
        sel = kind[:, 0] == k
        if name == "one value":
            assert cupy.array_equal(y[at], cupy.asarray(np.broadcast_to(b, (int(sel.sum()), n)))), name
            assert cupy.array_equal(mean[at], cupy.asarray(x[sel, 0])), name
        else:
            assert check.rel_l2(y[at], y_ref[sel]) <= OFFSET_TOLERANCE, name
            # the mean of a row far from zero within 2e-7 of itself; of the others (summed to much less than
            # their values) within 2e-6, as tests/test_gpu_range.py has them
            assert check.rel_l2(mean[at], mean_ref[sel]) <= (2e-7 if name == "offset" else 2e-6), name
        assert check.rel_l2(rstd[at], rstd_ref[sel]) <= 1e-6, name


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
@pytest.mark.parametrize("n", [12288, 65537])
def test_merged_moments_on_rows_whose_ctas_differ(n, dtype, rng, poisoned):
    """Rows whose CTAs' means differ (a step halfway, a ramp, a spike over a tenth of the row), merged knobs
    forced; y, mean and rstd against float64. A CTA's columns interleave with its peers' at every load step, so
    the spread of the CTAs' means is 0-55% of a row's variance here (none for the step at most shapes, most
    for the spike): enough that dropping the merge's between-CTA term would move rstd by 0.75% or more, far
    above the bound. (Rows far from zero mean, which merged kernels sum two-pass again, are
    test_merged_moments_keep_offset_constant_and_huge_rows_exact's.)"""
    import cupy

    from cunorm import dtypes

    knobs = dict(ctas_per_row=8, warps_n=4 if n <= 16384 else 16, stages=1, cache_weights=False,
                 merged_moments=True)
    m, cols = 24, np.arange(n) / n
    noise = rng.standard_normal((m, n))
    shapes = [10.0 * (cols >= 0.5), 20.0 * cols, 50.0 * ((cols >= 0.3) & (cols < 0.4))]
    rows = np.stack([shapes[i % 3] + noise[i] for i in range(m)])
    dt = dtypes.numpy_dtype(dtype)
    x = rows.astype(dt)
    w = (1 + 0.5 * rng.standard_normal(n)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    y, mean, rstd = cunorm.layer_norm(cupy.asarray(x), cupy.asarray(w), cupy.asarray(b), return_stats=True,
                                      out=poisoned((m, n), dt), traits=knobs)
    y_ref, mean_ref, rstd_ref = reference.layer_norm(x.astype(np.float64), w, b, 1e-5)
    tol = check.TOLERANCE[dtype]
    assert check.rel_l2(y, y_ref) <= tol
    assert check.rel_l2(mean, mean_ref) <= 2e-6 and check.rel_l2(rstd, rstd_ref) <= 2e-6
