"""Tier A: dropout and a row scale on the branch before the residual add
(issue 20), on the numpy path: the Philox mask the kernels are to draw, the
forward and the backward against torch's autograd of the same forward, and
the argument checks."""
import numpy as np
import pytest

import cunorm
from cunorm import reference
from cunorm.norm import calls

# Known-answer vectors of Philox4x32-10 (Random123's kat_vectors): counter, key, output.
PHILOX_KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter, key, want", PHILOX_KAT)
def test_philox_known_answers(counter, key, want):
    got = reference.philox4x32(np.array(counter), np.array(key))
    assert got.dtype == np.uint32 and [int(v) for v in got] == list(want)


def _philox_scalar(counter, key):
    """Philox4x32-10 on Python ints, one block: written apart from cunorm.reference's array form."""
    c, (k0, k1) = list(counter), key
    mask = 2**32 - 1
    for r in range(10):
        if r:
            k0, k1 = (k0 + 0x9E3779B9) & mask, (k1 + 0xBB67AE85) & mask
        a, b = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [((b >> 32) ^ c[1] ^ k0) & mask, b & mask, ((a >> 32) ^ c[3] ^ k1) & mask, a & mask]
    return c


@pytest.mark.parametrize("p, seed", [(0.3, 0x9ABCDEF0_12345678), (0.05, 2**64 - 1), (0.9, 0)])
def test_dropout_mask_is_the_documented_spec(p, seed):
    """Every element of a (6, 7, 5) tensor against the spec, element by element
    (independent scalar Philox): element i (C order) is kept when word i % 4
    of Philox(counter = (i // 4 low, high 32 bits, 0, 0), key = (seed low,
    high 32 bits)) is >= floor(p * 2^32)."""
    m = reference.dropout_keep((6, 7, 5), p, seed)
    assert m.dtype == bool and m.shape == (6, 7, 5)
    key = (seed & (2**32 - 1), seed >> 32)
    threshold = int(p * 2**32)
    want = [_philox_scalar((i // 4 & (2**32 - 1), i // 4 >> 32, 0, 0), key)[i % 4] >= threshold for i in range(210)]
    assert m.reshape(-1).tolist() == want
    assert reference.dropout_threshold(p) == threshold


def test_dropout_mask_rate_and_seeds():
    """The keep rate is 1 - p; another seed draws another mask; p = 0 keeps all."""
    flat = reference.dropout_keep((210,), 0.3, 2**40 + 17)
    assert (reference.dropout_keep((6, 7, 5), 0.3, 2**40 + 17).reshape(-1) == flat).all()
    big = reference.dropout_keep((1000, 1000), 0.3, 5)
    assert abs(big.mean() - 0.7) < 3e-3
    assert (big != reference.dropout_keep((1000, 1000), 0.3, 6)).mean() > 0.3
    assert reference.dropout_keep((9,), 0.0, 1).all()


def _torch_forward(x0, residual, rowscale, keep, p, weight, bias, rms):
    """y of the branch-and-norm forward in torch (rms=None: h itself)."""
    import torch

    h = x0 * rowscale[..., None] if rowscale is not None else x0
    if keep is not None:
        h = torch.where(torch.from_numpy(keep), h / (1 - p), torch.zeros_like(h))
    if residual is not None:
        h = h + residual
    if rms is None:
        return h
    if rms:
        y = h * torch.rsqrt((h * h).mean(-1, keepdim=True) + 1e-6) * weight
        return y + bias if bias is not None else y
    return torch.nn.functional.layer_norm(h, (h.shape[-1],), weight, bias, eps=1e-5)


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("p, with_rowscale, with_residual, from_output",
                         [(0.25, True, True, False), (0.5, False, True, False), (0.1, True, False, False),
                          (0.0, True, True, False), (0.3, True, True, True)])
def test_forward_and_backward_match_autograd(rms, p, with_rowscale, with_residual, from_output, rng):
    """y, residual_out (h) and the mask, then (dx, dx0, dweight, dbias)
    against torch's autograd of the same forward in float64 (the mask taken
    from reference.dropout_keep, itself checked against the spec above), h
    also reaching the loss through the skip path (dresidual): dx is h's
    gradient (the residual's), dx0 the branch input's. from_output: the
    backward from y (y=, bias=) instead of h and mean."""
    torch = pytest.importorskip("torch")
    shape, seed = (3, 5, 48), 1234
    x0 = rng.standard_normal(shape) + 0.5
    res = rng.standard_normal(shape) if with_residual else None
    rs = rng.uniform(0.5, 2.0, shape[:-1]) if with_rowscale else None
    w, b = rng.standard_normal(48), rng.standard_normal(48)
    kw = dict(dropout_p=p, seed=seed if p else None, rowscale=rs, return_stats=True, residual=res)
    if p:
        kw["return_dropout_mask"] = True
    if rms:
        out = cunorm.rms_norm(x0, w, bias=b, **kw)
        y, h, *mask, rstd = out
        mean = None
    else:
        y, h, *mask, mean, rstd = cunorm.layer_norm(x0, w, b, **kw)
    keep = reference.dropout_keep(shape, p, seed) if p else None
    if p:
        assert (mask[0] == keep).all()
    else:
        assert not mask
    t = {k: None if v is None else torch.tensor(v, requires_grad=k in ("x0", "res", "w", "b"))
         for k, v in dict(x0=x0, res=res, rs=rs, w=w, b=b).items()}
    y_ref = _torch_forward(t["x0"], t["res"], t["rs"], keep, p, t["w"], t["b"], rms)
    np.testing.assert_allclose(y, y_ref.detach().numpy(), rtol=1e-12, atol=1e-12)
    h_ref, _ = reference.branch_input(x0, dropout_p=p, seed=seed, rowscale=rs)
    np.testing.assert_allclose(h, h_ref + (res if res is not None else 0), rtol=1e-15, atol=1e-15)
    dy, dres = rng.standard_normal(shape), rng.standard_normal(shape)
    h_t = _torch_forward(t["x0"], t["res"], t["rs"], keep, p, None, None, rms=None)
    ((y_ref * torch.tensor(dy)).sum() + (h_t * torch.tensor(dres)).sum()).backward()
    bw = dict(dropout_p=p, seed=seed if p else None, rowscale=rs, dresidual=dres)
    if from_output:
        kw = dict(y=y, bias=b, rstd=rstd, weight=w, **bw)
        dx, dx0, dw, db = (cunorm.rms_norm_backward(dy, **kw) if rms else cunorm.layer_norm_backward(dy, **kw))
    elif rms:
        dx, dx0, dw, db = cunorm.rms_norm_backward(dy, h, rstd, w, has_bias=True, **bw)
    else:
        dx, dx0, dw, db = cunorm.layer_norm_backward(dy, h, mean, rstd, w, **bw)
    tol = 1e-7 if from_output else 1e-10  # y's float64 rounding divided by the weight
    np.testing.assert_allclose(dx0, t["x0"].grad.numpy(), rtol=tol, atol=tol)
    if res is not None:
        np.testing.assert_allclose(dx, t["res"].grad.numpy(), rtol=tol, atol=tol)
    np.testing.assert_allclose(dw, t["w"].grad.numpy(), rtol=tol, atol=tol)
    np.testing.assert_allclose(db, t["b"].grad.numpy(), rtol=tol, atol=tol)


def test_dtypes_of_a_branch_call(rng):
    """residual_out without a residual is in residual_dtype (default x's); dx0 in dx0_dtype (default x's)."""
    x = rng.standard_normal((4, 32)).astype(np.float16)
    y, h32 = cunorm.layer_norm(x, dropout_p=0.2, seed=3, residual_dtype="float32")  # residual_in_fp32
    assert y.dtype == np.float16 and h32.dtype == np.float32
    y, h = cunorm.layer_norm(x, dropout_p=0.2, seed=3)
    assert y.dtype == h.dtype == np.float16 and (h == h32.astype(np.float16)).all()
    _, mean, rstd = cunorm.layer_norm(h, return_stats=True)
    dy = rng.standard_normal(x.shape).astype(np.float16)
    dx, dx0, dw, db = cunorm.layer_norm_backward(dy, h, mean, rstd, dropout_p=0.2, seed=3, dx0_dtype="float32")
    assert dx.dtype == np.float16 and dx0.dtype == np.float32 and dw is None and db.dtype == np.float32
    assert (dx0[~reference.dropout_keep(x.shape, 0.2, 3)] == 0).all()


def test_bad_branch_arguments_name_the_argument(rng):
    x = rng.standard_normal((4, 32)).astype(np.float32)
    with pytest.raises(ValueError, match=r"dropout_p: must be in \[0, 1\)"):
        cunorm.layer_norm(x, dropout_p=1.0, seed=1)
    for bad in ("0.1", b"0", True, np.array([0.1, 0.2]), [0.1]):
        with pytest.raises(TypeError, match="dropout_p: expected a float"):
            cunorm.rms_norm(x, dropout_p=bad, seed=1)
    assert (cunorm.rms_norm(x, dropout_p=None, seed=4) == cunorm.rms_norm(x)).all()  # None, or a seed alone: none
    with pytest.raises(ValueError, match="residual_dtype: given without a residual"):
        cunorm.layer_norm(x, residual_dtype="float32")
    with pytest.raises(ValueError, match="seed: dropout_p > 0 needs a seed"):
        cunorm.layer_norm(x, dropout_p=0.1)
    for bad in (-1, 2**64, 1.5, True):
        with pytest.raises(TypeError, match="seed: expected an int"):
            cunorm.layer_norm(x, dropout_p=0.1, seed=bad)
    with pytest.raises(ValueError, match="rowscale: shape"):
        cunorm.layer_norm(x, rowscale=np.ones(5, np.float32))
    with pytest.raises(ValueError, match="dropout_p / rowscale: not with an fp8 out_dtype"):
        cunorm.layer_norm(x, out_dtype="float8_e4m3fn", scaling="row", dropout_p=0.1, seed=1)
    with pytest.raises(ValueError, match="return_dropout_mask: only with dropout_p > 0"):
        cunorm.layer_norm(x, return_dropout_mask=True)
    _, mean, rstd = cunorm.layer_norm(x, return_stats=True)
    with pytest.raises(ValueError, match="dx0_dtype: only with dropout_p or rowscale"):
        cunorm.layer_norm_backward(x, x, mean, rstd, dx0_dtype="float32")
    with pytest.raises(ValueError, match="seed: dropout_p > 0 needs a seed"):
        cunorm.layer_norm_backward(x, x, mean, rstd, dropout_p=0.5)


def test_check_branch():
    from cunorm import arrays

    args = {"x": arrays.take(np.ones((4, 8), np.float32), "x"),
            "rowscale": arrays.take(np.ones(4, np.float32), "rowscale")}
    assert calls.check_branch(args, 0.1, 5, True) == calls.Branch(0.1, 5, True, True)
    assert not calls.check_branch({"x": args["x"]}, 0.0, 9, False).on  # a seed alone: no branch
