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


def test_dropout_mask_follows_the_flat_index_and_the_seed():
    """Element i of the logical tensor takes word i % 4 of Philox(i // 4, seed):
    the mask of a (6, 7, 5) tensor is that of its 210 elements in C order;
    the keep rate is 1 - p; another seed draws another mask; p = 0 keeps all."""
    m = reference.dropout_keep((6, 7, 5), 0.3, 2**40 + 17)
    flat = reference.dropout_keep((210,), 0.3, 2**40 + 17)
    assert m.dtype == bool and (m.reshape(-1) == flat).all()
    words = reference.philox4x32(np.array([[52 // 4, 0, 0, 0]]), np.array([[17, 2**8]]))[0]
    assert flat[52] == (words[52 % 4] >= reference.dropout_threshold(0.3))
    big = reference.dropout_keep((1000, 1000), 0.3, 5)
    assert abs(big.mean() - 0.7) < 3e-3
    assert (big != reference.dropout_keep((1000, 1000), 0.3, 6)).mean() > 0.3
    assert reference.dropout_keep((9,), 0.0, 1).all()


def _torch_forward(x0, residual, rowscale, keep, p, weight, bias, rms):
    import torch

    h = x0 * rowscale[..., None] if rowscale is not None else x0
    if keep is not None:
        h = torch.where(torch.from_numpy(keep), h / (1 - p), torch.zeros_like(h))
    if residual is not None:
        h = h + residual
    if rms:
        y = h * torch.rsqrt((h * h).mean(-1, keepdim=True) + 1e-6) * weight
        return y + bias if bias is not None else y
    return torch.nn.functional.layer_norm(h, (h.shape[-1],), weight, bias, eps=1e-5)


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("p, with_rowscale, with_residual", [(0.25, True, True), (0.5, False, True),
                                                             (0.1, True, False), (0.0, True, True)])
def test_forward_and_backward_match_autograd(rms, p, with_rowscale, with_residual, rng):
    """y, residual_out (h) and the mask, then (dx, dx0, dweight, dbias)
    against torch's autograd of the same forward in float64 (the mask taken
    from reference.dropout_keep): dx is the residual's gradient, dx0 the
    branch input's."""
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
    dy = rng.standard_normal(shape)
    (y_ref * torch.tensor(dy)).sum().backward()
    bw = dict(dropout_p=p, seed=seed if p else None, rowscale=rs)
    if rms:
        dx, dx0, dw, db = cunorm.rms_norm_backward(dy, h, rstd, w, has_bias=True, **bw)
    else:
        dx, dx0, dw, db = cunorm.layer_norm_backward(dy, h, mean, rstd, w, **bw)
    np.testing.assert_allclose(dx0, t["x0"].grad.numpy(), rtol=1e-10, atol=1e-10)
    if res is not None:
        np.testing.assert_allclose(dx, t["res"].grad.numpy(), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(dw, t["w"].grad.numpy(), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(db, t["b"].grad.numpy(), rtol=1e-10, atol=1e-10)


def test_dtypes_of_a_branch_call(rng):
    """residual_out without a residual is in x's dtype; dx0 in dx0_dtype (default x's)."""
    x = rng.standard_normal((4, 32)).astype(np.float16)
    y, h = cunorm.layer_norm(x, dropout_p=0.2, seed=3)
    assert y.dtype == h.dtype == np.float16
    _, mean, rstd = cunorm.layer_norm(h, return_stats=True)
    dy = rng.standard_normal(x.shape).astype(np.float16)
    dx, dx0, dw, db = cunorm.layer_norm_backward(dy, h, mean, rstd, dropout_p=0.2, seed=3, dx0_dtype="float32")
    assert dx.dtype == np.float16 and dx0.dtype == np.float32 and dw is None and db.dtype == np.float32
    assert (dx0[~reference.dropout_keep(x.shape, 0.2, 3)] == 0).all()


def test_bad_branch_arguments_name_the_argument(rng):
    x = rng.standard_normal((4, 32)).astype(np.float32)
    with pytest.raises(ValueError, match=r"dropout_p: must be in \[0, 1\)"):
        cunorm.layer_norm(x, dropout_p=1.0, seed=1)
    with pytest.raises(TypeError, match="dropout_p: expected a float"):
        cunorm.rms_norm(x, dropout_p="a", seed=1)
    with pytest.raises(ValueError, match="seed: dropout_p > 0 needs a seed"):
        cunorm.layer_norm(x, dropout_p=0.1)
    for bad in (-1, 2**64, 1.5, True):
        with pytest.raises(TypeError, match="seed: expected an int"):
            cunorm.layer_norm(x, dropout_p=0.1, seed=bad)
    with pytest.raises(ValueError, match="rowscale: shape"):
        cunorm.layer_norm(x, rowscale=np.ones(5, np.float32))
    with pytest.raises(ValueError, match="return_dropout_mask: only with dropout_p > 0"):
        cunorm.layer_norm(x, return_dropout_mask=True)
    _, mean, rstd = cunorm.layer_norm(x, return_stats=True)
    with pytest.raises(ValueError, match="dx0_dtype: only with dropout_p or rowscale"):
        cunorm.layer_norm_backward(x, x, mean, rstd, dx0_dtype="float32")
    with pytest.raises(ValueError, match="seed: dropout_p > 0 needs a seed"):
        cunorm.layer_norm_backward(x, x, mean, rstd, dropout_p=0.5)


def test_gpu_calls_with_a_branch_are_refused_naming_the_argument():
    """Until the kernels apply them, GPU arrays with dropout_p or rowscale get
    NotImplementedError naming the argument (such calls bypass the call
    cache, so a cached plan never answers them: tests/test_gpu.py)."""
    from cunorm import arrays

    args = {"x": arrays.take(np.ones((4, 8), np.float32), "x"),
            "rowscale": arrays.take(np.ones(4, np.float32), "rowscale")}
    with pytest.raises(NotImplementedError, match="dropout_p: the GPU kernels do not apply dropout"):
        calls.check_branch(args, 0.1, 5, False, on_gpu=True)
    with pytest.raises(NotImplementedError, match="rowscale: the GPU kernels"):
        calls.check_branch(args, 0.0, None, False, on_gpu=True)
    assert calls.check_branch(args, 0.1, 5, True, on_gpu=False) == calls.Branch(0.1, 5, True, True)
    assert not calls.check_branch({"x": args["x"]}, 0.0, 9, False, on_gpu=True).on  # a seed alone: no branch
