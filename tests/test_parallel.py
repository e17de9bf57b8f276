"""Tier A: the parallel block (issue 20) on the numpy path: x1, a second
branch summed into h with a dropout mask of its own, and a second output y1
from a second weight, forward and backward against torch's autograd of the
same forward in float64; x1's mask stream; the argument checks."""
import numpy as np
import pytest

import cunorm
from cunorm import reference


def test_x1_mask_is_stream_one(rng):
    """x1's mask: Philox counter word 2 = 1; independent of x's (stream 0)."""
    m0 = reference.dropout_keep((64, 64), 0.5, 11)
    m1 = reference.dropout_keep((64, 64), 0.5, 11, stream=1)
    assert abs(m1.mean() - 0.5) < 0.03 and 0.4 < (m0 != m1).mean() < 0.6
    counter = np.array([[3, 0, 1, 0]], dtype=np.uint64)  # block 3: elements 12..15
    words = reference.philox4x32(counter, np.array([11, 0], dtype=np.uint64))[0]
    assert list(m1.reshape(-1)[12:16]) == [w >= reference.dropout_threshold(0.5) for w in words]


def _torch_parallel(t, keep, keep1, p, rms, eps):
    """(y, y1, h) of the parallel block in torch, float64."""
    import torch

    def drop(a, k):
        return a if k is None else torch.where(torch.from_numpy(k), a / (1 - p), torch.zeros_like(a))

    h = drop(t["x"], keep)
    if t["x1"] is not None:
        h = h + drop(t["x1"], keep1)
    if t["res"] is not None:
        h = h + t["res"]
    if rms:
        xhat = h * torch.rsqrt((h * h).mean(-1, keepdim=True) + eps)
    else:
        xhat = (h - h.mean(-1, keepdim=True)) * torch.rsqrt(h.var(-1, unbiased=False, keepdim=True) + eps)
    y = xhat * t["w"] + (t["b"] if t["b"] is not None else 0)
    y1 = None if t["w1"] is None else xhat * t["w1"] + (t["b1"] if t["b1"] is not None else 0)
    return y, y1, h


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("p, with_x1, with_w1, with_b1, with_residual, from_output",
                         [(0.25, True, True, True, True, False), (0.0, True, True, False, False, False),
                          (0.4, True, False, False, False, False), (0.0, False, True, True, True, False),
                          (0.3, True, True, True, True, True), (0.0, False, True, False, False, True)])
def test_forward_and_backward_match_autograd(rms, p, with_x1, with_w1, with_b1, with_residual, from_output, rng):
    """y, y1, h and both masks, then (dx, [dx0], [dx1], dweight, dbias, [dweight1, dbias1]) against torch's
    autograd in float64, h also reaching the loss through the skip path (dresidual)."""
    torch = pytest.importorskip("torch")
    shape, seed, n = (3, 4, 40), 77, 40
    eps = 1e-6 if rms else 1e-5
    a = dict(x=rng.standard_normal(shape) + 0.3, x1=rng.standard_normal(shape) if with_x1 else None,
             res=rng.standard_normal(shape) if with_residual else None, w=rng.standard_normal(n) + 1,
             b=rng.standard_normal(n), w1=rng.standard_normal(n) + 1 if with_w1 else None,
             b1=rng.standard_normal(n) if with_b1 else None)
    kw = dict(residual=a["res"], x1=a["x1"], weight1=a["w1"], bias1=a["b1"], dropout_p=p, seed=seed if p else None,
              return_dropout_mask=bool(p), return_stats=True)
    out = list(cunorm.rms_norm(a["x"], a["w"], bias=a["b"], **kw) if rms
               else cunorm.layer_norm(a["x"], a["w"], a["b"], **kw))
    y = out.pop(0)
    y1 = out.pop(0) if with_w1 else None
    h = out.pop(0) if (with_x1 or with_residual or p) else None
    masks = [out.pop(0) for _ in range(1 + with_x1)] if p else []
    mean, rstd = (None, out.pop(0)) if rms else (out.pop(0), out.pop(0))
    assert not out
    keep = reference.dropout_keep(shape, p, seed) if p else None
    keep1 = reference.dropout_keep(shape, p, seed, stream=1) if p and with_x1 else None
    if p:
        assert (masks[0] == keep).all() and (not with_x1 or (masks[1] == keep1).all())
    t = {k: None if v is None else torch.tensor(v, requires_grad=True) for k, v in a.items()}
    y_ref, y1_ref, h_ref = _torch_parallel(t, keep, keep1, p, rms, eps)
    np.testing.assert_allclose(y, y_ref.detach().numpy(), rtol=1e-11, atol=1e-11)
    if with_w1:
        np.testing.assert_allclose(y1, y1_ref.detach().numpy(), rtol=1e-11, atol=1e-11)
    if h is not None:
        np.testing.assert_allclose(h, h_ref.detach().numpy(), rtol=1e-14, atol=1e-14)
    else:
        h = a["x"]
    dy, dy1, dres = (rng.standard_normal(shape) for _ in range(3))
    loss = (y_ref * torch.tensor(dy)).sum() + (h_ref * torch.tensor(dres)).sum()
    if with_w1:
        loss = loss + (y1_ref * torch.tensor(dy1)).sum()
    loss.backward()
    bw = dict(dresidual=dres, dropout_p=p, seed=seed if p else None, has_x1=with_x1)
    if with_w1:
        bw.update(dy1=dy1, weight1=a["w1"], has_bias1=with_b1)
    if from_output:
        bw.update(y=y, bias=a["b"], rstd=rstd, weight=a["w"])
        got = list(cunorm.rms_norm_backward(dy, **bw) if rms else cunorm.layer_norm_backward(dy, **bw))
    elif rms:
        got = list(cunorm.rms_norm_backward(dy, h, rstd, a["w"], has_bias=True, **bw))
    else:
        got = list(cunorm.layer_norm_backward(dy, h, mean, rstd, a["w"], **bw))
    tol = 1e-7 if from_output else 1e-10  # y's float64 rounding divided by the weight
    dx = got.pop(0)
    dx0 = got.pop(0) if p else dx
    dx1 = got.pop(0) if with_x1 else None
    dw, db = got.pop(0), got.pop(0)
    if with_w1:
        dw1 = got.pop(0)
        db1 = got.pop(0) if (with_b1 or not rms) else None
        np.testing.assert_allclose(dw1, t["w1"].grad.numpy(), rtol=tol, atol=tol)
        if with_b1:
            np.testing.assert_allclose(db1, t["b1"].grad.numpy(), rtol=tol, atol=tol)
        else:
            assert db1 is None
    assert not got
    np.testing.assert_allclose(dx0, t["x"].grad.numpy(), rtol=tol, atol=tol)
    if with_x1:
        np.testing.assert_allclose(dx1, t["x1"].grad.numpy(), rtol=tol, atol=tol)
        if not p:
            assert dx1 is dx
    if with_residual:
        np.testing.assert_allclose(dx, t["res"].grad.numpy(), rtol=tol, atol=tol)
    np.testing.assert_allclose(dw, t["w"].grad.numpy(), rtol=tol, atol=tol)
    np.testing.assert_allclose(db, t["b"].grad.numpy(), rtol=tol, atol=tol)


def test_dtypes_of_a_parallel_call(rng):
    """y1 in y's dtype; residual_out in residual_dtype (default x's) with x1 alone; dweight1 in weight1's,
    dbias1 in bias1_dtype (default weight1's), dx1 in dx1_dtype (default x's)."""
    x = rng.standard_normal((4, 32)).astype(np.float16)
    x1 = rng.standard_normal((4, 32)).astype(np.float32)
    w, w1 = np.ones(32, np.float32), rng.standard_normal(32).astype(np.float64)
    y, y1, h = cunorm.layer_norm(x, w, x1=x1, weight1=w1, out_dtype="bfloat16")
    assert str(y.dtype) == str(y1.dtype) == "bfloat16" and h.dtype == np.float16
    _, h32 = cunorm.rms_norm(x, x1=x1, residual_dtype="float32")
    assert h32.dtype == np.float32
    _, _, mean, rstd = cunorm.layer_norm(x, w, x1=x1, return_stats=True)
    dy = rng.standard_normal(x.shape).astype(np.float16)
    dx, dx0, dx1, dw, db, dw1, db1 = cunorm.layer_norm_backward(
        dy, h, mean, rstd, w, dropout_p=0.1, seed=2, has_x1=True, dx1_dtype="float32", dy1=dy, weight1=w1,
        has_bias1=True, bias1_dtype="float16")
    assert dx1.dtype == np.float32 and dx0.dtype == np.float16 and dw1.dtype == np.float64
    assert db1.dtype == np.float16 and dw.dtype == np.float32


def test_bad_parallel_arguments_name_the_argument(rng):
    x = rng.standard_normal((4, 32)).astype(np.float32)
    w = np.ones(32, np.float32)
    with pytest.raises(ValueError, match="x1: shape"):
        cunorm.layer_norm(x, x1=x[:2])
    with pytest.raises(ValueError, match="rowscale: not with x1"):
        cunorm.layer_norm(x, x1=x, rowscale=np.ones(4, np.float32))
    with pytest.raises(ValueError, match="bias1: needs weight1"):
        cunorm.layer_norm(x, w, bias1=w)
    with pytest.raises(ValueError, match="weight1: a second output needs the first weight"):
        cunorm.layer_norm(x, weight1=w)
    with pytest.raises(ValueError, match="weight1: shape"):
        cunorm.layer_norm(x, w, weight1=w[:8])
    with pytest.raises(ValueError, match="weight1: a second output is not made with an fp8"):
        cunorm.layer_norm(x, w, weight1=w, out_dtype="float8_e4m3fn", scaling="row")
    with pytest.raises(ValueError, match="weight1: a second output is not made beside per-head weights"):
        cunorm.rms_norm(x.reshape(1, 4, 32), np.ones((4, 32), np.float32), weight1=w)
    _, mean, rstd = cunorm.layer_norm(x, w, return_stats=True)
    with pytest.raises(ValueError, match="weight1: dy1 .* and weight1 come together"):
        cunorm.layer_norm_backward(x, x, mean, rstd, w, dy1=x)
    with pytest.raises(TypeError, match="dy1: dtype float16 must be dy's"):
        cunorm.layer_norm_backward(x, x, mean, rstd, w, dy1=x.astype(np.float16), weight1=w)
    with pytest.raises(ValueError, match="has_bias1: only with weight1"):
        cunorm.layer_norm_backward(x, x, mean, rstd, w, has_bias1=True)
    with pytest.raises(ValueError, match="dx1_dtype: only with has_x1"):
        cunorm.layer_norm_backward(x, x, mean, rstd, w, dx1_dtype="float32")
    with pytest.raises(ValueError, match="dx1_dtype: only with dropout_p > 0"):
        cunorm.layer_norm_backward(x, x, mean, rstd, w, has_x1=True, dx1_dtype="float32")
